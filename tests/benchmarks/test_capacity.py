"""The capacity model's arithmetic (``benchmarks/capacity.py``), with costs given, not measured:
which resource binds, and what a later epoch finds in the cache. Its calibration and check
run for real in test_bench.py."""

from __future__ import annotations

import pytest

from shardfeed.benchmarks.capacity import Calibration, Hardware, Job, later_epoch_hit_ratio, size_cluster
from shardfeed.client.shuffles import CACHE_SHARE

KiB, MiB, GiB, TiB = 1 << 10, 1 << 20, 1 << 30, 1 << 40
COSTS = Calibration(fixed_us=100, per_member_us=5, per_mib_us=0, cold_per_mib_us=0, disk_per_mib_us=0,
                    small_size=10 * KiB, large_size=256 * KiB, batches=(16, 128), passes={}, machine={})


def hardware(**changes) -> Hardware:
    fields = dict(cores=8, nic=1.25e9, nvme=2 * TiB, ram=0, latency=0.02, connection_bandwidth=1e8, connections=32,
                  store_requests=1e9)
    return Hardware(**{**fields, **changes})


def job(**changes) -> Job:
    fields = dict(gpus=8, gpu_rate=1000, sample_size=10 * KiB, members=1, dataset_size=1 * TiB, epochs=2,
                  shuffle=True, batch=64)
    return Job(**{**fields, **changes})


def test_a_later_epoch_finds_what_the_order_leaves_in_the_cache():
    assert later_epoch_hit_ratio(2 * TiB, 1 * TiB, True) == later_epoch_hit_ratio(1 * TiB, 1 * TiB, False) == 1
    assert later_epoch_hit_ratio(TiB / 4, TiB, False) == 0.25  # index order: next-use eviction keeps the cache
    assert later_epoch_hit_ratio(TiB / 4, TiB, True) == pytest.approx((1 - CACHE_SHARE) / 4)  # less the window


def test_cpu_binds_small_samples_and_the_parts_of_a_batch_shrink_with_the_members():
    sized = size_cluster(job(gpus=100, gpu_rate=20_000), hardware(), COSTS)
    # 2,000,000 samples/s; on n nodes of 8 cores a batch of 64 reaches each member as 64 / 8n samples.
    n = sized.nodes
    per_sample = 100 / max(1, 64 / (8 * n)) + 5
    assert sized.needs["CPU"] == pytest.approx(2e6 * per_sample / 8e6) and sized.needs["CPU"] <= n
    assert max(sized.needs, key=sized.needs.get) == sized.binds == "CPU"
    assert size_cluster(job(gpus=100, gpu_rate=20_000), hardware(nvme=1), COSTS).epochs[1].hit_ratio < 1e-9


def test_the_nic_binds_large_samples_and_the_cold_epoch_asks_the_store_for_the_dataset_once():
    sized = size_cluster(job(sample_size=4 * MiB, gpu_rate=500), hardware(), COSTS)
    rate = 8 * 500 * 4 * MiB  # bytes/s served
    assert sized.binds == "NIC" and sized.nodes == -(-rate // int(1.25e9))
    cold, warm = sized.epochs
    assert cold.hit_ratio == 0 and cold.store_bytes_per_s == rate and cold.store_requests_per_s == rate / (8 * MiB)
    assert warm.hit_ratio == 1 and warm.store_bytes_per_s == 0


def test_a_store_that_allows_too_few_requests_is_named_as_what_binds():
    sized = size_cluster(job(sample_size=4 * MiB, gpu_rate=500, dataset_size=100 * TiB), hardware(store_requests=100),
                         COSTS)
    assert sized.binds.startswith("store requests (") and sized.cache_nodes == 50
    assert sized.epochs[1].hit_ratio == pytest.approx((1 - CACHE_SHARE) * sized.nodes * 2 / 100)
