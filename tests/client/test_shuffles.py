"""Every shuffle mode (client/shuffles/) through one check, as Streaming tests its algorithms."""

from __future__ import annotations

import numpy as np
import pytest

from shardfeed.client.sampling import EpochSampler, epoch_order
from shardfeed.client.shuffles import LOCAL, SHUFFLES, cache_window

SAMPLES, BLOCK, WINDOW = 10_007, 100, 8  # a short last block


@pytest.mark.parametrize("mode", sorted(SHUFFLES))
def test_every_mode_is_a_deterministic_permutation_per_seed_and_epoch(mode):
    locality = (BLOCK, WINDOW)
    order = epoch_order(SAMPLES, seed=1, epoch=0, shuffle=mode, locality=locality)
    assert order.dtype == np.int64 and np.array_equal(np.sort(order), np.arange(SAMPLES))
    assert np.array_equal(order, epoch_order(SAMPLES, seed=1, epoch=0, shuffle=mode, locality=locality))
    if mode != "none":
        assert not np.array_equal(order, epoch_order(SAMPLES, seed=1, epoch=1, shuffle=mode, locality=locality))
        assert not np.array_equal(order, epoch_order(SAMPLES, seed=2, epoch=0, shuffle=mode, locality=locality))
    if mode in LOCAL:  # any stretch of a window's samples draws from about a window of blocks
        blocks = order // BLOCK
        for start in range(0, SAMPLES - WINDOW * BLOCK, 997):
            assert len(set(blocks[start:start + WINDOW * BLOCK].tolist())) <= 2 * WINDOW + 1


def test_windows_mixes_across_window_boundaries_where_blocks_does_not():
    """``blocks`` changes all its shards at a window's end; ``windows`` one shard at a time."""
    for mode, most_new in (("blocks", WINDOW), ("windows", 3)):
        blocks = epoch_order(SAMPLES, seed=3, epoch=0, shuffle=mode, locality=(BLOCK, WINDOW)) // BLOCK
        step = BLOCK // 2
        news = [len(set(blocks[i + step:i + 2 * step].tolist()) - set(blocks[:i + step].tolist()))
                for i in range(0, SAMPLES - 2 * step, step)]
        assert max(news) >= most_new if mode == "blocks" else max(news) <= most_new


def test_locality_modes_resume_elastically_and_need_locality():
    whole = EpochSampler(SAMPLES, 32, shuffle="windows", locality=(BLOCK, WINDOW), world_size=2)
    whole.advance(10)
    order, consumed = whole.order(), whole.consumed
    resumed = [EpochSampler(SAMPLES, 16, shuffle="windows", locality=(BLOCK, WINDOW), world_size=3, rank=r)
               for r in range(3)]
    rest = []
    for sampler in resumed:
        sampler.load_state_dict(whole.state_dict())
        rest += [i for b in sampler.batches() for i in b.tolist()]
    assert set(rest) >= set(order[consumed:].tolist())  # what was not seen, with another world size
    assert 0 <= len(rest) - (SAMPLES - consumed) < 3 * 16  # plus padding to whole steps
    with pytest.raises(ValueError, match="needs locality"):
        EpochSampler(SAMPLES, 4, shuffle="windows")
    with pytest.raises(ValueError, match="unknown shuffle mode"):
        EpochSampler(SAMPLES, 4, shuffle="sideways")


def test_cache_window_fits_the_reported_cache():
    info = {"shards": 100, "bytes": 100 * 4 << 20, "cache": {"bytes": 100 << 20, "block_size": 1 << 20}}
    assert cache_window(info) == 13  # 3/4 of 100 blocks, 5.4 blocks per shard of 4.4 MiB
    assert cache_window({**info, "cache": {"bytes": 1 << 40, "block_size": 1 << 20}}) == 100
    assert cache_window({**info, "cache": {"bytes": 0, "block_size": 1 << 20}}) == 1
