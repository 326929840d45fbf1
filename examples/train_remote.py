"""Train against a remote shardfeed service, resumably.

    python examples/train_remote.py http://data-1:8080,http://data-2:8080 --dataset digits \
        --checkpoint run.pt

The data comes from ``ShardfeedIterableDataset``: a deterministic shuffle per epoch,
one request per batch, batches prefetched in every DataLoader worker. The checkpoint
holds the model, the optimizer and the loader's position, so killing the script and
running it again continues with exactly the samples the interrupted epoch had not yet
seen, even with another ``--workers``. Under ``torchrun`` each rank reads its own equal
share (ranks come from ``torch.distributed``).

Expects samples with an ``npy`` array and a ``cls`` label (like ``shardfeed seed --digits``).
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
import torch

from shardfeed.client.torch import ShardfeedIterableDataset, ShardfeedLoader


def to_tensors(sample: dict) -> tuple[torch.Tensor, int]:
    image = sample["npy"].astype(np.float32)
    return torch.from_numpy(image / max(float(image.max()), 1.0)), sample["cls"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("url", help="service URL(s), comma-separated")
    parser.add_argument("--dataset", default="digits")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument("--checkpoint", help="save here every --save-every steps; resume from it if present")
    parser.add_argument("--save-every", type=int, default=10)
    parser.add_argument("--token", default=os.environ.get("SHARDFEED_TOKEN"), help="bearer token")
    args = parser.parse_args()

    dataset = ShardfeedIterableDataset(args.url, args.dataset, batch_size=args.batch_size, seed=0,
                                       fields=["npy", "cls"], decode=True, transform=to_tensors,
                                       token=args.token)
    loader = ShardfeedLoader(dataset, num_workers=args.workers)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.LazyLinear(128), torch.nn.ReLU(),
                                torch.nn.Linear(128, args.classes))
    model(torch.zeros(1, 8, 8))  # materialise the lazy layer before the optimizer sees it
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)

    if args.checkpoint and os.path.exists(args.checkpoint):
        state = torch.load(args.checkpoint, weights_only=False)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        loader.load_state_dict(state["data"])
        print(f"resumed from {args.checkpoint}: epoch {loader.epoch + 1}, "
              f"{state['data']['consumed']} samples of it already seen")

    def save() -> None:
        if args.checkpoint:
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                        "data": loader.state_dict()}, args.checkpoint)

    while loader.epoch < args.epochs:
        epoch = loader.epoch
        began, seen, total = time.perf_counter(), 0, 0.0
        for step, (images, labels) in enumerate(loader, 1):
            loss = torch.nn.functional.cross_entropy(model(images), labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            seen += len(labels)
            total += loss.item() * len(labels)
            if step % args.save_every == 0:
                save()
        took = time.perf_counter() - began
        print(f"epoch {epoch + 1}: loss {total / max(seen, 1):.3f}, {seen} samples in {took:.2f}s "
              f"({seen / took:,.0f} samples/s)")
        save()  # the loader has moved on to the next epoch


if __name__ == "__main__":
    main()
