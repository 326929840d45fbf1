"""The plan policies on their own (service/plans/registry.py), without timing: a real
BlockCache asks the plans for victims, the plans decide which missing blocks to fetch
whole, and every shuffle mode's epoch is replayed batch by batch to count store bytes."""

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
from shardfeed.service.plans.registry import Plans
from shardfeed.service.read.planner import plan_pieces

from common.datasets import dir_put, make_dataset

SAMPLES, PER_SHARD, BLOCK, BATCH = 2000, 100, 16 * 1024, 64


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    root = tmp_path_factory.mktemp("policy")
    make_dataset(dir_put(root), samples=SAMPLES, per_shard=PER_SHARD, sizes=(900, 1100))
    return asyncio.run(open_dataset("d", root.as_uri()))


def replay(dataset, tmp_path, order: np.ndarray, share: float, *, plan: bool) -> tuple[float, float]:
    """Store bytes per dataset byte and requests per sample of reading ``order`` in batches,
    fetching what the policy says (whole blocks into the cache, or the pieces' ranges)."""
    data_bytes = int(dataset.extents.sum())
    metrics = Metrics()
    plans = Plans(ServiceConfig(block_size=BLOCK), metrics)
    cache = BlockCache(tmp_path / f"cache-{plan}", int(share * data_bytes), BLOCK, metrics,
                       victims=plans if plan else None)
    cache.open()
    if plan:
        plans.insert(plans.build(dataset, "indices", order, None, True, None))
    fetched = requests = 0
    for start in range(0, len(order), BATCH):
        batch = order[start:start + BATCH]
        plans.observe(dataset, batch)
        plans.refresh_horizon(cache.room_blocks())  # for every batch: no clock in this test
        members = dataset.index.lookup(batch)
        pieces = plan_pieces(members, BLOCK)
        pairs = sorted(set(zip(pieces.shard.tolist(), pieces.block.tolist())))
        missing = [p for p in pairs if BlockKey(dataset.id, dataset.shard_ids[p[0]], p[1]) not in cache]
        if not missing:
            continue
        shards, blocks = (np.array(column) for column in zip(*missing))
        partial = np.zeros(len(pieces), dtype=bool)
        for (shard, block), whole in zip(missing, plans.whole_blocks(dataset, shards, blocks).tolist()):
            if whole:
                cache.write(BlockKey(dataset.id, dataset.shard_ids[shard], block), b"\0" * BLOCK)
                fetched, requests = fetched + BLOCK, requests + 1
            else:
                partial |= (pieces.shard == shard) & (pieces.block == block)
        # A sample's members are adjacent: its pieces are merged into one ranged read.
        fetched += int((pieces.end[partial] - pieces.start[partial]).sum())
        requests += len(np.unique(members.position[pieces.member[partial]]))
    return fetched / data_bytes, requests / len(order)


@pytest.mark.parametrize("mode", ["uniform", "windows", "blocks"])
def test_every_shuffle_reads_about_the_dataset_once_through_a_quarter_cache_with_a_plan(dataset, tmp_path, mode):
    locality = (PER_SHARD, 3) if mode != "uniform" else None
    order = EpochSampler(SAMPLES, 1, seed=7, shuffle=mode, locality=locality).rank_order()
    lru_bytes, _ = replay(dataset, tmp_path, order, 0.25, plan=False)
    plan_bytes, plan_requests = replay(dataset, tmp_path, order, 0.25, plan=True)
    assert plan_bytes <= 1.2 and plan_requests <= 1.0
    if mode == "uniform":  # LRU evicts blocks before most of their samples are read
        assert plan_bytes < lru_bytes / 2


def test_next_use_eviction_alone_beats_lru_on_a_random_order(dataset, tmp_path, monkeypatch):
    order = EpochSampler(SAMPLES, 1, seed=8).rank_order()
    lru, _ = replay(dataset, tmp_path, order, 0.5, plan=False)
    monkeypatch.setattr(Plans, "whole_blocks", lambda self, dataset, shards, blocks: np.ones(len(blocks), bool))
    belady, _ = replay(dataset, tmp_path, order, 0.5, plan=True)
    assert belady < 0.75 * lru


@pytest.mark.parametrize("parts", [1, 8])
def test_one_owners_part_of_a_batch_moves_the_plan_when_batches_come_in_parts(dataset, tmp_path, parts):
    """Routed clients send each of ``parts`` nodes its own samples of a batch: one part is
    then a sparse pick of the batch's positions, which must still tell where the reader is."""
    order = EpochSampler(SAMPLES, 1, seed=9).rank_order()
    plans = Plans(ServiceConfig(block_size=BLOCK), Metrics(), parts=lambda: parts)
    plan = plans.build(dataset, "indices", order, None, True, None)
    plans.insert(plan)
    plans.observe(dataset, order[640:704][::8])  # one of 8 owners' samples of the batch at 640
    if parts == 1:  # a batch's 8 samples spread over 57 positions: taken for another reader's
        assert plan.position == 0
    else:
        assert (plan.position, plan.batch) == (640, 57)
