"""What opening a dataset costs the store: one paged listing, not a HEAD per shard.

A dataset opens from a HEAD and a conditional read of ``index.parquet`` and one listing of
its shards' common key prefix, which names every shard's version (ETag and size)
(``service/datasets/dataset.py``).
This seeds ``--shards`` one-sample shards (``shardfeed seed``) on an S3 server on
loopback (SeaweedFS by default, ``--s3 moto``), opens the dataset ``--rounds`` times and
prints, per open, the store requests it sent (LIST pages, index GET) and the time it took;
for scale, the time a HEAD per shard would take with 32 in flight (what learning the
versions one object at a time would cost).

    python -m shardfeed.benchmarks.listing --shards 10000
"""

from __future__ import annotations

import asyncio
import os
import statistics
import time

from shardfeed.benchmarks.common import BENCH_DATA, benchmark_parser, seeded_s3
from shardfeed.s3server import S3_SERVERS, default_server
from shardfeed.service.datasets.dataset import open_dataset
from shardfeed.service.stores import open_store


async def _open(url: str) -> tuple[float, int, int]:
    store = open_store(url)
    try:
        began = time.perf_counter()
        dataset = await open_dataset("bench", url, store=store)
        return time.perf_counter() - began, store.requests, len(dataset.index.shards)
    finally:
        await store.close()


async def _heads(url: str, in_flight: int = 32) -> float:
    store = open_store(url)
    try:
        shards = [info.path for info in await store.list() if info.path.endswith(".tar")]
        slots = asyncio.Semaphore(in_flight)

        async def head(path: str) -> None:
            async with slots:
                await store.head(path)

        began = time.perf_counter()
        await asyncio.gather(*(head(path) for path in shards))
        return time.perf_counter() - began
    finally:
        await store.close()


def main(argv: list[str] | None = None) -> int:
    parser = benchmark_parser(__doc__, __spec__.name)
    parser.add_argument("--shards", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--s3", choices=S3_SERVERS, default=default_server())
    args = parser.parse_args(argv)
    with seeded_s3(args.s3, args.shards, "1KiB", "1KiB") as server:
        os.environ.update(server.env())
        opens = [asyncio.run(_open(BENCH_DATA)) for _ in range(args.rounds)]
        heads = asyncio.run(_heads(BENCH_DATA))
    _, requests, shards = opens[-1]
    if {n for _, _, n in opens} != {args.shards}:
        raise SystemExit(f"an open found {sorted({n for _, _, n in opens})} shards, not the {args.shards} seeded")
    print(f"{args.s3}, {shards} shards: opening sent {requests} store requests "
          f"(a HEAD and a GET of index.parquet, {requests - 2} LIST pages of 1000 keys; no HEAD per shard)")
    print(f"  open: median {statistics.median(s for s, _, _ in opens):.2f} s over {args.rounds} rounds "
          f"(index parse included); a HEAD per shard, 32 in flight: {heads:.2f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
