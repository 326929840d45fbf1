"""The recipe users type gets the plan: ``ShardfeedIterableDataset`` in a plain ``DataLoader``
registers one plan per rank and epoch, whatever the worker count, and none twice with
``ShardfeedLoader``; its default shuffle follows the cache the service reports. A map-style
dataset larger than the cache, read in PyTorch's own order, warns once, naming
``ShardfeedSampler``."""

from __future__ import annotations

import httpx
import pytest
from torch.utils.data import DataLoader

from shardfeed.client.torch import ShardfeedDataset, ShardfeedIterableDataset, ShardfeedLoader, ShardfeedSampler
from shardfeed.process import start_service

from common.datasets import dir_put, make_dataset

SAMPLES = 200


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    root = tmp_path_factory.mktemp("plain-recipe")
    make_dataset(dir_put(root), samples=SAMPLES, per_shard=25, sizes=(2000, 4000))  # 8 shards, ~0.6 MiB
    return root.as_uri()


@pytest.fixture
def service(dataset, tmp_path):
    with start_service({"train": dataset}, cache_dir=tmp_path / "cache", args=["--block-size", "64KiB"]) as svc:
        yield svc


def plans(service) -> list[dict]:
    return httpx.get(f"{service.url}/v1/datasets/train/plans", timeout=10).json()


def epoch_of(loader) -> list[int]:
    return [s["__index__"] for batch in loader for s in batch]


@pytest.mark.parametrize("workers", [0, 2])
def test_a_plain_dataloader_registers_one_plan_per_rank_and_epoch(service, workers):
    ranks = [ShardfeedIterableDataset(service.url, "train", batch_size=10, rank=rank, world_size=2, collate_fn=None)
             for rank in (0, 1)]
    known: set[str] = set()
    for epoch in (0, 1):
        seen = []
        for ds in ranks:
            ds.set_epoch(epoch)
            seen += epoch_of(DataLoader(ds, batch_size=None, num_workers=workers))
        assert sorted(seen) == list(range(SAMPLES))
        held = plans(service)
        new = {plan["id"] for plan in held} - known
        assert len(new) == 2, held  # one per rank, whatever the workers
        known |= new
        assert all(plan["samples"] == SAMPLES // 2 for plan in held)
        # Each read to its end, each goes soon (its process replaces it, or it expires): a
        # plan per pass does not fill --max-plans.
        assert len(held) <= 2 * (epoch + 1) and all(plan["expires_in"] <= 30 for plan in held), held


def test_shardfeed_loader_and_its_workers_register_the_epoch_once(service):
    ds = ShardfeedIterableDataset(service.url, "train", batch_size=10, collate_fn=None)
    assert len(epoch_of(ShardfeedLoader(ds, num_workers=2))) == SAMPLES
    assert len(plans(service)) == 1
    assert len(epoch_of(ShardfeedLoader(ds, num_workers=2))) == SAMPLES  # the next epoch replaces it
    assert len(plans(service)) == 1


def test_the_default_shuffle_is_uniform_when_the_cache_holds_the_dataset_and_windows_when_not(dataset, tmp_path):
    for cache, mode in (("64MiB", True), ("256KiB", "windows")):
        with start_service({"train": dataset}, cache_dir=tmp_path / cache, cache_size=cache,
                           args=["--block-size", "64KiB"]) as svc:
            ds = ShardfeedIterableDataset(svc.url, "train", batch_size=10)
            assert ds.sampler.shuffle == mode
            assert ShardfeedIterableDataset(svc.url, "train", batch_size=10, shuffle="blocks").sampler.shuffle == \
                "blocks"


def test_a_map_style_dataset_larger_than_the_cache_read_without_shardfeed_sampler_warns_once(dataset, tmp_path,
                                                                                             caplog):
    def warnings() -> list[str]:
        return [r.getMessage() for r in caplog.records if "ShardfeedSampler" in r.getMessage()]

    for cache in ("256KiB", "64MiB"):
        with start_service({"train": dataset}, cache_dir=tmp_path / cache, cache_size=cache,
                           args=["--block-size", "64KiB"]) as svc:
            caplog.clear()
            planned = ShardfeedDataset(svc.url, "train")
            assert len(planned) == SAMPLES  # the script's own len(): no warning
            for _ in range(2):
                assert len(epoch_of(DataLoader(planned, batch_size=10, sampler=ShardfeedSampler(planned),
                                               collate_fn=list))) == SAMPLES
            assert warnings() == []
            plain = ShardfeedDataset(svc.url, "train")
            for _ in range(2):
                assert len(epoch_of(DataLoader(plain, batch_size=10, shuffle=True, num_workers=2,
                                               collate_fn=list))) == SAMPLES
            assert len(warnings()) == (1 if cache == "256KiB" else 0), warnings()
