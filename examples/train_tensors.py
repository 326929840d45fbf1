"""Train on JPEG samples delivered as tensor batches, decoded where it is cheapest.

    python examples/train_tensors.py http://data-1:8080 --dataset imagenet --epochs 1

Each DataLoader batch is one :class:`shardfeed.client.tensors.Batch`: the samples' bytes in
one shared-memory buffer that the workers hand over without pickling. The training loop
pins it and moves it to the GPU as one copy, then decodes the JPEGs there in one batched
call (on the CPU without a GPU). Expects samples with a ``jpg`` image and a ``cls`` label.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from torch.utils.data import DataLoader

from shardfeed.client.tensordecode import decode_images, decode_labels
from shardfeed.client.torch import ShardfeedDataset


def to_inputs(images: list[torch.Tensor], side: int) -> torch.Tensor:
    """Images of any size as one ``(n, 3, side, side)`` float batch."""
    return torch.stack([torch.nn.functional.interpolate(i[None].float() / 255, size=(side, side))[0]
                        for i in images])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("url", help="service URL(s), comma-separated")
    parser.add_argument("--dataset", default="imagenet")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--classes", type=int, default=1000)
    parser.add_argument("--side", type=int, default=32, help="images are resized to side x side")
    parser.add_argument("--token", default=os.environ.get("SHARDFEED_TOKEN"), help="bearer token")
    args = parser.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dataset = ShardfeedDataset(args.url, args.dataset, fields=["jpg", "cls"], output="tensors", token=args.token)
    loader = DataLoader(dataset, batch_size=args.batch_size, shuffle=True, num_workers=args.workers,
                        pin_memory=device.type == "cuda")
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3, stride=2), torch.nn.ReLU(), torch.nn.Flatten(),
                                torch.nn.LazyLinear(args.classes)).to(device)
    model(torch.zeros(1, 3, args.side, args.side, device=device))  # materialise the lazy layer
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)

    for epoch in range(args.epochs):
        began, seen, total = time.perf_counter(), 0, 0.0
        for batch in loader:
            batch = batch.to(device, non_blocking=True)  # one copy of the whole batch (pinned by the DataLoader)
            inputs = to_inputs(decode_images(batch["jpg"], device), args.side)
            labels = decode_labels(batch["cls"]).to(device)
            loss = torch.nn.functional.cross_entropy(model(inputs), labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            seen += len(batch)
            total += loss.item() * len(batch)
        took = time.perf_counter() - began
        print(f"epoch {epoch + 1}: loss {total / max(seen, 1):.3f}, {seen} samples in {took:.2f}s "
              f"({seen / took:,.0f} samples/s)")


if __name__ == "__main__":
    main()
