"""``shardfeed demo``: train a small model end to end through the service.

Seeds scikit-learn's handwritten digits as shards (once, into the embedded default's
directory), starts ``shardfeed serve`` on a free port, trains a small MLP for two
epochs through ``DataLoader(num_workers=2)`` + :class:`ShardfeedDataset` (one request
per batch), and prints throughput, batch latency percentiles and test accuracy.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, SubsetRandomSampler, default_collate

from shardfeed.client.torch import ShardfeedDataset

DATASET = "digits"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from shardfeed.service.server import DEFAULT_DATA_DIR  # same place as `shardfeed serve` uses

    parser.add_argument("--url", help="train against this running service instead of starting one")
    parser.add_argument("--dataset", default=DATASET, help="dataset name on the service (default: %(default)s)")
    parser.add_argument("--data-dir", type=Path, default=DEFAULT_DATA_DIR,
                        help="where the digits dataset is seeded (default: %(default)s)")
    parser.add_argument("--epochs", type=int, default=2, help="training epochs (default: %(default)s)")
    parser.add_argument("--batch-size", type=int, default=64, help="samples per batch (default: %(default)s)")
    parser.add_argument("--workers", type=int, default=2, help="DataLoader worker processes (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default: %(default)s)")


def run(args: argparse.Namespace) -> int:
    for name in ("epochs", "batch_size"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
    if args.workers < 0:
        raise ValueError("--workers must not be negative")
    if args.url:
        return train(args.url, args)

    from shardfeed.process import start_service
    from shardfeed.service.server import ensure_default_dataset

    began = time.perf_counter()
    url = asyncio.run(ensure_default_dataset(args.data_dir))
    print(f"dataset: {url} (ready in {time.perf_counter() - began:.1f}s)")
    with start_service({args.dataset: url}, cache_dir=args.data_dir.parent / "demo-cache") as service:
        print(f"service: {service.url} (log: {service.log_path})")
        return train(service.url, args)


def train(url: str, args: argparse.Namespace) -> int:
    """Train and evaluate on the service at ``url``; prints the figures, returns 0."""
    torch.manual_seed(args.seed)
    dataset = TimedDataset(url, args.dataset, fields=["npy", "cls"], decode=True, transform=to_tensors)
    n = len(dataset)
    order = np.random.default_rng(args.seed).permutation(n)
    train_idx, test_idx = order[: n * 4 // 5].tolist(), order[n * 4 // 5:].tolist()
    requests_before = batch_requests(url)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 128), torch.nn.ReLU(),
                                torch.nn.Linear(128, 10))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    latencies: list[float] = []
    batches = 0
    print(f"training on {len(train_idx)} samples, testing on {len(test_idx)}; "
          f"batch {args.batch_size}, {args.workers} DataLoader workers")
    for epoch in range(args.epochs):
        sampler = SubsetRandomSampler(train_idx, generator=torch.Generator().manual_seed(args.seed + epoch))
        loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                            collate_fn=collate)
        began, seen, total_loss = time.perf_counter(), 0, 0.0
        for images, labels, seconds in loader:
            loss = torch.nn.functional.cross_entropy(model(images), labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            latencies.append(seconds)
            seen += len(labels)
            batches += 1
            total_loss += loss.item() * len(labels)
        took = time.perf_counter() - began
        print(f"epoch {epoch + 1}: loss {total_loss / seen:.3f}, {seen} samples in {took:.2f}s "
              f"({seen / took:,.0f} samples/s)")
    p50, p95, p99 = np.percentile(np.array(latencies) * 1e3, [50, 95, 99])
    print(f"batch latency (request + decode, in the workers): p50 {p50:.1f} ms, p95 {p95:.1f} ms, "
          f"p99 {p99:.1f} ms")
    requests = batch_requests(url) - requests_before
    if requests >= 0:
        print(f"service: {requests} batch requests for {batches} training batches")

    correct = 0
    with torch.no_grad():
        for images, labels, _ in DataLoader(dataset, batch_size=256, sampler=test_idx,
                                            num_workers=args.workers, collate_fn=collate):
            correct += int((model(images).argmax(1) == labels).sum())
    print(f"test accuracy: {100 * correct / len(test_idx):.1f}% on {len(test_idx)} held-out samples")
    return 0


def to_tensors(sample: dict) -> tuple:
    """A decoded digits sample -> (image scaled to [0, 1], label)."""
    return torch.from_numpy(sample["npy"] / np.float32(16)), sample["cls"]


def collate(batch: tuple) -> tuple:
    """``(samples, seconds)`` from :class:`TimedDataset` -> ``(images, labels, seconds)``."""
    samples, seconds = batch
    images, labels = default_collate(samples)
    return images, labels, seconds


class TimedDataset(ShardfeedDataset):
    """Returns ``(samples, seconds)`` per batch: the samples and how long fetching them took."""

    def __getitems__(self, indices: list[int]) -> tuple:
        began = time.perf_counter()
        samples = super().__getitems__(indices)
        return samples, time.perf_counter() - began


def batch_requests(url: str) -> int:
    """Batch requests the service has answered, from its /metrics (-1 if unavailable)."""
    import httpx

    try:
        text = httpx.get(f"{url.split(',')[0].rstrip('/')}/metrics", timeout=5, trust_env=False).text
    except httpx.HTTPError:
        return -1
    return int(sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("shardfeed_requests_total{") and 'route="batch"' in line))
