"""Tensor batches (client/tensors.py): byte-exact against the bytes output, through real
DataLoader workers, in one buffer read straight from the socket. The transport's odd
answers (chunked in odd pieces, cut, garbled, stalled) are test_transport.py's, which
runs every one of them on this output too."""

from __future__ import annotations

import asyncio
import errno
import gc
import glob
import os
import pickle
import subprocess
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
import tracemalloc

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from shardfeed.client import AsyncClient, Client, ShardfeedError
from shardfeed.client import shm
from shardfeed.client.answers import Regions
from shardfeed.client.layout import Columns
from shardfeed.client.tensors import Batch, allocator
from shardfeed.client.torch import ShardfeedDataset, ShardfeedIterableDataset, ShardfeedLoader
from shardfeed.process import start_service
from shardfeed.retry import Backoff

from common.datasets import odd_tar_dataset
from common.synthetic import seed_synthetic
from common.workers import routed_client

SAMPLES = 60
ONE_TRY = Backoff(attempts=1)


def as_bytes(batch: Batch) -> list[dict]:
    """The batch's samples with ``bytes`` for views, as the bytes output gives them."""
    return [{k: bytes(v.numpy()) if torch.is_tensor(v) else v for k, v in s.items()} for s in batch]


@pytest.fixture(scope="module")
def odd(tmp_path_factory):
    root = tmp_path_factory.mktemp("tensors")
    url, _ = odd_tar_dataset(root / "data", SAMPLES)
    with start_service({"train": url}, cache_dir=root / "cache", args=["--block-size", "64KiB"]) as svc, \
            Client(svc.url, backoff=ONE_TRY) as client:
        yield client


@pytest.mark.parametrize("fields", [None, ["seg.png", "bin"], ["cls"]])
def test_every_field_is_byte_exact_against_the_bytes_output_cold_and_warm(odd, fields):
    # Long PAX and GNU names, empty members, a field some samples lack (a missing sample with
    # continue_on_error), repeats; the first round cold (streamed), then warm (a known length).
    rng = np.random.default_rng(len(fields or ()))
    for _ in range(2):
        indices = rng.integers(0, SAMPLES, 40).tolist() + [5, 5, 5]
        batch = odd.get_batch_tensors("train", indices, fields, continue_on_error=True)
        want = odd.get_batch("train", indices, fields, continue_on_error=True)
        assert as_bytes(batch) == want
        assert batch.indices.tolist() == indices
        assert batch.missing.tolist() == [s.get("__missing__", False) for s in want]
        assert batch.keys == [s["__key__"] for s in want]
        for name in batch.fields:
            column = batch[name]
            assert [None if v is None else bytes(v.numpy()) for v in column] == [s.get(name) for s in want]
            assert (column.lengths == -1).tolist() == [name not in s for s in want]
    assert odd.get_batch_tensors("train", []).buffer.numel() == 0


def test_an_unserved_field_fails_as_the_bytes_output_does(odd):
    with pytest.raises(ShardfeedError, match="404") as tensors:
        odd.get_batch_tensors("train", [1, 2], ["seg.png"])
    with pytest.raises(ShardfeedError, match="404") as samples:
        odd.get_batch("train", [1, 2], ["seg.png"])
    assert str(tensors.value) == str(samples.value)


def test_views_keep_the_buffer_alive_and_fixed_size_fields_stack_as_views(odd):
    indices = [4, 8, 12, 16, 24, 28, 32, 36, 44, 48]  # with a seg.png (300 bytes) and a short name: evenly spaced
    batch = odd.get_batch_tensors("train", indices, ["seg.png"])
    want = [s["seg.png"] for s in odd.get_batch("train", indices, ["seg.png"])]
    view = batch["seg.png"][3]
    rows = batch["seg.png"].stacked()
    assert rows.shape == (10, 300) and [bytes(r.numpy()) for r in rows] == want
    base = batch.buffer.untyped_storage().data_ptr()
    assert rows.untyped_storage().data_ptr() == base  # a view: no copy of the samples
    words = batch["seg.png"].stacked(torch.int32)
    assert words.shape == (10, 75) and bytes(words[2].numpy()) == want[2]
    assert bytes(batch["seg.png"].view(torch.int16)[1].numpy()) == want[1]
    del batch, rows, words
    gc.collect()
    assert bytes(view.numpy()) == want[3]  # the view holds the buffer
    mixed = odd.get_batch_tensors("train", [0, 1, 2])
    with pytest.raises(ValueError, match="not one size"):
        mixed["bin"].stacked()
    with pytest.raises(KeyError, match="no field 'jpg' in this batch"):
        mixed["jpg"]


def test_unevenly_spaced_samples_stack_as_a_copy(odd):
    batch = odd.get_batch_tensors("train", [0, 8, 1, 4], ["cls"])  # other samples' members in between
    rows = batch["cls"].stacked()
    assert [bytes(r.numpy()) for r in rows] == [s["cls"] for s in odd.get_batch("train", [0, 8, 1, 4], ["cls"])]


def test_pooled_buffers_are_reused_once_every_holder_let_go(odd):
    first = odd.get_batch_tensors("train", [1, 2, 3], shared=True)
    path = first._lease.segment.path
    second = odd.get_batch_tensors("train", [1, 2, 3], shared=True)
    assert second._lease.segment.path != path  # the first is still held
    view = first["bin"][0]
    del first
    assert odd.get_batch_tensors("train", [4], shared=True)._lease.segment.path != path  # its view holds it
    del view
    gc.collect()
    third = odd.get_batch_tensors("train", [1, 2, 3], shared=True)
    assert third._lease.segment.path == path
    sent = ForkingPickler.dumps(third)  # as a DataLoader worker sends it: the segment's name
    assert len(sent) < 2000
    assert as_bytes(pickle.loads(pickle.dumps(third))) == as_bytes(third)  # sent again: as bytes
    del third
    assert odd.get_batch_tensors("train", [5], shared=True)._lease.segment.path != path  # the receiver's now
    received = pickle.loads(sent)
    assert received.shared and not os.path.exists(path)  # mapped by the receiver, then unlinked
    assert as_bytes(received) == odd.get_batch("train", [1, 2, 3])
    del received
    assert odd.get_batch_tensors("train", [1, 2, 3], shared=True)._lease.segment.path == path


def test_segments_of_a_killed_process_are_swept_by_the_next_pool(tmp_path):
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = os.path.join(shm.DIRECTORY, f"{shm.PREFIX}{dead.pid}-0")
    Path(stale).write_bytes(bytes(shm.HEADER + 16))
    shm.Pool()
    assert not os.path.exists(stale)


def test_a_full_dev_shm_falls_back_to_a_plain_shared_tensor(monkeypatch):
    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    before = set(glob.glob(os.path.join(shm.DIRECTORY, shm.PREFIX + "*")))
    assert shm.Pool().lease(40 << 20) is None  # the pool gives up: no segment could be made
    tensor, lease = shm.lease(40 << 20)
    assert lease is None and tensor.is_shared() and tensor.numel() == 40 << 20
    assert set(glob.glob(os.path.join(shm.DIRECTORY, shm.PREFIX + "*"))) <= before  # nothing left half made


def test_an_answer_longer_than_announced_moves_to_a_grown_buffer_once():
    regions = Regions([4, 6], allocator(shared=False))
    regions.regions[0].write(b"0123456789")  # longer than its stretch
    regions.regions[1].write(b"abc")
    buffer, _, starts = regions.joined()
    assert starts.tolist() == [0, 64]  # each answer's stretch starts 64-byte aligned
    assert bytes(buffer[:10]) == b"0123456789" and bytes(buffer[64:67]) == b"abc"
    regions = Regions([4, 6], allocator(shared=True))
    regions.regions[1].write(b"abc")
    buffer, (tensor, lease), starts = regions.joined()
    assert buffer is regions.buffer and starts.tolist() == [0, 64]
    assert Batch.of(tensor, Columns.of_samples([]), lease).shared


def test_no_copy_of_the_samples_is_made_after_the_socket(tmp_path):
    # tracemalloc sees every Python allocation (bytes, bytearray, NumPy), not torch's buffer:
    # the bytes output allocates the batch's size at least (a bytes per member); the tensor
    # output allocates the buffer and per-member bookkeeping (names, offsets: about 70 KB at
    # its peak for these 192 members), never as much as one 100 KB sample at once.
    url = seed_synthetic(tmp_path / "train", samples=64, sizes=(100_000, 100_000))
    with start_service({"train": url}, cache_dir=tmp_path / "cache") as svc, Client(svc.url) as client:
        indices = list(range(64))
        client.get_batch_tensors("train", [63])  # once-per-process costs first: the routing table, imports
        for _ in range(2):  # cold then warm (streamed, then with a Content-Length)
            tracemalloc.start()
            batch = client.get_batch_tensors("train", indices)
            _, tensors_peak = tracemalloc.get_traced_memory()
            tracemalloc.stop()
            tracemalloc.start()
            samples = client.get_batch("train", indices)
            _, bytes_peak = tracemalloc.get_traced_memory()
            tracemalloc.stop()
            assert as_bytes(batch) == samples
            assert bytes_peak > 64 * 100_000
            assert tensors_peak < 100_000, (tensors_peak, bytes_peak)


def segments_of_exited_processes() -> list[str]:
    """Pool segments in /dev/shm whose owner is gone (other tests' live ones may be there)."""
    left = []
    for path in glob.glob(os.path.join(shm.DIRECTORY, shm.PREFIX + "*")):
        try:
            os.kill(int(path.rsplit("/", 1)[1][len(shm.PREFIX):].split("-")[0]), 0)
        except ProcessLookupError:
            left.append(path)
    return left


def test_map_style_batches_come_through_dataloader_workers_in_shared_memory(odd):
    ds = ShardfeedDataset(odd, "train", output="tensors", fields=["bin", "cls"])
    loader = DataLoader(ds, batch_size=4, num_workers=2, pin_memory=True, shuffle=True,
                        generator=torch.Generator().manual_seed(0))
    batches = list(loader)  # all held at once: no worker may reuse a buffer the loop still holds
    views = [b["bin"][0] for b in batches[:3]]
    for batch in batches:
        assert isinstance(batch, Batch)
        assert batch.shared or batch.buffer.is_pinned()  # passed as shared memory, not pickled
        assert as_bytes(batch) == odd.get_batch("train", batch.indices.tolist(), ["bin", "cls"])
    assert sorted(i for b in batches for i in b.indices.tolist()) == list(range(SAMPLES))
    firsts = [b.indices[0].item() for b in batches[:3]]
    del batches, batch
    for _ in range(2):  # more epochs reuse the released buffers; views of the first stay whole
        assert sum(len(b) for b in loader) == SAMPLES
    assert [bytes(v.numpy()) for v in views] == [s["bin"] for s in odd.get_batch("train", firsts)]
    assert segments_of_exited_processes() == []
    sample = ds[7]  # one sample: a dict of views
    assert bytes(sample["cls"].numpy()) == odd.get_batch("train", [7])[0]["cls"]


def test_iterable_batches_come_through_the_loader_in_the_order_of_the_bytes_output(odd):
    ds = ShardfeedIterableDataset(odd, "train", batch_size=16, output="tensors", shuffle=True, seed=3)
    loader = ShardfeedLoader(ds, num_workers=2, pin_memory=True)
    batches = list(loader)
    assert all(isinstance(b, Batch) for b in batches)
    order = [i for b in batches for i in b.indices.tolist()]
    samples_ds = ShardfeedIterableDataset(odd, "train", batch_size=16, shuffle=True, seed=3, collate_fn=None)
    assert order == [s["__index__"] for b in ShardfeedLoader(samples_ds, num_workers=2) for s in b]
    for b in batches:
        assert as_bytes(b) == odd.get_batch("train", b.indices.tolist())


def test_tensor_output_refuses_what_applies_to_sample_dicts(odd):
    with pytest.raises(ValueError, match="output must be one of 'samples', 'tensors'"):
        ShardfeedDataset(odd, "train", output="arrays")
    with pytest.raises(TypeError, match="decode and transform apply to sample dicts"):
        ShardfeedDataset(odd, "train", output="tensors", decode=True)
    with pytest.raises(TypeError, match="collate_fn applies to lists of sample dicts"):
        ShardfeedIterableDataset(odd, "train", batch_size=4, output="tensors", collate_fn=list)


@pytest.mark.slow
def test_a_batch_routed_in_parts_lies_in_one_buffer(tmp_path):
    with routed_client(tmp_path, backoff=ONE_TRY) as client:
        for start in range(4):
            indices = list(range(start, 1000, 7))[::-1]
            batch = client.get_batch_tensors("train", indices, shared=True)
            assert as_bytes(batch) == client.get_batch("train", indices)
            assert batch.shared
            ends = batch["bin"].offsets + batch["bin"].lengths
            assert int(ends.max()) <= batch.buffer.numel()  # every view within the one buffer
        batch, samples = asyncio.run(routed_async(client.urls, indices))
        assert as_bytes(batch) == samples == client.get_batch("train", indices)


async def routed_async(urls: list[str], indices: list[int]) -> tuple[Batch, list[dict]]:
    """The AsyncClient's batch as tensors and as samples, its parts read at once as the
    blocking client's are."""
    async with AsyncClient(urls, backoff=ONE_TRY) as client:
        batch = await client.get_batch_tensors("train", indices)
        assert len({part.owner for part in client.router.split("train", indices)}) == 2
        return batch, await client.get_batch("train", indices)
