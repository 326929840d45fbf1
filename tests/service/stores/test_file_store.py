"""The ``file://`` store's ranged reads: whole, in pieces, and cut short by a file that
is shorter than its index says."""

from __future__ import annotations

import asyncio
import os

import pytest

from shardfeed.service.stores import ShortRead, open_store

DATA = os.urandom(100_000)


def test_ranges_and_pieces_are_the_bytes_of_the_file(tmp_path):
    (tmp_path / "shard.bin").write_bytes(DATA)

    async def go():
        async with open_store(tmp_path.as_uri()) as store:
            assert await store.read_range("shard.bin", 1000, 5000) == DATA[1000:6000]
            assert await store.read_range("shard.bin", 7, 0) == b""
            pieces = await store.read_pieces("shard.bin", 1000, 4 * 8192 + 3, 8192)
            assert [len(p) for p in pieces] == [8192] * 4 + [3]
            assert b"".join(pieces) == DATA[1000:1000 + 4 * 8192 + 3]
            assert await store.read_pieces("shard.bin", 0, 10, 8192) == [DATA[:10]]

    asyncio.run(go())


def test_a_range_past_the_end_is_a_short_read(tmp_path):
    (tmp_path / "shard.bin").write_bytes(DATA)

    async def go():
        async with open_store(tmp_path.as_uri()) as store:
            with pytest.raises(ShortRead, match="wanted 20000 bytes at 90000, got 10000"):
                await store.read_range("shard.bin", 90_000, 20_000)
            with pytest.raises(ShortRead, match="wanted 20000 bytes at 90000, got 10000"):
                await store.read_pieces("shard.bin", 90_000, 20_000, 4096)

    asyncio.run(go())
