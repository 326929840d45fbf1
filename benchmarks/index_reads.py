"""What ``shardfeed index`` reads: store requests and bytes per dataset shape, on moto.

    python -m shardfeed.benchmarks.index_reads

Prints one line per shape: shards, member size, requests, bytes read and their share
of the shard bytes. Counts, not timings: the machine's load does not change them.
"""

from __future__ import annotations

import asyncio
import os

import numpy as np

from shardfeed.benchmarks.common import benchmark_parser
from shardfeed.s3server import start_moto
from shardfeed.seeds.synthetic import sample_key, seed_dataset
from shardfeed.service.datasets.tarscan import index_shards
from shardfeed.service.stores import open_store
from shardfeed.sizes import format_size, parse_size

SHAPES = [  # (name, samples, member size, shard size)
    ("1 MiB members, 25 MB", 24, "1MiB", "5MiB"),
    ("10 KiB members, 24 MB", 2400, "10KiB", "5MiB"),
    ("100 KiB members, 25 MB", 240, "100KiB", "5MiB"),
]


async def measure(url: str, samples: int, size: str, shard_size: str) -> tuple[int, int, int, int]:
    """(shards, requests, bytes read, shard bytes) of indexing a freshly seeded dataset."""
    async with open_store(url) as store:
        await seed_dataset(store, samples=samples, size=size, shard_size=parse_size(shard_size), fields=("bin",),
                             progress=False)
    async with open_store(url) as store:
        shard_bytes = sum(o.size for o in await store.list() if o.path.endswith(".tar"))
        index = await index_shards(store, progress=False)
        if index.keys(np.arange(samples)) != [sample_key(i) for i in range(samples)]:  # what it read it for
            raise RuntimeError(f"the index of {url} does not hold the {samples} samples seeded, in order")
        return len(index.shards), store.requests, store.bytes_read, shard_bytes


def main() -> None:
    benchmark_parser(__doc__, __spec__.name).parse_args()
    moto = start_moto()
    try:
        os.environ.update(moto.env())
        for n, (name, samples, size, shard_size) in enumerate(SHAPES):
            bucket = f"index-reads-{n}"
            moto.create_bucket(bucket)
            shards, requests, read, total = asyncio.run(measure(f"s3://{bucket}/d", samples, size, shard_size))
            print(f"{name:24s} {shards:3d} shards  {requests:4d} requests (listing included)  "
                  f"{format_size(read):>10s} read of {format_size(total):>10s} = {100 * read / total:5.1f}%")
    finally:
        moto.stop()


if __name__ == "__main__":
    main()
