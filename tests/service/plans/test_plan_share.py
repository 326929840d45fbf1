"""Plans of a mixture (service/plans/registry.py): each stream a dataset with its own plan,
holding a ``share`` of its reader's reads. Real ``Plans`` over two file:// datasets, no
service: the horizon and the eviction order must come out in the reader's reads, where a
stream holding a quarter of them moves a plan position every four reads."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from shardfeed.client.sampling import EpochSampler
from shardfeed.service.cache.disk import BlockCache
from shardfeed.service.cache.names import BlockKey
from shardfeed.service.config import ServiceConfig
from shardfeed.service.datasets.dataset import open_dataset
from shardfeed.service.observe.metrics import Metrics
from shardfeed.service.plans.prefetch import Prefetcher
from shardfeed.service.plans.registry import Plans
from shardfeed.service.read.coalescer import Coalescer

from common.datasets import dir_put, make_dataset
from common.wait import await_until

SAMPLES, PER_SHARD, BLOCK = 600, 100, 16 * 1024
SHARES = {"a": 0.75, "b": 0.25}
"""The mixture: a reader's reads come three quarters from ``a``, one quarter from ``b``."""


@pytest.fixture(scope="module")
def datasets(tmp_path_factory):
    """Two datasets of 600 samples of ~1 KiB in shards of 100 (about 108 blocks of 16 KiB each)."""
    opened = {}
    for seed, name in enumerate(SHARES):
        root = tmp_path_factory.mktemp(name)
        make_dataset(dir_put(root), samples=SAMPLES, per_shard=PER_SHARD, sizes=(900, 1100), seed=seed)
        opened[name] = asyncio.run(open_dataset(name, root.as_uri()))
    return opened


def sample_blocks(dataset) -> list[list[BlockKey]]:
    """Per sample, the blocks its members lie in (from the index, not from the plans)."""
    shard, start, end = dataset.index.sample_extents()
    return [[BlockKey(dataset.id, dataset.shard_ids[s], b) for b in range(lo // BLOCK, (hi - 1) // BLOCK + 1)]
            for s, lo, hi in zip(shard.tolist(), start.tolist(), end.tolist())]


def mixture(datasets, orders: dict[str, np.ndarray], shares: dict[str, float]) -> Plans:
    plans = Plans(ServiceConfig(block_size=BLOCK), Metrics())
    for name, order in orders.items():
        plans.insert(plans.build(datasets[name], "indices", order, None, True, None, share=shares[name]))
    return plans


def first_reads(datasets, orders: dict[str, np.ndarray]) -> dict[BlockKey, int]:
    """Per block, the read of the mixture's reader that first needs it: read ``r`` (from 0)
    is position ``r * share`` of each stream (the stream a read comes from does not matter
    here, only how fast each stream's plan moves)."""
    first: dict[BlockKey, int] = {}
    for name, order in orders.items():
        blocks = sample_blocks(datasets[name])
        for position, sample in enumerate(order.tolist()):
            for key in blocks[sample]:
                first.setdefault(key, int(np.ceil(position / SHARES[name])))
    return first


def test_the_horizon_is_the_reads_within_which_the_cache_holds_what_the_mixture_reads(datasets):
    orders = {name: np.arange(SAMPLES) for name in SHARES}
    first = sorted(first_reads(datasets, orders).values())
    capacity = len(first) // 3
    plans = mixture(datasets, orders, SHARES)
    plans.refresh_horizon(capacity)
    # The reads after which a cache of ``capacity`` blocks no longer holds every block the
    # reader has needed (a plan's distances start after its batch: one position).
    assert abs(plans.horizon - first[capacity]) <= 1 / SHARES["b"]
    unscaled = mixture(datasets, orders, {name: 1.0 for name in SHARES})
    unscaled.refresh_horizon(capacity)
    assert unscaled.horizon < 0.6 * plans.horizon  # in positions both streams' blocks looked near


def test_eviction_goes_farthest_next_read_first_across_the_streams(datasets):
    orders = {name: EpochSampler(SAMPLES, 1, seed=seed).rank_order() for seed, name in enumerate(SHARES)}
    first = first_reads(datasets, orders)
    plans = mixture(datasets, orders, SHARES)
    keys = sorted(first)
    victims = plans.victim_order(keys)
    assert sorted(victims) == keys
    reads = [first[key] for key in victims]
    # Non-increasing, up to rounding a position of ``b`` (four reads) into reads.
    assert all(later <= earlier + 1 / SHARES["b"] for earlier, later in zip(reads, reads[1:]))
    # A block of ``b`` next used at its position 150 (read 600) goes before one of ``a`` at
    # its position 300 (read 400): in positions it looked twice as near.
    positions = {name: {key: p for p, sample in reversed(list(enumerate(orders[name].tolist())))
                        for key in sample_blocks(datasets[name])[sample]} for name in SHARES}
    near_b = min((key for key, p in positions["b"].items() if p >= 150), key=positions["b"].get)
    far_a = min((key for key, p in positions["a"].items() if p >= 300), key=positions["a"].get)
    assert positions["b"][near_b] < positions["a"][far_a] and first[near_b] > first[far_a]
    assert plans.victim_order([far_a, near_b]) == [near_b, far_a]


def test_a_lone_plan_decides_the_same_whatever_its_share(datasets, tmp_path):
    """Alone, a plan's share only changes the unit of the horizon: what is fetched whole,
    and how far whole blocks are read ahead, is decided in its own positions as before."""
    order = {"b": EpochSampler(SAMPLES, 1, seed=5).rank_order()}
    keys = sorted(first_reads(datasets, order))
    shard_codes = {sid: code for code, sid in enumerate(datasets["b"].shard_ids)}
    shards = np.array([shard_codes[key.shard] for key in keys])
    blocks = np.array([key.block for key in keys])
    answers = []
    for share in (1.0, 0.25):
        plans = mixture(datasets, order, {"b": share})
        reach = asyncio.run(blocks_read_ahead(plans, tmp_path / f"cache-{share}", 3 * len(keys) // 4))
        answers.append((plans.horizon * share, plans.whole_blocks(datasets["b"], shards, blocks).tolist(), reach))
    assert answers[0] == answers[1]
    assert 0 < sum(answers[0][1]) < len(keys)  # some blocks whole, some as ranges: the horizon matters
    assert answers[0][2] < SAMPLES  # whole blocks are read ahead only within half the horizon


async def blocks_read_ahead(plans: Plans, cache_dir, capacity: int) -> int:
    """One read-ahead pass through a cache of ``capacity`` blocks (which sets the horizon):
    the plan position up to which whole blocks were read ahead."""
    config = ServiceConfig(block_size=BLOCK, fetch_window=0)
    cache = BlockCache(cache_dir, capacity * BLOCK, BLOCK, plans.metrics, victims=plans)
    cache.open()
    coalescer = Coalescer(cache, plans.metrics, config, fetch_policy=plans)
    try:
        await Prefetcher(plans, coalescer, config).step()
        await await_until(coalescer.fetcher.idle, 30, "the read-ahead")
    finally:
        await coalescer.close()
    (plan,) = plans.live()
    return plan.ahead_blocks
