"""Ranges first, blocks behind (``ServiceConfig.ranges_first``, ``coalescer.py``): a cold read
that needs a little of each block reads just its members' ranges, and the blocks follow into
the cache; in-process, over a real file:// dataset, a real BlockCache and Coalescer, the
store's reads recorded as they reach it."""

from __future__ import annotations

import asyncio

import numpy as np

from shardfeed.service.cache.disk import BlockCache
from shardfeed.service.cache.names import BlockKey
from shardfeed.service.config import ServiceConfig
from shardfeed.service.datasets.dataset import open_dataset
from shardfeed.service.observe.metrics import Metrics
from shardfeed.service.read.coalescer import Coalescer

from common.reliability import expected_members
from common.wait import await_until

BLOCK = 64 * 1024  # blocks of about 30 samples of the `written` dataset (conftest.py)


def read_twice(written, tmp_path, indices: list[int], *, ranges_first: bool) -> tuple[list, list, list, int]:
    """The store reads (size each) of a first read of ``indices``, of what followed it until
    every block it touched was cached, and of a second read; the blocks then cached."""
    root, source = written
    reads: list[int] = []

    async def main():
        dataset = await open_dataset("d", root.as_uri())
        real = dataset.store.read_pieces

        async def recorded(path, offset, size, piece, version=None, **options):
            reads.append(size)
            return await real(path, offset, size, piece, version, **options)

        dataset.store.read_pieces = recorded
        cache = BlockCache(tmp_path / f"cache-{ranges_first}", 64 * BLOCK, BLOCK, Metrics())
        cache.open()
        config = ServiceConfig(block_size=BLOCK, fetch_window=0, memory_cache=0, ranges_first=ranges_first)
        coalescer = Coalescer(cache, Metrics(), config)
        members = dataset.index.lookup(np.array(indices))
        got = await coalescer.read_members(dataset, members)
        first = list(reads)
        touched = {BlockKey(dataset.id, dataset.shard_ids[s], o // BLOCK)
                   for s, o in zip(members.shard.tolist(), members.offset.tolist())}
        # The blocks behind: fetched and written after the read returned.
        await await_until(lambda: all(key in cache for key in touched), 10, "the blocks behind")
        behind = reads[len(first):]
        again = await coalescer.read_members(dataset, members)
        await coalescer.close()
        assert got == again
        names = [f"sample{i:06d}.{dataset.index.fields[f]}" for i, f in zip(members.sample, members.field)]
        assert list(zip(names, got)) == [m for m in expected_members(source, "d", indices) if m[0] in names]
        return first, behind, reads[len(first) + len(behind):], len(touched)

    return asyncio.run(main())


def test_a_cold_read_of_a_little_of_each_block_reads_ranges_then_caches_the_blocks(written, tmp_path):
    indices = [3, 57, 120, 181]  # four shards, a sample of each
    first, behind, again, blocks = read_twice(written, tmp_path, indices, ranges_first=True)
    assert len(first) == 4 and max(first) < 4 * 1024  # a sample's members, merged: one read each
    assert len(behind) == blocks and min(behind) > 4 * 1024  # then each block, whole
    assert again == []  # the second read is served from the cache


def test_without_ranges_first_a_cold_read_waits_for_whole_blocks(written, tmp_path):
    first, behind, again, blocks = read_twice(written, tmp_path, [3, 57, 120, 181], ranges_first=False)
    assert len(first) == blocks and min(first) > 4 * 1024 and behind == [] and again == []


def test_a_read_needing_much_of_a_block_fetches_it_whole_at_once(written, tmp_path):
    indices = list(range(0, 40))  # most of the first blocks of shard 0
    first, behind, again, _ = read_twice(written, tmp_path, indices, ranges_first=True)
    assert min(first) > 4 * 1024 and again == []
