"""Members over 2-5 blocks (17-70 KB samples in 16 KiB blocks on moto S3), sent from their pieces
(``planner.Parts``) through every way out: the tar batch, the Arrow batch and per-sample GETs,
each read cold (from the store) and again warm from the disk tier (``--memory-cache 0``), by one
worker and by two (a sibling's shards over its socket cold, from its block files warm). Every byte
and every announced length is checked against the shards as ``tarfile`` wrote them."""

from __future__ import annotations

import random
import time

import httpx
import pyarrow as pa
import pytest

from shardfeed.process import start_service

from common.datasets import bucket_dataset
from common.reliability import expected_members
from common.service import metrics, tar_members
from common.wait import wait_until
from common.workers import worker_urls

SAMPLES = 60
BLOCK = 16 * 1024
FIELDS = ["bin", "cls", "json"]


@pytest.fixture(scope="module")
def dataset(moto):
    return bucket_dataset(moto, "multiblock", samples=SAMPLES, per_shard=20, sizes=(17_000, 70_000))


@pytest.fixture(params=[1, pytest.param(2, marks=pytest.mark.slow)], ids=["one-worker", "two-workers"])
def service(request, dataset, moto, tmp_path):
    with start_service({"train": dataset[0]}, cache_dir=tmp_path / "cache", env=moto.env(), workers=request.param,
                       args=["--block-size", "16KiB", "--memory-cache", "0"]) as svc:
        svc.urls = worker_urls(svc.url) if request.param > 1 else [svc.url]
        yield svc


def total(service, name: str) -> float:
    return sum(metrics(url).get(name, 0.0) for url in service.urls)


def cold_then_warm(service, read) -> None:
    """``read()`` (it checks what it gets) cold, then once the blocks are on disk warm: the warm
    read from the disk tier alone; with two workers, some members of the sibling's shards."""
    read()
    if len(service.urls) > 1:  # members of the sibling's shards crossed its socket (``/v1/internal/read``)
        assert total(service, "shardfeed_peer_requests_total") > 0
        assert total(service, "shardfeed_peer_fallbacks_total") == 0, "a sibling's answer failed"
    blocks = [-1.0]

    def written() -> bool:  # the blocks fetched are written behind the answers: until their count holds
        now = total(service, "shardfeed_cache_blocks")
        settled, blocks[0] = now == blocks[0], now
        time.sleep(0.2)
        return settled and total(service, "shardfeed_inflight_store_requests") == 0

    wait_until(written, 20, "the fetched blocks on disk")
    stored, hits = total(service, "shardfeed_store_requests_total"), total(service, "shardfeed_cache_hits_total")
    read()
    assert total(service, "shardfeed_store_requests_total") == stored, "the warm read went to the store"
    assert total(service, "shardfeed_cache_hits_total") > hits
    if len(service.urls) > 1:  # the sibling's blocks from its files
        assert total(service, "shardfeed_sibling_blocks_total") > 0


def members_over_blocks(dataset) -> None:
    """The dataset is as meant: every ``bin`` member spans 2-5 blocks."""
    sizes = [len(data) for (_, field), data in dataset[1].items() if field == "bin"]
    assert min(sizes) > BLOCK and max(sizes) > 4 * BLOCK


def test_the_tar_batch_frames_members_over_blocks_byte_exact(service, dataset):
    members_over_blocks(dataset)
    source = dataset[1]
    indices = list(range(SAMPLES))
    random.Random(1).shuffle(indices)

    def read():
        resp = httpx.post(f"{service.url}/v1/batch", json={"dataset": "train", "indices": indices}, timeout=60)
        assert resp.status_code == 200, resp.text
        announced = resp.headers.get("content-length") or resp.headers["x-shardfeed-length"]
        assert len(resp.content) == int(announced)
        assert tar_members(resp.content) == expected_members(source, "train", indices)

    cold_then_warm(service, read)


def test_the_arrow_batch_frames_members_over_blocks_byte_exact(service, dataset):
    source = dataset[1]
    indices = list(range(SAMPLES))
    random.Random(2).shuffle(indices)

    def read():
        resp = httpx.post(f"{service.url}/v1/batch", json={"dataset": "train", "indices": indices, "format": "arrow"},
                          timeout=60)
        assert resp.status_code == 200, resp.text
        announced = resp.headers.get("content-length") or resp.headers["x-shardfeed-length"]
        assert len(resp.content) == int(announced)
        table = pa.ipc.open_stream(pa.py_buffer(resp.content)).read_all()
        table.validate(full=True)
        assert table.column("__index__").to_pylist() == indices
        for field in FIELDS:
            assert table.column(field).to_pylist() == [source.get((i, field)) for i in indices], field

    cold_then_warm(service, read)


def test_per_sample_gets_send_members_over_blocks_byte_exact(service, dataset):
    source = dataset[1]

    def read():
        with httpx.Client(base_url=f"{service.url}/v1/datasets/train/samples", timeout=30) as client:
            for i in range(SAMPLES):
                member = client.get(f"/{i}/bin")
                assert member.status_code == 200, member.text
                assert int(member.headers["content-length"]) == len(source[(i, "bin")])
                assert member.content == source[(i, "bin")]
            for i in range(SAMPLES):  # whole samples (tars), fresh blocks first: the other shard's
                sample = client.get(f"/{SAMPLES - 1 - i}")
                assert sample.status_code == 200, sample.text
                assert int(sample.headers["content-length"]) == len(sample.content)
                assert tar_members(sample.content) == expected_members(source, "train", [SAMPLES - 1 - i])

    cold_then_warm(service, read)
