"""Fetched blocks reach the cache behind the batch (``fetcher.py``): a disk that cannot keep up
(its writes held back here, a fault like the S3 proxy's) never delays a read; past
``WRITE_QUEUE`` bytes waiting, a fetch's blocks go uncached, counted, and the RAM tier lets
them go too. In-process, over a real file:// dataset, BlockCache and Coalescer."""

from __future__ import annotations

import asyncio
import threading

import numpy as np

from shardfeed.service.cache.disk import BlockCache
from shardfeed.service.cache.memtier import MemoryTier
from shardfeed.service.config import ServiceConfig
from shardfeed.service.datasets.dataset import open_dataset
from shardfeed.service.observe.metrics import Metrics
from shardfeed.service.read import fetcher as fetcher_module
from shardfeed.service.read.coalescer import Coalescer

from common.reliability import expected_members
from common.wait import await_until

BLOCK = 64 * 1024  # blocks of about 30 samples of the `written` dataset (conftest.py)


def test_a_full_write_queue_skips_caching_and_never_delays_a_read(written, tmp_path, monkeypatch):
    root, source = written
    monkeypatch.setattr(fetcher_module, "WRITE_QUEUE", BLOCK)  # one block waiting fills it
    disk_free = threading.Event()

    async def main():
        dataset = await open_dataset("d", root.as_uri())
        metrics = Metrics()
        memory = MemoryTier(1 << 20, metrics, BLOCK)
        cache = BlockCache(tmp_path / "cache", 64 * BLOCK, BLOCK, metrics, on_forget=memory.discard)
        cache.open()
        coalescer = Coalescer(cache, metrics, ServiceConfig(block_size=BLOCK, fetch_window=0), memory=memory)
        write = coalescer.fetcher._write_blocks
        coalescer.fetcher._write_blocks = lambda blocks: (disk_free.wait(30), write(blocks))[1]  # a stuck disk
        got = []
        for indices in ([3], [57], [120], [181]):  # a block of each shard, one read after another
            members = dataset.index.lookup(np.array(indices))
            payloads = await asyncio.wait_for(coalescer.read_members(dataset, members), 10)
            names = [f"sample{i:06d}.{dataset.index.fields[f]}" for i, f in zip(members.sample, members.field)]
            got += list(zip(names, payloads))
        skipped = metrics.cache_writes_skipped._value.get()
        in_ram = len(coalescer.memory)
        disk_free.set()
        await await_until(coalescer.fetcher.idle, 10, "the first block's write")
        cached = cache.held(dataset.id).total
        await coalescer.close()
        return got, skipped, in_ram, cached

    got, skipped, in_ram, cached = asyncio.run(main())
    assert got == expected_members(source, "d", [3, 57, 120, 181])
    assert skipped == 3  # the first block waits for the disk; the next three are not cached
    assert in_ram == 1  # ... nor kept in RAM, which mirrors the disk
    assert cached == 1  # the first, once the disk came back
