"""A small synthetic dataset (``shardfeed.seeds.synthetic``) whose bytes every test can
recompute, and what the client should return for it."""

from __future__ import annotations

import asyncio
from pathlib import Path

from shardfeed.retry import Backoff
from shardfeed.seeds.synthetic import member_bytes, seed_dataset
from shardfeed.service.stores import open_store
from shardfeed.tar import END_OF_ARCHIVE, member_header, padding

SIZES = (1024, 4096)
SAMPLES = 300
FAST = Backoff(attempts=3, base=0.01, cap=0.5)


def seed_synthetic(path: Path, samples: int = SAMPLES, sizes: tuple[int, int] = SIZES,
                   fields: tuple[str, ...] = ("bin", "cls", "json")) -> str:
    """Write a small synthetic dataset under ``path``; returns its file:// URL."""
    url = path.resolve().as_uri()

    async def seed():
        async with open_store(url) as store:
            await seed_dataset(store, samples=samples, size=sizes, fields=fields, shard_size=256 << 10,
                               progress=False)

    asyncio.run(seed())
    return url


def expected(i: int, fields=("bin", "cls", "json")) -> dict:
    return {"__key__": f"{i:09d}", "__index__": i, **{f: member_bytes(0, i, f, SIZES) for f in fields}}


def tar_of(indices: list[int]) -> bytes:
    out = bytearray()
    for i in indices:
        data = b"%d" % i
        out += member_header(f"{i:06d}.cls", len(data)) + data + b"\0" * padding(len(data))
    return bytes(out + END_OF_ARCHIVE)
