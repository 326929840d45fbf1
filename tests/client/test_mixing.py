"""A mixture's epoch order (``client/mixing.py``): exact counts, a bounded mix per batch, resume at
any world size, weights that change mid-epoch, subsets. Pure numpy, no service."""

from __future__ import annotations

import math

import numpy as np
import pytest

from shardfeed.client.mixing import IndexColumns, MixtureSampler, Stream, locate, mix_bound, placed, pool_of, split_counts

NAMES = ["web", "books", "code"]


def mixture(pools=(1000, 100, 100), weights=(0.5, 0.3, 0.2), batch_size=64, **options) -> MixtureSampler:
    return MixtureSampler(pools, batch_size, names=NAMES[:len(pools)], weights=weights, **options)


def per_stream(sampler: MixtureSampler, numbers: np.ndarray) -> np.ndarray:
    return np.bincount(locate(sampler.offsets, numbers)[0], minlength=len(sampler.names))


def test_each_streams_count_per_epoch_is_exact_by_weight_and_by_repeat_and_choose():
    by_weight = mixture(epoch_size=999)
    assert by_weight.samples == 999
    assert per_stream(by_weight, by_weight.order()).tolist() == split_counts((0.5, 0.3, 0.2), 999).tolist() \
        == [499, 300, 200]  # 499.5, 299.7, 199.8: the largest remainders round up
    assert mixture().samples == 1200  # every pool's size by default
    by_count = MixtureSampler((1000, 100, 100), 64, names=NAMES, counts=[250, 200, 37])
    for epoch in range(3):
        by_count.set_epoch(epoch)
        order = by_count.order()
        assert per_stream(by_count, order).tolist() == [250, 200, 37]
        streams, positions = locate(by_count.offsets, order)
        twice = np.bincount(positions[streams == 1], minlength=100)
        assert (twice == 2).all()  # repeat=2 reads every sample of its pool twice
        assert len(set(positions[streams == 0].tolist())) == 250  # choose below the pool: distinct samples


def test_every_batch_holds_each_stream_within_the_bound_and_the_binomial_band():
    sampler = mixture(pools=(10_000, 1000, 1000))
    order = sampler.order()
    shares = split_counts((0.5, 0.3, 0.2), len(order)) / len(order)
    streams = locate(sampler.offsets, order)[0]
    for size in (64, 7, 1):
        batches = streams[:len(streams) // size * size].reshape(-1, size)
        for s, share in enumerate(shares):
            counts = (batches == s).sum(axis=1)
            low, high = binomial_band(size, share, 0.999)
            assert (np.abs(counts - size * share) <= mix_bound(3)).all()
            assert ((counts >= low) & (counts <= high)).all()


def binomial_band(n: int, p: float, mass: float) -> tuple[int, int]:
    """The central ``mass`` of Binomial(n, p): its (1 - mass) / 2 and (1 + mass) / 2 quantiles."""
    cdf = np.cumsum([math.comb(n, k) * p ** k * (1 - p) ** (n - k) for k in range(n + 1)])
    return int(np.searchsorted(cdf, (1 - mass) / 2)), int(np.searchsorted(cdf, (1 + mass) / 2))


def test_the_bound_holds_over_random_mixtures_and_run_lengths():
    rng = np.random.default_rng(0)
    for trial in range(200):
        streams = int(rng.integers(2, 7))
        counts = split_counts(rng.dirichlet(np.full(streams, 0.5)) + 1e-3, int(rng.integers(200, 5000)))
        order = placed(counts, np.random.default_rng(trial))
        for s, count in enumerate(counts.tolist()):
            ahead = np.concatenate([[0], np.cumsum(order == s)])
            for run in (1, 3, 64, 500):
                if run <= len(order):
                    held = ahead[run:] - ahead[:-run]
                    assert np.abs(held - run * count / len(order)).max() <= mix_bound(streams)


def test_the_order_is_a_function_of_seed_epoch_streams_and_weights():
    assert np.array_equal(mixture(seed=3).order(), mixture(seed=3).order())
    assert not np.array_equal(mixture(seed=3).order(), mixture(seed=4).order())
    assert not np.array_equal(mixture(weights=(0.4, 0.4, 0.2)).order(), mixture().order())
    sampler = mixture()
    first = sampler.order().copy()
    sampler.set_epoch(1)
    assert not np.array_equal(first, sampler.order())


def consume(sampler: MixtureSampler, steps: int | None, workers: int = 1) -> list[int]:
    """What every rank of ``sampler``'s world reads in ``steps`` training steps (all: ``None``),
    as their DataLoader workers hand batches over; ``sampler``'s progress moves that far."""
    world = sampler.world_size
    per_rank = []
    for rank in range(world):
        copy = MixtureSampler(sampler.pools, sampler.batch_size, names=sampler.names, weights=sampler.weights,
                              counts=sampler.fixed,
                              rank=rank, world_size=world, seed=sampler.seed, signature=sampler.signature)
        copy.load_state_dict(sampler.state_dict())
        streams = [list(copy.batches(w, workers)) for w in range(workers)]
        per_rank.append([streams[k % workers][k // workers] for k in range(len(copy))])
    steps = len(per_rank[0]) if steps is None else steps
    sampler.advance(steps)
    return [int(i) for k in range(steps) for rank in range(world) for i in per_rank[rank][k]]


@pytest.mark.parametrize("workers", [1, 4])
def test_a_resume_at_world_size_2_then_3_then_1_reads_exactly_the_samples_not_yet_seen(workers):
    sampler = mixture(batch_size=8, world_size=2)
    epoch = sampler.order().tolist()
    seen = consume(sampler, 20, workers)
    state = sampler.state_dict()
    three = mixture(batch_size=8, world_size=3)
    three.load_state_dict(state)
    seen += consume(three, 11, workers)
    one = mixture(batch_size=8)
    one.load_state_dict(three.state_dict())
    seen += consume(one, None, workers)
    assert seen[:len(epoch)] == epoch  # in the epoch's order: nothing lost, nothing read twice
    assert len(seen) - len(epoch) < 8  # the last step's padding only


def test_new_weights_mid_epoch_take_effect_at_the_step_and_a_resume_after_them_reads_the_same():
    run = mixture(batch_size=16)
    before = run.order().copy()
    consume(run, 10)
    run.set_weights([0.1, 0.1, 0.8])
    after = run.order()
    assert np.array_equal(after[:160], before[:160]) and not np.array_equal(after, before)
    rest = per_stream(run, after[160:])
    assert rest.tolist() == split_counts((0.1, 0.1, 0.8), 1200 - 160).tolist()
    consume(run, 15)
    resumed = mixture(batch_size=16)
    resumed.load_state_dict(run.state_dict())
    assert np.array_equal(resumed.order(), after)
    assert consume(resumed, None) == consume(run, None)
    for sampler in (run, resumed):  # the next epoch starts with the weights last set
        sampler.set_epoch(1)
        assert sampler.weights == (0.1, 0.1, 0.8) and sampler.changes == []
    assert np.array_equal(resumed.order(), run.order())


def test_each_stream_goes_on_with_its_own_samples_after_a_change():
    run = mixture(pools=(300, 300, 300), weights=(1, 1, 1), batch_size=10)
    consume(run, 12)
    run.set_weights([1, 0, 1])
    streams, positions = locate(run.offsets, run.order())
    books = positions[streams == 1]
    assert len(books) == 40 and len(set(books.tolist())) == 40  # its first 40, none after the change


def test_bad_weights_and_streams_are_refused_naming_the_stream():
    with pytest.raises(ValueError, match="'books': weight must be a finite number >= 0"):
        mixture(weights=(0.5, -0.3, 0.2))
    with pytest.raises(ValueError, match="all zero"):
        mixture(weights=(0, 0, 0))
    with pytest.raises(ValueError, match="2 weights for 3 streams"):
        mixture().set_weights([0.5, 0.5])
    with pytest.raises(ValueError, match="'code': weight must be"):
        mixture().set_weights([0.5, 0.5, math.nan])
    with pytest.raises(ValueError, match="stream 'x': give one of weight, repeat and choose"):
        Stream("a", weight=1, repeat=2, name="x")
    with pytest.raises(ValueError, match="choose must be an integer"):
        Stream("a", choose=2.5)
    with pytest.raises(ValueError, match="sized by repeat or choose"):
        MixtureSampler((10, 10), 4, names=NAMES[:2], counts=[10, 10]).set_weights([1, 1])
    with pytest.raises(ValueError, match="stream 'books' holds no samples"):
        mixture(pools=(10, 0, 10))
    other = mixture(seed=1)
    with pytest.raises(ValueError, match="seed=0"):
        other.load_state_dict(mixture().state_dict())


def columns(keys: list[str], sizes: list[int]) -> IndexColumns:
    held = {"key": np.array([k.encode() for k in keys]), "bytes": np.array(sizes, dtype=np.int64)}
    return IndexColumns(held.__getitem__, list(held))


def test_a_subset_by_numbers_by_keys_or_by_a_predicate():
    index = columns([f"k{i:03d}" for i in range(100)], list(range(100)))
    assert pool_of([5, 3, 3, 90], 100, lambda: index, "s").tolist() == [3, 5, 90]
    assert pool_of(["k007", "k002"], 100, lambda: index, "s").tolist() == [2, 7]
    assert pool_of(lambda c: c["bytes"] % 10 == 0, 100, lambda: index, "s").tolist() == list(range(0, 100, 10))
    assert pool_of(lambda c: np.flatnonzero(c["bytes"] > 97), 100, lambda: index, "s").tolist() == [98, 99]
    with pytest.raises(ValueError, match="stream 's': no sample with key 'nope'"):
        pool_of(["k001", "nope"], 100, lambda: index, "s")
    with pytest.raises(ValueError, match="outside its dataset's 100"):
        pool_of([100], 100, lambda: index, "s")
    with pytest.raises(ValueError, match="mask of shape"):
        pool_of(lambda c: np.ones(3, bool), 100, lambda: index, "s")
    with pytest.raises(KeyError, match="no index column 'label'"):
        pool_of(lambda c: c["label"] > 0, 100, lambda: index, "s")


def test_a_filtered_stream_counts_only_what_it_kept_and_resumes_exactly():
    kept = pool_of(lambda c: c["bytes"] % 3 == 0, 300, lambda: columns([str(i) for i in range(300)],
                                                                     list(range(300))), "s")
    sampler = MixtureSampler((len(kept), 50), 10, names=NAMES[:2], counts=[len(kept), 50])
    epoch = sampler.order().tolist()
    seen = consume(sampler, 7)
    resumed = MixtureSampler((len(kept), 50), 10, names=NAMES[:2], counts=[len(kept), 50], world_size=2)
    resumed.load_state_dict(sampler.state_dict())
    seen += consume(resumed, None)
    assert seen[:len(epoch)] == epoch
    streams, positions = locate(sampler.offsets, np.array(epoch))
    assert sorted(kept[positions[streams == 0]].tolist()) == list(range(0, 300, 3))

