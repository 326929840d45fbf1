"""The pure sampling logic behind ShardfeedIterableDataset: order, partition, resume."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from shardfeed.client.sampling import EpochSampler, epoch_order


def rank_batches(sampler: EpochSampler, num_workers: int) -> list[list[int]]:
    """A rank's batches in the order a DataLoader delivers them (round-robin over workers)."""
    per_worker = [list(sampler.batches(w, num_workers)) for w in range(num_workers)]
    out = []
    for k in range(sum(map(len, per_worker))):
        out.append(per_worker[k % num_workers][k // num_workers].tolist())
    return out


def make(world_size: int, **kw) -> list[EpochSampler]:
    kw.setdefault("samples", 100)
    kw.setdefault("batch_size", 4)
    return [EpochSampler(rank=r, world_size=world_size, **kw) for r in range(world_size)]


def test_order_depends_only_on_seed_and_epoch():
    a = epoch_order(1000, seed=1, epoch=0)
    assert np.array_equal(a, epoch_order(1000, seed=1, epoch=0))
    assert not np.array_equal(a, epoch_order(1000, seed=2, epoch=0))
    assert not np.array_equal(a, epoch_order(1000, seed=1, epoch=1))
    assert sorted(a.tolist()) == list(range(1000))
    assert epoch_order(5, seed=1, epoch=0, shuffle=False).tolist() == [0, 1, 2, 3, 4]


def test_ranks_and_workers_cover_the_epoch_exactly_once_with_equal_batch_counts():
    samplers = make(2, samples=96, batch_size=4)
    batches = [rank_batches(s, 3) for s in samplers]
    assert len(batches[0]) == len(batches[1]) == len(samplers[0]) == 12
    seen = [i for rank in batches for b in rank for i in b]
    assert sorted(seen) == list(range(96))


def test_uneven_epoch_is_padded_by_wrapping_so_ranks_stay_equal():
    samplers = make(3, samples=100, batch_size=8)
    batches = [rank_batches(s, 2) for s in samplers]
    assert {len(b) for b in batches} == {5}  # ceil(100 / 24)
    assert all(len(b) == 8 for rank in batches for b in rank)
    counts = Counter(i for rank in batches for b in rank for i in b)
    assert set(counts) == set(range(100))
    order = samplers[0].order().tolist()
    assert {i for i, n in counts.items() if n == 2} == set(order[:20])  # wrapped from the start
    assert sum(counts.values()) == 120


def test_drop_last_trims_to_whole_steps():
    samplers = make(3, samples=100, batch_size=8, drop_last=True)
    batches = [rank_batches(s, 2) for s in samplers]
    assert {len(b) for b in batches} == {4}
    seen = [i for rank in batches for b in rank for i in b]
    assert len(set(seen)) == len(seen) == 96


@pytest.mark.parametrize("new_world, new_workers, new_batch", [(2, 2, 4), (1, 3, 4), (4, 1, 2), (2, 2, 3)])
def test_resume_yields_exactly_the_unseen_samples_after_changing_ranks_or_workers(new_world, new_workers,
                                                                                    new_batch):
    samplers = make(2, samples=96, batch_size=4, seed=7)
    for s in samplers:
        s.set_epoch(3)
    first = [rank_batches(s, 2) for s in samplers]
    steps = 5
    seen = [i for rank in first for b in rank[:steps] for i in b]
    for s in samplers:
        s.advance(steps)
    state = samplers[0].state_dict()
    assert state["consumed"] == steps * 2 * 4 and state["epoch"] == 3

    resumed = make(new_world, samples=96, batch_size=new_batch, seed=7, drop_last=True)
    for s in resumed:
        s.load_state_dict(state)
        s.set_epoch(3)  # what a training loop does at the top of the epoch: keeps the place
    rest = [i for s in resumed for b in rank_batches(s, new_workers) for i in b]
    left = 96 - len(seen)
    dropped = left % (new_world * new_batch)
    assert len(rest) == len(set(rest)) == left - dropped
    assert not set(rest) & set(seen)
    assert set(rest) <= set(samplers[0].order()[len(seen):].tolist())


def test_locality_mode_keeps_each_stretch_within_a_window_of_blocks():
    order = epoch_order(1000, seed=0, epoch=0, locality=(50, 4))
    assert sorted(order.tolist()) == list(range(1000))
    for start in range(0, 1000, 200):  # each window: 4 blocks of 50 samples
        assert len({i // 50 for i in order[start:start + 200].tolist()}) == 4
    assert not np.array_equal(order, epoch_order(1000, seed=0, epoch=1, locality=(50, 4)))


def test_state_from_another_seed_is_refused_with_the_field_named():
    a, b = EpochSampler(100, 4, seed=1), EpochSampler(100, 4, seed=2)
    with pytest.raises(ValueError, match="seed=1"):
        b.load_state_dict(a.state_dict())
    with pytest.raises(ValueError, match="not a shardfeed sampler state"):
        b.load_state_dict({"epoch": 1})


def test_advance_to_the_end_finishes_the_epoch_and_set_epoch_restarts():
    s = EpochSampler(10, 4)
    assert len(s) == 3
    s.advance(3)
    assert s.finished and list(s.batches()) == []
    s.set_epoch(1)
    assert len(s) == 3 and s.consumed == 0
