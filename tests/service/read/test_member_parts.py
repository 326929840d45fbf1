"""A member over several blocks is read as its pieces, never joined (``planner.Parts``): cold from
the store and again from the disk tier, in-process over a real file:// dataset of 8-60 KB members
in 16 KiB blocks, a real BlockCache and Coalescer without a RAM tier. (Its framing, over a socket:
``tests/service/api/test_multiblock.py``.)"""

from __future__ import annotations

import asyncio

import numpy as np

from shardfeed.service.cache.disk import BlockCache
from shardfeed.service.cache.names import BlockKey
from shardfeed.service.config import ServiceConfig
from shardfeed.service.datasets.dataset import open_dataset
from shardfeed.service.observe.metrics import Metrics
from shardfeed.service.read.coalescer import Coalescer
from shardfeed.service.read.planner import Parts, joined, pieces, size_of

from common.datasets import dir_put, make_dataset
from common.wait import await_until

BLOCK = 16 * 1024
SAMPLES = 40


def test_a_member_over_blocks_is_read_as_its_pieces_cold_and_from_disk(tmp_path):
    root = tmp_path / "data"
    source = make_dataset(dir_put(root), samples=SAMPLES, per_shard=20, sizes=(8_000, 60_000))

    async def main():
        dataset = await open_dataset("d", root.as_uri())
        stores = []
        real = dataset.store.read_pieces

        async def counted(*args, **kwargs):
            stores.append(args[0])
            return await real(*args, **kwargs)

        dataset.store.read_pieces = counted
        cache = BlockCache(tmp_path / "cache", 1024 * BLOCK, BLOCK, Metrics())
        cache.open()
        coalescer = Coalescer(cache, Metrics(), ServiceConfig(block_size=BLOCK, fetch_window=0, memory_cache=0))
        members = dataset.index.lookup(np.arange(SAMPLES))
        cold = await coalescer.read_members(dataset, members)
        keys = {BlockKey(dataset.id, dataset.shard_ids[s], b) for s, o, n in
                zip(members.shard.tolist(), members.offset.tolist(), members.size.tolist())
                for b in range(o // BLOCK, (o + max(n, 1) - 1) // BLOCK + 1)}
        await await_until(lambda: all(key in cache for key in keys), 10, "every block cached")
        read_cold = len(stores)
        warm = await coalescer.read_members(dataset, members)
        await coalescer.close()
        assert len(stores) == read_cold, "the second read went to the store, not the disk tier"
        return members, cold, warm, dataset.index.fields

    members, cold, warm, fields = asyncio.run(main())
    spanned = (members.offset + np.maximum(members.size, 1) - 1) // BLOCK - members.offset // BLOCK + 1
    assert spanned.max() >= 4 and (spanned == 2).any() and (spanned == 1).any()  # the dataset is as meant
    for payloads in (cold, warm):
        for row, payload in enumerate(payloads):
            expected = source[(int(members.sample[row]), fields[members.field[row]])]
            if spanned[row] > 1:  # not one joined bytes: a Parts of a piece per block
                assert isinstance(payload, Parts) and len(payload) == spanned[row], (row, type(payload))
            else:
                assert not isinstance(payload, Parts)
            assert size_of(payload) == len(expected)
            assert b"".join(pieces(payload)) == joined(payload) == expected
