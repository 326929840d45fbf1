"""Client CPU per sample to turn a received batch into views: the tar answer against the Arrow one.

A batch's answer is asked of a real service (over a dataset seeded in a local directory by
``shardfeed seed``) before the clock, as a tar and as Arrow twice (cold: a record batch per
group read; warm, held in RAM: one per 16 MiB); then the client's side alone is
timed in-process, as the tensor output runs it on a buffer the socket filled: the answer's
layout (:class:`~shardfeed.client.layout.Columns`: the tar walked header by header, the Arrow
stream read from its own metadata) and the :class:`~shardfeed.client.tensors.Batch` over it.
The best of ``--rounds`` per format and size; after each round, off the clock, every sample's
key and bytes are checked against the seeded dataset (``common.Digests``).

A second table times the whole of ``Client.get_batch_tensors`` in each format (``batch_format``):
this process's CPU (user and system, from asking to the Batch) per sample over ``--batches`` warm
batches of random samples from a ``serve --workers 2``, so each batch is routed in two parts, one
per worker; each batch checked off the clock.

    python -m shardfeed.benchmarks.views [--sizes 10KiB,100KiB,1MiB] [--batch 64] [--rounds 200] [--batches 300]
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
import torch

from shardfeed.benchmarks.common import Digests, benchmark_parser, load_note, seed_by_cli, table
from shardfeed.client import Client
from shardfeed.client.layout import Columns
from shardfeed.client.samples import BatchReader
from shardfeed.client.tensors import Batch
from shardfeed.process import start_service
from shardfeed.seeds.synthetic import parse_sizes, sample_key
from shardfeed.sizes import parse_size

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


def whole_us(url: str, kind: str, samples: int, batch: int, digests: Digests, batches: int,
             rng: np.random.Generator) -> float:
    """Client CPU per sample of ``get_batch_tensors`` asking in format ``kind`` (see the module's
    docstring); the first ten batches (routing table, connections, the segment pool) untimed."""
    order = [rng.choice(samples, batch, replace=False).tolist() for _ in range(batches + 10)]
    spent = 0.0
    with Client(url, batch_format=kind) as client:
        for number, indices in enumerate(order):
            before = time.process_time()
            got = client.get_batch_tensors("bench", indices, ["bin"], shared=True)
            if number >= 10:
                spent += time.process_time() - before
            check(got, indices, digests)
            del got
    return spent / (batches * batch) * 1e6


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
    parser.add_argument("--batches", type=int, default=300, help="timed batches of the whole-batch table")
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    rows, wholes = [], []
    for size in args.sizes.split(","):
        samples = max(4 * args.batch, 64)
        with tempfile.TemporaryDirectory() as tmp:
            data = Path(tmp) / "data"
            # Shards of 16 samples: each worker owns some, so batches are routed in parts.
            seed_by_cli(data.as_uri(), samples, size, shard_size=str(16 * parse_size(size)))
            digests = Digests(samples, parse_sizes(size))
            indices = rng.permutation(samples)[:args.batch].tolist()
            def answer(url: str, kind: str) -> bytes:
                return httpx.post(f"{url}/v1/batch", timeout=60, json={
                    "dataset": "bench", "indices": indices, "fields": ["bin"], "format": kind}).raise_for_status().content

            with start_service({"bench": data.as_uri()}, cache_dir=Path(tmp) / "cache") as svc:
                # Arrow first, on an empty cache: a record batch per group read (about 1 MiB each);
                # then again, held in RAM: a record batch per 16 MiB. A tar is parsed alike either way.
                cold, tar, warm = answer(svc.url, "arrow"), answer(svc.url, "tar"), answer(svc.url, "arrow")
            with start_service({"bench": data.as_uri()}, cache_dir=Path(tmp) / "cache-2", workers=2) as svc:
                wholes.append([size, *(f"{whole_us(svc.url, kind, samples, args.batch, digests, args.batches, rng):.2f}"
                                       for kind in FORMATS)])
        rows.append([size, *(f"{views_us(kind, body, indices, digests, args.rounds):.2f}"
                             for kind, body in (("tar", tar), ("arrow", cold), ("arrow", warm)))])
    print(f"client CPU to turn a received {args.batch}-sample batch into views (us per sample, best of "
          f"{args.rounds}; {load_note()})")
    print(table(["sample size", "tar", "arrow, cold", "arrow, warm"], rows))
    print(f"\nclient CPU per sample of get_batch_tensors, {args.batch}-sample batches routed to 2 workers "
          f"({args.batches} warm batches; {load_note()})")
    print(table(["sample size", *FORMATS], wholes))


if __name__ == "__main__":
    main()
