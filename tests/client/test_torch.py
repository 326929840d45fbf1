"""The PyTorch datasets through real DataLoader worker processes and a real service."""

from __future__ import annotations

import threading
import time
from collections import Counter

import httpx
import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, default_convert

from shardfeed.client import ShardfeedHTTPError
from shardfeed.client.torch import ShardfeedDataset, ShardfeedIterableDataset, ShardfeedLoader, ShardfeedSampler
from shardfeed.process import start_service

from common.synthetic import SIZES, expected, seed_synthetic

SAMPLES = 300


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    root = tmp_path_factory.mktemp("torch")
    url = seed_synthetic(root / "train", samples=SAMPLES)
    with start_service({"train": url}, cache_dir=root / "cache") as svc:
        yield svc


def batch_requests(service) -> int:
    """``shardfeed_requests_total{route="batch"}`` summed over statuses, from /metrics."""
    total = 0.0
    for line in httpx.get(f"{service.url}/metrics").text.splitlines():
        if line.startswith("shardfeed_requests_total{") and 'route="batch"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return int(total)


def indices_of(batches) -> list[int]:
    return [i for b in batches for i in (b["__index__"].tolist() if torch.is_tensor(b["__index__"])
                                         else [s["__index__"] for s in b])]


def test_dataloader_with_two_workers_sends_one_request_per_batch_and_returns_the_source(service):
    ds = ShardfeedDataset(service.url, "train")
    before = batch_requests(service)
    loader = DataLoader(ds, batch_size=32, shuffle=True, num_workers=2, collate_fn=list)
    batches = list(loader)
    assert batch_requests(service) - before == len(batches) == 10  # ceil(300 / 32)
    seen = [s for b in batches for s in b]
    assert sorted(s["__index__"] for s in seen) == list(range(SAMPLES))
    assert all(s == expected(s["__index__"]) for s in seen)
    assert ds[-1] == expected(SAMPLES - 1)
    with pytest.raises(IndexError, match="out of range"):
        ds[SAMPLES]


@pytest.mark.filterwarnings("ignore:'pin_memory' argument is set as true but no accelerator")
def test_distributed_sampler_with_two_ranks_covers_the_dataset_exactly_once(service):
    ds = ShardfeedDataset(service.url, "train", fields=["cls", "json"], decode=True,
                          transform=lambda s: (s["__index__"], s["cls"], s["json"]["label"]))
    seen = []
    for rank in range(2):
        sampler = DistributedSampler(ds, num_replicas=2, rank=rank, shuffle=True, seed=3)
        loader = DataLoader(ds, batch_size=16, sampler=sampler, num_workers=2, pin_memory=True,
                            persistent_workers=True)
        for index, label, json_label in loader:
            assert torch.equal(label, json_label)  # decoded .cls and .json agree
            seen += index.tolist()
    assert sorted(seen) == list(range(SAMPLES))


@pytest.mark.slow
@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_workers_started_by_spawn_and_forkserver_fetch_their_own_batches(service, method):
    ds = ShardfeedDataset(service.url, "train", fields=["bin"])
    ds.source.client.info("train")  # the parent holds a live connection pool when workers start
    loader = DataLoader(ds, batch_size=100, num_workers=2, multiprocessing_context=method, collate_fn=list)
    seen = [s for b in loader for s in b]
    assert seen == [expected(i, ("bin",)) for i in range(SAMPLES)]


def iterable(service, **kw) -> ShardfeedIterableDataset:
    kw.setdefault("batch_size", 20)
    return ShardfeedIterableDataset(service.url, "train", fields=["cls"], **kw)


def test_iterable_order_is_the_same_for_a_seed_and_differs_for_another(service):
    def order(seed: int) -> list[int]:
        return indices_of(ShardfeedLoader(iterable(service, seed=seed), num_workers=2))

    first = order(1)
    assert sorted(first) == list(range(SAMPLES))
    assert order(1) == first
    assert order(2) != first


def test_iterable_batches_hold_the_source_samples(service):
    loader = ShardfeedLoader(iterable(service, collate_fn=None, decode=True), num_workers=2)
    for batch in loader:
        for s in batch:
            assert s["cls"] == int(expected(s["__index__"], ("cls",))["cls"])
    assert loader.epoch == 1  # a pass read to the end moves to the next epoch


def _label_array(sample: dict) -> np.ndarray:
    return np.array([int(sample["cls"]), sample["__index__"]])


def test_shardfeed_loader_hands_batches_on_as_the_dataset_made_them(service):
    # collate_fn=None yields the list of transformed samples: NumPy arrays stay arrays
    # (a plain DataLoader's default_convert would make them tensors).
    got = list(ShardfeedLoader(iterable(service, collate_fn=None, transform=_label_array), num_workers=2))
    assert sum(len(b) for b in got) == SAMPLES
    for batch in got:
        assert isinstance(batch, list)
        for array in batch:
            assert type(array) is np.ndarray
            assert array[0] == int(expected(int(array[1]), ("cls",))["cls"])
    converted = next(iter(ShardfeedLoader(iterable(service, collate_fn=None, transform=_label_array),
                                          collate_fn=default_convert)))
    assert all(torch.is_tensor(t) for t in converted)


@pytest.mark.filterwarnings("ignore:This DataLoader will create 3 worker processes")
@pytest.mark.parametrize("workers_after", [1, 3])
def test_resume_from_a_mid_epoch_state_yields_exactly_the_remaining_samples(service, workers_after):
    loader = ShardfeedLoader(iterable(service, seed=5), num_workers=2)
    loader.dataset.set_epoch(4)
    seen = []
    for step, batch in enumerate(loader):
        seen += indices_of([batch])
        if step == 6:
            state = loader.state_dict()
            break
    assert state["epoch"] == 4 and state["consumed"] == 7 * 20

    # Another batch size too: 160 samples left make 5 full batches of 32, so none is padded.
    resumed = ShardfeedLoader(iterable(service, seed=5, batch_size=32), num_workers=workers_after)
    resumed.load_state_dict(state)
    resumed.dataset.set_epoch(4)  # as a training loop does at the top of each epoch: keeps the place
    rest = indices_of(resumed)
    assert len(rest) == SAMPLES - len(seen)
    assert sorted(seen + rest) == list(range(SAMPLES))

    full = indices_of(ShardfeedLoader(_at_epoch(iterable(service, seed=5), 4), num_workers=2))
    assert seen + rest == full  # the epoch's one global order, whatever the workers and batch size


def _at_epoch(ds: ShardfeedIterableDataset, epoch: int) -> ShardfeedIterableDataset:
    ds.set_epoch(epoch)
    return ds


def test_ranks_get_equal_batch_counts_and_together_cover_the_epoch(service):
    ranks = [iterable(service, batch_size=32, rank=r, world_size=2) for r in range(2)]
    per_rank = [list(ShardfeedLoader(ds, num_workers=2)) for ds in ranks]
    assert len(per_rank[0]) == len(per_rank[1]) == len(ranks[0]) == 5  # ceil(300 / 64), padded
    seen = indices_of(per_rank[0] + per_rank[1])
    assert set(seen) == set(range(SAMPLES)) and len(seen) == 320


def test_prefetch_fetches_a_bounded_number_of_batches_ahead(service):
    ds = iterable(service, prefetch=2)
    before = batch_requests(service)
    stream = iter(ds)
    next(stream)
    time.sleep(0.5)  # a slow training step: the prefetcher fills its queue, then waits
    ahead = batch_requests(service) - before
    assert 3 <= ahead <= 4  # the batch taken, 2 queued, at most 1 more in hand
    stream.close()


def _fetching_thread(sample: dict) -> dict:
    return {**sample, "thread": threading.current_thread().name}


@pytest.mark.parametrize("workers, prefetch, thread", [(0, None, "shardfeed-prefetch"), (2, None, "MainThread"),
                                                       (2, 1, "shardfeed-prefetch"), (0, 0, "MainThread")])
def test_batches_are_prefetched_on_a_thread_by_default_only_without_dataloader_workers(service, workers, prefetch,
                                                                                      thread):
    # In a DataLoader worker the DataLoader already fetches ahead; a thread beside it only
    # contends for the GIL. An explicit prefetch is honoured.
    ds = iterable(service, transform=_fetching_thread, collate_fn=None, prefetch=prefetch)
    batches = list(ShardfeedLoader(ds, num_workers=workers))
    assert {s["thread"] for batch in batches for s in batch} == {thread}
    assert sorted(s["__index__"] for batch in batches for s in batch) == list(range(SAMPLES))


def test_shard_locality_mode_keeps_a_stretch_of_batches_within_a_few_shards(service):
    per_shard = iterable(service).source.info["shard_samples"]  # shards hold runs this long
    ds = iterable(service, shard_window=2, batch_size=10)
    order = indices_of(ShardfeedLoader(ds))
    assert sorted(order) == list(range(SAMPLES))
    assert len({i // per_shard for i in order[:2 * per_shard]}) == 2


def test_unknown_dataset_fails_at_construction_with_the_service_message(service):
    with pytest.raises(ShardfeedHTTPError, match="no dataset named 'nope'"):
        ShardfeedDataset(service.url, "nope")
    with pytest.raises(ValueError, match="persistent_workers"):
        ShardfeedLoader(iterable(service), num_workers=2, persistent_workers=True)


def test_samples_are_the_source_with_sizes_from_the_seed(service):
    ds = ShardfeedDataset(service.url, "train", fields=["bin"])
    assert all(SIZES[0] <= len(s["bin"]) <= SIZES[1] for s in ds.__getitems__(list(range(50))))


def test_shardfeed_sampler_covers_the_dataset_as_distributed_sampler_does(service):
    ds = ShardfeedDataset(service.url, "train")
    for world_size in (1, 3, 7):
        for drop_last in (False, True):
            ours = [list(ShardfeedSampler(ds, world_size, rank, seed=1, drop_last=drop_last, plan=False))
                    for rank in range(world_size)]
            theirs = [list(DistributedSampler(range(SAMPLES), world_size, rank, seed=1, drop_last=drop_last))
                      for rank in range(world_size)]
            assert [len(o) for o in ours] == [len(t) for t in theirs]
            assert len(ShardfeedSampler(ds, world_size, 0, drop_last=drop_last, plan=False)) == len(theirs[0])
            counts = Counter(i for o in ours for i in o)
            if drop_last:  # every sample at most once, as many as DistributedSampler keeps
                assert max(counts.values()) == 1 and sum(counts.values()) == sum(map(len, theirs))
            else:  # every sample at least once; the padding repeats as few
                assert set(counts) == set(range(SAMPLES))
                assert sum(counts.values()) - SAMPLES == sum(map(len, theirs)) - SAMPLES < world_size
    sampler = ShardfeedSampler(ds, 2, 1, plan=False)
    first = list(sampler)
    assert list(sampler) == first
    sampler.set_epoch(1)
    assert list(sampler) != first and sorted(sampler) == sorted(set(sampler))


def test_shardfeed_sampler_registers_its_plan_and_the_dataloader_reads_the_source(service):
    ds = ShardfeedDataset(service.url, "train")
    sampler = ShardfeedSampler(ds, 2, 0, seed=2)
    loader = DataLoader(ds, batch_size=16, sampler=sampler, num_workers=2, collate_fn=list)
    seen = []
    for batch in loader:
        plans = httpx.get(f"{service.url}/v1/datasets/train/plans").json()
        seen += batch
    mine = [p for p in plans if p["id"] == sampler.plan.id]
    assert [s["__index__"] for s in seen] == sampler.sampler.rank_order().tolist()
    assert all(s == expected(s["__index__"]) for s in seen)
    assert mine and mine[0]["samples"] == len(sampler) and mine[0]["position"] > 0
    sampler.set_epoch(1)
    old = sampler.plan.id
    list(loader)
    ids = [p["id"] for p in httpx.get(f"{service.url}/v1/datasets/train/plans").json()]
    assert sampler.plan.id in ids and old not in ids  # a new epoch replaces the plan


@pytest.mark.slow
def test_shardfeed_sampler_registers_again_when_the_service_dropped_its_plan(tmp_path, monkeypatch):
    monkeypatch.setattr("shardfeed.client.plans.CHECK_EVERY", 0.0)
    url = seed_synthetic(tmp_path / "train", samples=SAMPLES)
    with start_service({"train": url}, cache_dir=tmp_path / "cache", args=["--plan-ttl", "1"]) as svc:
        ds = ShardfeedDataset(svc.url, "train")
        sampler = ShardfeedSampler(ds, seed=3)
        seen = []
        for k, index in enumerate(sampler):
            if k == 0:
                first = sampler.plan.id
                time.sleep(1.5)  # no batch read: the plan expires
            seen.append(index)
        assert sampler.plan.id != first  # registered again, for the rest of the epoch
        plan = httpx.get(f"{svc.url}/v1/datasets/train/plans/{sampler.plan.id}").json()
        assert 0 < plan["samples"] < SAMPLES
    assert sorted(seen) == list(range(SAMPLES))  # nothing lost
