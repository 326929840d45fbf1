"""Mixtures through the real service and real DataLoader workers: every sample is its stream's
source, byte for byte; counts exact; resume at another world size; a curriculum; one plan per
stream; errors named before the first batch."""

from __future__ import annotations

import asyncio
from collections import Counter

import httpx
import numpy as np
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from torch.utils.data import DataLoader

from shardfeed.client.mixing import Stream
from shardfeed.client.torch import ShardfeedDataset, ShardfeedIterableDataset, ShardfeedLoader, ShardfeedSampler
from shardfeed.process import start_service

from common.synthetic import expected, seed_synthetic

SIZES = {"web": 400, "books": 40, "code": 40}  # one stream 10x the others
WEIGHTS = {"web": 0.5, "books": 0.3, "code": 0.2}
FIELDS = ["bin", "cls"]


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    root = tmp_path_factory.mktemp("mixture")
    urls = {name: seed_synthetic(root / name, samples=n) for name, n in SIZES.items()}
    urls["other"] = seed_synthetic(root / "other", samples=20, fields=("bin", "json"))
    with start_service(urls, cache_dir=root / "cache") as svc:
        yield svc


def streams(**overrides) -> list[Stream]:
    return [Stream(name, weight=overrides.get(name, weight)) for name, weight in WEIGHTS.items()]


def dataset(service, **options) -> ShardfeedIterableDataset:
    options = {"batch_size": 16, "fields": FIELDS, "collate_fn": None, **options}
    return ShardfeedIterableDataset(service.url, streams=options.pop("streams", streams()), **options)


def checked(batch: list[dict]) -> list[tuple[str, int]]:
    """The (stream, index) of each sample, each checked against its stream's source."""
    for sample in batch:  # every stream is seeded alike: sample i of each has the same bytes
        assert {k: sample[k] for k in FIELDS} == {k: expected(sample["__index__"])[k] for k in FIELDS}
    return [(s["__stream__"], s["__index__"]) for s in batch]


def served_by_stream(service) -> Counter:
    """``shardfeed_stream_samples_served_total`` by stream, from /metrics."""
    text = httpx.get(f"{service.url}/metrics").text
    return Counter({s.labels["stream"]: int(s.value) for family in text_string_to_metric_families(text)
                    for s in family.samples if s.name == "shardfeed_stream_samples_served_total"})


@pytest.mark.parametrize("workers", [0, 2])
def test_an_epoch_holds_each_streams_exact_count_and_every_byte_of_its_source(service, workers):
    ds = dataset(service)
    before = served_by_stream(service)
    read = [pair for batch in ShardfeedLoader(ds, num_workers=workers) for pair in checked(batch)]
    epoch = ds.sampler.samples
    assert epoch == sum(SIZES.values())
    counts = Counter(name for name, _ in read[:epoch])
    assert [counts[n] for n in WEIGHTS] == [240, 144, 96]  # 480 split 0.5 / 0.3 / 0.2
    assert ds.epoch == 1 and len(read) == -(-epoch // 16) * 16
    assert served_by_stream(service) - before == Counter(name for name, _ in read)  # the service counts by stream


def test_a_resume_at_world_size_2_then_3_then_1_loses_and_repeats_nothing(service):
    def read(world: int, state: dict | None, steps: int | None, workers: int) -> tuple[list, dict]:
        ranks = [dataset(service, batch_size=8, rank=r, world_size=world) for r in range(world)]
        loaders = []
        for ds in ranks:
            if state:
                ds.load_state_dict(state)
            loaders.append(iter(ShardfeedLoader(ds, num_workers=workers)))
        out = []
        for _ in range(steps if steps is not None else len(ranks[0])):
            for loader in loaders:
                out += checked(next(loader))
        return out, ranks[0].state_dict()

    whole, _ = read(1, None, None, 0)
    first, state = read(2, None, 7, 4)
    second, state = read(3, state, 5, 0)
    rest, _ = read(1, state, None, 2)
    assert (first + second + rest)[:len(whole) - 8] == whole[:len(whole) - 8]  # all but the padded end
    assert len(first) == 7 * 2 * 8 and len(second) == 5 * 3 * 8


def test_a_curriculum_change_then_a_resume_reads_what_an_uninterrupted_run_reads(service):
    def run(stop_at: int | None) -> list:
        ds = dataset(service)
        out, loader = [], ShardfeedLoader(ds, num_workers=2)
        for step, batch in enumerate(loader):
            out += checked(batch)
            if step == 4:
                ds.set_weights([0.1, 0.1, 0.8])  # from step 5 on
            if step == stop_at:
                break
        if stop_at is None:
            return out
        resumed = dataset(service)
        resumed.load_state_dict(ds.state_dict())
        return out + [pair for batch in ShardfeedLoader(resumed, num_workers=2) for pair in checked(batch)]

    whole = run(None)
    assert run(12) == whole
    late = Counter(name for name, _ in whole[80:])
    assert late["code"] > 3 * late["books"]  # the new weights ruled after step 5


def test_tensor_batches_say_each_samples_stream_through_dataloader_workers(service):
    ds = dataset(service, output="tensors", collate_fn=None)
    names = ds.source.names
    for batch in DataLoader(ds, batch_size=None, num_workers=2):
        assert batch.streams is not None and len(batch.streams) == len(batch)
        for i, sample in enumerate(batch):
            assert names[int(batch.streams[i])] in WEIGHTS and sample["__stream__"] == int(batch.streams[i])
            assert bytes(sample["bin"].numpy()) == expected(sample["__index__"])["bin"]


def test_map_style_with_the_sampler_reads_the_mixture_and_registers_one_plan_per_stream(service):
    ds = ShardfeedDataset(service.url, streams=[Stream("web", choose=100), Stream("books", repeat=2)],
                          fields=FIELDS)
    sampler = ShardfeedSampler(ds, seed=5)
    read = [pair for batch in DataLoader(ds, batch_size=16, sampler=sampler, num_workers=2, collate_fn=list)
            for pair in checked(batch)]
    counts = Counter(name for name, _ in read)
    assert counts == {"web": 100, "books": 80}
    assert Counter(i for name, i in read if name == "books") == {i: 2 for i in range(40)}
    plans = {name: httpx.get(f"{service.url}/v1/datasets/{name}/plans").json() for name in ("web", "books")}
    assert any(p["samples"] == 100 and p["kind"] == "indices" and abs(p["share"] - 100 / 180) < 1e-6
               for p in plans["web"])
    assert any(p["samples"] == 80 for p in plans["books"])


def test_a_subset_by_keys_and_by_a_predicate_reads_only_what_it_keeps(service):
    keys = [f"{i:09d}" for i in (3, 17, 39)]
    payload = {i: sum(len(expected(i)[f]) for f in ("bin", "cls", "json")) for i in range(SIZES["web"])}
    middle = int(np.median(list(payload.values())))
    ds = dataset(service, streams=[Stream("books", subset=keys), Stream("web", subset=lambda c: c["bytes"] < middle)],
                 batch_size=4)
    read = [pair for batch in ShardfeedLoader(ds) for pair in checked(batch)]
    assert {i for name, i in read if name == "books"} == {3, 17, 39}
    small = {i for i, n in payload.items() if n < middle}
    assert {i for name, i in read if name == "web"} == small and 0 < len(small) < SIZES["web"]
    assert ds.sampler.samples == 3 + len(small)  # progress counts what was kept


def test_bad_streams_are_refused_before_the_first_batch_naming_the_stream(service):
    with pytest.raises(ValueError, match="stream 'nope':.*not found|stream 'nope'"):
        dataset(service, streams=[Stream("web", weight=1), Stream("nope", weight=1)])
    with pytest.raises(ValueError, match="'web' and 'other' have different fields"):
        ShardfeedIterableDataset(service.url, streams=[Stream("web"), Stream("other")], batch_size=4)
    with pytest.raises(ValueError, match="stream 'books' has no weight"):
        dataset(service, streams=[Stream("web", weight=1), Stream("books")])
    with pytest.raises(ValueError, match="two streams are named 'web'"):
        dataset(service, streams=[Stream("web"), Stream("books", name="web")])
    with pytest.raises(TypeError, match="output='arrow' is not offered"):
        dataset(service, output="arrow")
    with pytest.raises(TypeError, match="set_weights weighs the streams of a mixture"):
        ShardfeedIterableDataset(service.url, "web", batch_size=4).set_weights([1])
    ds = dataset(service)
    with pytest.raises(ValueError, match="'books': weight must be"):
        ds.set_weights([1, -1, 1])
    # Different fields collate only by hand or as tensors.
    tensors = ShardfeedIterableDataset(service.url, streams=[Stream("web"), Stream("other")], batch_size=8,
                                       output="tensors")
    batch = next(iter(tensors))
    assert set(batch.fields) == {"bin", "cls", "json"} and torch.is_tensor(batch.streams)
    assert np.isin(batch.streams.numpy(), [0, 1]).all()


def test_the_async_client_reads_a_mixed_batch_as_the_blocking_one_does(service):
    from shardfeed.client import AsyncClient, Client
    from shardfeed.client.base import Pick

    picks = [Pick("web", [5, 399, 0], [0, 2, 4], FIELDS, "web"), Pick("books", [7, 1], [1, 3], FIELDS, "books")]
    with Client(service.url) as client:
        samples = client.get_mixed_batch(picks)
        tensors = client.get_mixed_batch(picks, output="tensors")

    async def read():
        async with AsyncClient(service.url) as client:
            return await client.get_mixed_batch(picks), await client.get_mixed_batch(picks, output="tensors")

    async_samples, async_tensors = asyncio.run(read())
    assert [s["__index__"] for s in samples] == [5, 7, 399, 1, 0] and samples == async_samples
    checked([{**s, "__stream__": ""} for s in samples])
    assert [bytes(b["bin"].numpy()) for b in async_tensors] == [s["bin"] for s in samples]
    assert tensors.indices.tolist() == async_tensors.indices.tolist() == [5, 7, 399, 1, 0]
    with Client(service.url) as client, pytest.raises(ValueError, match="'samples' or 'tensors'"):
        client.get_mixed_batch(picks, output="arrow")
