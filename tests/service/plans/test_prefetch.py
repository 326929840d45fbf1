"""Reading ahead of a plan (service/plans/prefetch.py) in-process: a file:// dataset, a real
BlockCache, Coalescer and Plans. A cache that holds every block of the dataset leaves the
prefetcher nothing to do: it must stop looking positions up, and start again as soon as a
block leaves the cache."""

from __future__ import annotations

import asyncio
import random

import numpy as np
import pytest

from shardfeed.client.sampling import EpochSampler
from shardfeed.service.cache.disk import BlockCache
from shardfeed.service.cache.memtier import MemoryTier
from shardfeed.service.cache.names import BlockKey
from shardfeed.service.cluster.peers import Cluster, Peer
from shardfeed.service.config import ServiceConfig
from shardfeed.service.datasets.dataset import open_dataset
from shardfeed.service.observe.metrics import Metrics
from shardfeed.service.plans.prefetch import Prefetcher
from shardfeed.service.plans.registry import Plans
from shardfeed.service.read.coalescer import Coalescer

from common.datasets import dir_put, make_dataset
from common.reliability import damage_block
from common.wait import await_until

SAMPLES, PER_SHARD, BLOCK = 600, 100, 16 * 1024


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    root = tmp_path_factory.mktemp("prefetch")
    make_dataset(dir_put(root), samples=SAMPLES, per_shard=PER_SHARD, sizes=(900, 1100))
    return asyncio.run(open_dataset("d", root.as_uri()))


def all_keys(dataset) -> list[BlockKey]:
    return [BlockKey(dataset.id, dataset.shard_ids[code], block)
            for code, extent in enumerate(dataset.extents.tolist()) for block in range(-(-extent // BLOCK))]


def test_the_cache_counts_each_datasets_blocks_in_and_out(dataset, tmp_path):
    cache = BlockCache(tmp_path / "cache", 3 * BLOCK + 3 * 4096, BLOCK, Metrics())
    cache.open()
    keys = all_keys(dataset)
    for key in keys[:3]:
        assert cache.write(key, b"x" * BLOCK)
    held = cache.held(dataset.id)
    assert held.total == 3 and sum(held.per_shard.values()) == 3
    changes = held.changes
    assert cache.write(keys[3], b"x" * BLOCK)  # the least recently used goes
    assert cache.held(dataset.id).total == 3 and cache.held(dataset.id).changes > changes
    assert keys[0] not in cache
    assert cache.held("another").total == 0

    damage_block(cache.location(keys[1]), "garbage", random.Random(1))
    assert cache.read(keys[1], None) is None  # dropped as corrupt
    assert cache.held(dataset.id).total == 2

    reopened = BlockCache(tmp_path / "cache", 10 * BLOCK, BLOCK, Metrics())
    cache.close()
    reopened.open()
    assert reopened.held(dataset.id).total == 2
    other_size = BlockCache(tmp_path / "cache", 10 * BLOCK, 2 * BLOCK, Metrics())
    reopened.close()
    other_size.open()  # a previous run's blocks of another size are no blocks of this one
    assert other_size.held(dataset.id).total == 0


def test_read_ahead_stops_once_the_cache_holds_the_dataset_and_resumes_when_a_block_leaves(dataset, tmp_path,
                                                                                            monkeypatch):
    async def scenario():
        config = ServiceConfig(block_size=BLOCK, fetch_window=0)
        metrics = Metrics()
        plans = Plans(config, metrics)
        memory = MemoryTier(config.memory_cache, metrics, BLOCK)
        cache = BlockCache(tmp_path / "cache", 100 * 1024 * 1024, BLOCK, metrics, victims=plans,
                           on_forget=memory.discard)
        cache.open()
        coalescer = Coalescer(cache, metrics, config, memory=memory, fetch_policy=plans)
        prefetcher = Prefetcher(plans, coalescer, config)
        order = EpochSampler(SAMPLES, 1, seed=5).rank_order()
        plans.insert(plans.build(dataset, "indices", order, None, True, None))

        async def settle():
            await prefetcher.step()
            await await_until(coalescer.fetcher.idle, 30, "the read-ahead")

        assert not coalescer.holds_all(dataset)
        await settle()  # plan_ahead (64 MiB) covers the whole epoch: every block is read ahead
        keys = all_keys(dataset)
        assert all(key in cache for key in keys)
        assert coalescer.holds_all(dataset)

        lookups = []
        lookup = dataset.index.lookup
        monkeypatch.setattr(dataset.index, "lookup", lambda *a, **k: lookups.append(1) or lookup(*a, **k))
        for plan in plans.live():
            plan.ahead_blocks = plan.ahead_ranges = 0  # as if a new epoch's plan had come
        await settle()
        assert lookups == []

        victim = keys[len(keys) // 2]
        damage_block(cache.location(victim), "garbage", random.Random(1))
        assert cache.read(victim, None) is None  # dropped: the dataset is no longer whole
        assert not coalescer.holds_all(dataset)
        await settle()
        assert lookups and victim in cache
        assert coalescer.holds_all(dataset)
        await coalescer.close()

    asyncio.run(scenario())


def test_a_replica_holds_all_once_it_holds_its_own_shards_and_again_after_ownership_moves(dataset, tmp_path):
    """Only the shards this node owns count, and a peer going down hands it more."""
    async def scenario():
        metrics = Metrics()
        codes = np.arange(len(dataset.shard_ids))
        # The dataset's URL is a temporary path: name the second replica so that the two share
        # the shards (with 6 shards, one in 32 names would give one replica all of them).
        for other in (f"b{n}" for n in range(100)):
            cluster = Cluster([Peer("a", "http://127.0.0.1:1"), Peer(other, "http://127.0.0.1:2")], 0, metrics)
            mine = codes[cluster.owners(dataset.url, dataset.index.shards, codes) == cluster.me]
            if 0 < len(mine) < len(codes):
                break
        assert 0 < len(mine) < len(codes)  # the two replicas share the shards
        cache = BlockCache(tmp_path / "cache", 100 * 1024 * 1024, BLOCK, metrics)
        cache.open()
        coalescer = Coalescer(cache, metrics, ServiceConfig(block_size=BLOCK), cluster)
        for key in all_keys(dataset):
            if dataset.shard_ids.index(key.shard) in mine:
                assert not coalescer.holds_all(dataset)
                cache.write(key, b"x" * BLOCK)
        assert coalescer.holds_all(dataset)
        cluster.mark(1, up=False, why="test")  # b's shards are now a's to read
        assert not coalescer.holds_all(dataset)
        await coalescer.close()

    asyncio.run(scenario())


def test_read_ahead_asks_for_no_more_while_its_reads_keep_every_store_slot_busy(dataset, tmp_path):
    """With the store's two slots taken, a pass queues one step of reads ahead and stops there
    (it once queued the whole plan_ahead budget in one tick); once the store answers, later
    passes go on to the end. A batch that comes to wait on a block read ahead promotes it."""
    async def scenario():
        config = ServiceConfig(block_size=BLOCK, fetch_window=0, max_store_requests=2, max_fetch=BLOCK)
        metrics = Metrics()
        plans = Plans(config, metrics)
        cache = BlockCache(tmp_path / "cache", 100 * 1024 * 1024, BLOCK, metrics, victims=plans)
        cache.open()
        coalescer = Coalescer(cache, metrics, config, fetch_policy=plans)
        prefetcher = Prefetcher(plans, coalescer, config)
        order = EpochSampler(SAMPLES, 1, seed=5).rank_order()
        plan = plans.build(dataset, "indices", order, None, True, None)
        plans.insert(plan)
        slots = coalescer.fetcher.slots
        busy, free = asyncio.Event(), asyncio.Event()

        async def hold_one() -> None:
            async with slots.hold(slots.ticket()):
                busy.set()
                await free.wait()

        holders = [asyncio.create_task(hold_one()) for _ in range(slots.slots)]
        await busy.wait()
        await prefetcher.step()
        queued, frontier = slots.outstanding_ahead, plan.ahead_blocks
        assert queued >= slots.slots and frontier < len(order)  # one step, not the whole epoch
        await await_until(lambda: slots.waiting_ahead == queued, 10, "the reads ahead in line")
        await prefetcher.step()
        assert (slots.outstanding_ahead, plan.ahead_blocks) == (queued, frontier)  # still waiting: nothing more

        needed = next(key for key in all_keys(dataset) if coalescer.fetcher.reading(key))
        arrival = coalescer.fetcher.arrivals([needed])[needed]
        assert (slots.waiting_ahead, slots.waiting_need) == (queued - 1, 1)  # promoted to the reads needed
        assert slots.outstanding_ahead == queued - 1
        free.set()
        await asyncio.gather(*holders)
        shard = dataset.store.root / dataset.index.shards[dataset.shard_ids.index(needed.shard)]
        assert bytes(await arrival) == shard.read_bytes()[needed.block * BLOCK:(needed.block + 1) * BLOCK]

        for _ in range(100):  # passes as ticks would run them, until the epoch is read ahead
            await prefetcher.step()
            if coalescer.holds_all(dataset):
                break
            await await_until(lambda: slots.outstanding_ahead < slots.slots, 30, "the store")
        assert coalescer.holds_all(dataset)
        await coalescer.close()

    asyncio.run(scenario())
