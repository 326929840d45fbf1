"""Client CPU per sample to turn a received batch into views: the tar answer against the Arrow one.

A batch's answer is asked of a real service (over a dataset seeded in a local directory by
``shardfeed seed``) in each format, once, before the clock; then the client's side alone is
timed in-process, as the tensor output runs it on a buffer the socket filled: the answer's
layout (:class:`~shardfeed.client.layout.Columns`: the tar walked header by header, the Arrow
stream read from its own metadata) and the :class:`~shardfeed.client.tensors.Batch` over it.
The best of ``--rounds`` per format and size; after each round, off the clock, every sample's
key and bytes are checked against the seeded dataset (``common.Digests``).

    python -m shardfeed.benchmarks.views [--sizes 10KiB,100KiB,1MiB] [--batch 64] [--rounds 200]
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
import torch

from shardfeed.benchmarks.common import Digests, benchmark_parser, load_note, seed_by_cli, table
from shardfeed.client.layout import Columns
from shardfeed.client.samples import BatchReader
from shardfeed.client.tensors import Batch
from shardfeed.process import start_service
from shardfeed.seeds.synthetic import parse_sizes, sample_key

FORMATS = ("tar", "arrow")


def layout(kind: str, body: memoryview, indices: list[int]) -> Columns:
    """The answer's columns, as ``PartRequest.columns`` reads an answer of that format."""
    if kind == "arrow":
        return Columns.of_arrow(body, indices, "bench")
    return Columns.of_samples(BatchReader("bench", indices, ["bin"]).spans(body))


def views_us(kind: str, answer: bytes, indices: list[int], digests: Digests, rounds: int) -> float:
    """Microseconds per sample to lay out ``answer`` and make its Batch (the best of ``rounds``),
    every round's samples checked off the clock."""
    buffer = torch.frombuffer(bytearray(answer), dtype=torch.uint8)
    body = memoryview(buffer.numpy())
    positions = [list(range(len(indices)))]
    best = float("inf")
    for _ in range(rounds):
        began = time.perf_counter()
        batch = Batch.of(buffer, Columns.merged([layout(kind, body, indices)], [0], positions))
        best = min(best, time.perf_counter() - began)
        check(batch, indices, digests)
    return best / len(indices) * 1e6


def check(batch: Batch, indices: list[int], digests: Digests) -> None:
    if batch.keys != [sample_key(i) for i in indices] or batch.indices.tolist() != indices:
        raise AssertionError("the batch holds other samples than were asked for")
    for i, view in zip(indices, batch["bin"]):
        digests.check(i, "bin", view)


def main(argv: list[str] | None = None) -> None:
    parser = benchmark_parser(__doc__, "shardfeed.benchmarks.views")
    parser.add_argument("--sizes", default="10KiB,100KiB,1MiB", help="comma-separated sample sizes")
    parser.add_argument("--batch", type=int, default=64, help="samples per batch")
    parser.add_argument("--rounds", type=int, default=200)
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    rows = []
    for size in args.sizes.split(","):
        samples = max(4 * args.batch, 64)
        with tempfile.TemporaryDirectory() as tmp:
            data = Path(tmp) / "data"
            seed_by_cli(data.as_uri(), samples, size)
            digests = Digests(samples, parse_sizes(size))
            indices = rng.permutation(samples)[:args.batch].tolist()
            with start_service({"bench": data.as_uri()}, cache_dir=Path(tmp) / "cache") as svc:
                answers = {kind: httpx.post(f"{svc.url}/v1/batch", timeout=60, json={
                    "dataset": "bench", "indices": indices, "fields": ["bin"], "format": kind}).raise_for_status().content
                    for kind in FORMATS}
        rows.append([size, *(f"{views_us(kind, answers[kind], indices, digests, args.rounds):.2f}" for kind in FORMATS)])
    print(f"client CPU to turn a received {args.batch}-sample batch into views (us per sample, best of "
          f"{args.rounds}; {load_note()})")
    print(table(["sample size", *FORMATS], rows))


if __name__ == "__main__":
    main()
