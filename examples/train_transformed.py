"""Train on images the service decoded, resized, cropped and flipped: tensors ready for the model.

    shardfeed serve --dataset imagenet=s3://bucket/train \\
        --transform imagenet_train=shardfeed.transforms.image:imagenet_train
    python examples/train_transformed.py http://data-1:8080 --dataset imagenet --epochs 2

The service runs the stock ``imagenet_train`` transform (``shardfeed/transforms/image.py``):
the JPEG decoded and resized to a short side of 256 once, kept in its prepared cache, then
each epoch a random-resized crop to 224 and a flip, seeded by ``(seed, epoch, sample)``. Each
DataLoader batch is one :class:`shardfeed.client.tensors.Batch` whose ``outputs`` are the
``(n, 3, 224, 224)`` uint8 images and ``(n,)`` labels, in shared memory: the training process
neither decodes nor parses. ``--on-client`` runs the same transform in the DataLoader workers
instead (the standard recipe), for A/B: the tensors are byte for byte the same.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from torch.utils.data import DataLoader

from shardfeed.client.torch import ShardfeedDataset, ShardfeedSampler
from shardfeed.transforms.image import imagenet_train


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("url", help="service URL(s), comma-separated")
    parser.add_argument("--dataset", default="imagenet")
    parser.add_argument("--transform", default="imagenet_train", help="the served transform's name")
    parser.add_argument("--on-client", action="store_true",
                        help="run the stock transform in the DataLoader workers instead of the service")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--classes", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--token", default=os.environ.get("SHARDFEED_TOKEN"), help="bearer token")
    args = parser.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    transform = imagenet_train() if args.on_client else args.transform
    dataset = ShardfeedDataset(args.url, args.dataset, transform=transform, token=args.token)
    sampler = ShardfeedSampler(dataset, seed=args.seed)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                        pin_memory=device.type == "cuda")
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 16, 7, stride=4), torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(8),
                                torch.nn.Flatten(), torch.nn.Linear(16 * 64, args.classes)).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    mean = torch.tensor([0.485, 0.456, 0.406], device=device).view(1, 3, 1, 1) * 255
    std = torch.tensor([0.229, 0.224, 0.225], device=device).view(1, 3, 1, 1) * 255

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)  # a new order and new crops, the same ones again on a rerun
        began, seen, total = time.perf_counter(), 0, 0.0
        for batch in loader:
            outputs = batch.to(device, non_blocking=True).outputs  # one copy of the batch's buffer
            inputs = (outputs["image"].float() - mean) / std
            labels = outputs["label"].clamp(0, args.classes - 1)
            loss = torch.nn.functional.cross_entropy(model(inputs), labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            seen += len(labels)
            total += loss.item() * len(labels)
        took = time.perf_counter() - began
        print(f"epoch {epoch + 1}: loss {total / max(seen, 1):.3f}, {seen} samples in {took:.2f}s "
              f"({seen / took:,.0f} samples/s)")


if __name__ == "__main__":
    main()
