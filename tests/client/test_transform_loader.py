"""A transform's batches through the real service and real DataLoader workers (client/torch.py,
client/transformed.py): ``transform="digest"`` (the service runs it) and
``transform=load(spec)`` (the workers run it) give byte-identical ``batch.outputs`` for the same
``(seed, epoch, index)``, map-style with ``ShardfeedSampler`` and iterable; a resume mid-epoch at
another world size gives the uninterrupted run's tensors; another epoch gives others."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader

from shardfeed.client import Client
from shardfeed.client.sampling import Drawn
from shardfeed.client.tensors import Batch
from shardfeed.client.torch import ShardfeedDataset, ShardfeedIterableDataset, ShardfeedLoader, ShardfeedSampler
from shardfeed.process import start_service
from shardfeed.retry import Backoff
from shardfeed.transforms import apply, load

from common import REPO
from common.datasets import dir_put, make_dataset

SAMPLES, PER_SHARD, BATCH = 40, 10, 8
SPEC = "common.sample_transforms:digest"
EITHER = "common.sample_transforms:digest_of_either"  # declares ``raw``, which the dataset lacks, beside ``bin``


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("transform-loader")
    source = make_dataset(dir_put(root / "train"), samples=SAMPLES, per_shard=PER_SHARD, sizes=(100, 3000))
    with start_service({"train": (root / "train").as_uri()}, cache_dir=root / "cache",
                       env={"PYTHONPATH": str(REPO / "tests")},
                       args=["--transform", f"digest={SPEC}", "--transform", f"either={EITHER}",
                             "--transform-processes", "2"]) as svc, \
            Client(svc.url, backoff=Backoff(attempts=1)) as client:
        yield client, source


def outputs_by_index(batches: list[Batch]) -> dict[int, tuple]:
    """Every sample's outputs as bytes (with their dtype and shape), by sample number."""
    seen: dict[int, tuple] = {}
    for batch in batches:
        assert isinstance(batch, Batch) and not batch.missing.any()
        outputs = batch.outputs
        for k, index in enumerate(batch.indices.tolist()):
            mine = tuple((v[k].dtype, tuple(v[k].shape), v[k].numpy().tobytes()) for v in outputs.values())
            assert seen.setdefault(index, mine) == mine  # a padded repeat: the same tensors
    return seen


def expected(source: dict, index: int, seed: int, epoch: int) -> tuple:
    t = load(SPEC)
    arrays = apply(t, t.prepare({"bin": source[(index, "bin")], "cls": source[(index, "cls")]}), seed, epoch, index)
    return tuple((torch.from_numpy(a).dtype, a.shape, a.tobytes()) for a in arrays.values())


def both(client: Client, **options) -> dict[str, dict]:
    """The dataset options of each way: the service runs the transform it names, or the workers run
    the one its listed spec loads."""
    spec = next(t["spec"] for t in client.transforms() if t["name"] == "digest")
    return {"service": dict(transform="digest", **options), "client": dict(transform=load(spec), **options)}


def test_the_client_asks_the_service_and_gets_the_transforms_outputs(served):
    client, source = served
    indices = [5, 0, 33, 5, 17]
    batch = client.get_batch_tensors("train", indices, transform="digest", seed=7, epoch=3)
    assert outputs_by_index([batch]) == {i: expected(source, i, 7, 3) for i in indices}
    assert batch.outputs["noise"].shape == (5, 4) and batch.outputs["label"].dtype == torch.int64
    other = client.get_batch_tensors("train", indices, transform="digest", seed=7, epoch=4)
    assert outputs_by_index([other]) == {i: expected(source, i, 7, 4) for i in indices} != outputs_by_index([batch])


def test_map_style_through_dataloader_workers_is_byte_identical_either_way(served):
    client, source = served
    runs = {}
    for way, options in both(client, seed=11).items():
        ds = ShardfeedDataset(client, "train", **options)
        sampler = ShardfeedSampler(ds, seed=11)
        loader = DataLoader(ds, batch_size=BATCH, sampler=sampler, num_workers=2)
        runs[way] = []
        for epoch in (0, 1):
            sampler.set_epoch(epoch)
            batches = list(loader)
            assert all(batch.shared for batch in batches)  # from the workers in shared memory, either way
            runs[way].append(outputs_by_index(batches))
    assert runs["service"] == runs["client"]
    first, second = runs["service"]
    assert sorted(first) == sorted(second) == list(range(SAMPLES))
    assert first == {i: expected(source, i, 11, 0) for i in range(SAMPLES)}
    assert all(first[i] != second[i] for i in range(SAMPLES))  # another epoch, other noise


def test_a_transform_declaring_fields_the_dataset_lacks_reads_those_it_has_either_way(served, caplog):
    client, source = served
    for transform in ("either", load(EITHER)):
        ds = ShardfeedDataset(client, "train", transform=transform)
        assert ds.source.fields == ["bin", "cls"]  # what the plan and each batch ask for
        sampler = ShardfeedSampler(ds, seed=3)
        got = outputs_by_index(list(DataLoader(ds, batch_size=BATCH, sampler=sampler, num_workers=2)))
        assert got == {i: expected(source, i, 3, 0) for i in range(SAMPLES)}
    assert "plan not registered" not in caplog.text


def test_plain_indices_take_the_datasets_seed_and_epoch(served):
    client, source = served
    for options in both(client, seed=2).values():
        ds = ShardfeedDataset(client, "train", **options)
        ds.set_epoch(5)
        got = outputs_by_index(list(DataLoader(ds, batch_size=BATCH, num_workers=2)))
        assert got == {i: expected(source, i, 2, 5) for i in range(SAMPLES)}
        assert outputs_by_index([ds.__getitems__([Drawn(3, 9, 1), Drawn(4, 9, 1)])[0]]) == \
               {i: expected(source, i, 9, 1) for i in (3, 4)}
        with pytest.raises(ValueError, match="several"):
            ds.__getitems__([Drawn(3, 9, 1), Drawn(4, 9, 2)])


def iterable(client: Client, options: dict, world_size: int = 1, rank: int = 0) -> ShardfeedIterableDataset:
    return ShardfeedIterableDataset(client, "train", batch_size=BATCH, shuffle=True, rank=rank,
                                    world_size=world_size, **options)


def test_iterable_resumed_at_another_world_size_gives_the_uninterrupted_runs_tensors(served):
    client, source = served
    uninterrupted = {}
    for way, options in both(client, seed=4).items():
        ds = iterable(client, options)
        ds.set_epoch(1)
        uninterrupted[way] = outputs_by_index(list(ShardfeedLoader(ds, num_workers=2)))
    assert uninterrupted["service"] == uninterrupted["client"] == {i: expected(source, i, 4, 1) for i in range(SAMPLES)}

    for way, options in both(client, seed=4).items():
        ds = iterable(client, options)
        ds.set_epoch(1)
        loader = ShardfeedLoader(ds, num_workers=2)
        before = []
        for batch in loader:
            before.append(batch)
            if len(before) == 2:
                state = loader.state_dict()
                break
        after = []
        for rank in range(2):  # resumed on two ranks
            resumed = iterable(client, options, world_size=2, rank=rank)
            resumed.load_state_dict(state)
            after += list(ShardfeedLoader(resumed, num_workers=2))
        seen = outputs_by_index(before + after)
        assert seen == uninterrupted["service"], way


def test_a_transform_refuses_what_does_not_apply(served):
    client, _ = served
    with pytest.raises(ValueError, match="no transform 'nope' .*digest"):
        ShardfeedDataset(client, "train", transform="nope")
    with pytest.raises(TypeError, match="output='arrow' does not apply"):
        ShardfeedDataset(client, "train", transform="digest", output="arrow")
    with pytest.raises(TypeError, match="decode does not apply"):
        ShardfeedIterableDataset(client, "train", batch_size=4, transform=load(SPEC), decode=True)
    with pytest.raises(TypeError, match="fields do not apply"):
        ShardfeedDataset(client, "train", transform="digest", fields=["bin"])
    ds = ShardfeedDataset(client, "train", transform=lambda s: len(s["bin"]))  # any other callable: per sample
    assert ds[3] == len(client.get_field("train", 3, "bin"))
