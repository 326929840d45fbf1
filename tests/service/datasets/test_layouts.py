"""What every layout serves alike: the same samples written as tar shards, loose objects, MDS
shards (Streaming's own writer) and LitData chunks (LitData's own writer), on moto, through the
real service: byte for byte in both formats, cold and warm; fields by name; 404s; and never a
stale byte once the store's bytes change."""

from __future__ import annotations

import asyncio
import random
import tarfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import requests

from shardfeed.benchmarks.loaders import import_streaming
from shardfeed.client import Client
from shardfeed.process import start_service
from shardfeed.service.datasets.shards import write_shards
from shardfeed.service.stores import open_store

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("layouts")]

BUCKET = "layouts"
LAYOUTS = ("tar", "objects", "mds", "litdata")
SAMPLES = 90
FIELDS = ("bin", "cls")

Samples = list[dict[str, bytes]]


def make_samples(seed: int) -> Samples:
    """Samples of every size from empty to a few blocks' worth (fixed by index, so that another
    seed makes other bytes of the same sizes: a rewrite that keeps every offset)."""
    rng = random.Random(seed)
    sizes = random.Random(0)
    return [{"bin": rng.randbytes(sizes.choice([0, 1, 700, 9_000, 70_000])), "cls": rng.randbytes(8)}
            for _ in range(SAMPLES)]


def write_tar(local: Path, samples: Samples) -> None:
    asyncio.run(write_shards(open_store(str(local)), [(f"sample{i:06d}", list(s.items())) for i, s in
                                                     enumerate(samples)], shard_size=150_000, progress=False))


def write_objects(local: Path, samples: Samples) -> None:
    for i, sample in enumerate(samples):
        for field, data in sample.items():
            (local / "img").mkdir(parents=True, exist_ok=True)
            (local / "img" / f"{i:06d}.{field}").write_bytes(data)


def write_mds(local: Path, samples: Samples) -> None:
    streaming = import_streaming()
    with streaming.MDSWriter(out=str(local), columns=dict.fromkeys(FIELDS, "bytes"), size_limit=150_000) as out:
        for sample in samples:
            out.write(sample)


def write_litdata(local: Path, samples: Samples) -> None:
    """As uint8 arrays, whose raw bytes are the samples' (LitData writes items of bytes alone as
    an Arrow file instead: ``test_peer_errors.py``)."""
    from litdata.streaming.writer import BinaryWriter

    writer = BinaryWriter(str(local), chunk_size=15)
    for i, sample in enumerate(samples):
        writer[i] = {field: np.frombuffer(data, np.uint8) for field, data in sample.items()}
    writer.done()
    writer.merge()


WRITERS: dict[str, Callable[[Path, Samples], None]] = {
    "tar": write_tar, "objects": write_objects, "mds": write_mds, "litdata": write_litdata}


def put_layout(moto, layout: str, samples: Samples, local: Path) -> None:
    """``samples`` written in ``layout`` under ``local``, then put under the bucket's ``layout/``."""
    WRITERS[layout](local, samples)
    s3 = moto.client()
    for path in sorted(local.rglob("*")):
        if path.is_file():
            s3.put_object(Bucket=BUCKET, Key=f"{layout}/{path.relative_to(local)}", Body=path.read_bytes())


@pytest.fixture(scope="module")
def stored(moto, tmp_path_factory) -> Samples:
    moto.create_bucket(BUCKET)
    samples = make_samples(1)
    for layout in LAYOUTS:
        put_layout(moto, layout, samples, tmp_path_factory.mktemp(layout))
    return samples


def serve(moto, cache: Path):
    return start_service({layout: f"s3://{BUCKET}/{layout}" for layout in LAYOUTS}, cache_dir=cache,
                         env=moto.env(), args=["--index-objects", "--bucket", BUCKET, "--block-size", "64KiB"])


@pytest.fixture(scope="module")
def service(moto, stored, tmp_path_factory):
    with serve(moto, tmp_path_factory.mktemp("layouts") / "cache") as svc:
        yield svc


def fields_of(sample: dict) -> dict[str, bytes]:
    return {f: bytes(v) for f, v in sample.items() if not f.startswith("__")}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_layout_serves_every_sample_byte_for_byte_cold_and_warm_in_both_formats(service, stored, layout):
    order = np.random.default_rng(2).choice(SAMPLES, 2 * SAMPLES).tolist()  # repeats included
    with Client(service.url) as client:
        info = client.info(layout)
        assert (info["layout"], info["samples"], sorted(info["fields"])) == (layout, SAMPLES, sorted(FIELDS))
        for _ in range(2):  # cold, then warm
            for lo in range(0, len(order), 50):
                batch = order[lo:lo + 50]
                assert [fields_of(s) for s in client.get_batch(layout, batch)] == [stored[i] for i in batch]
                table = client.get_batch_arrow(layout, batch)
                assert table.column("__index__").to_pylist() == batch
                for field in FIELDS:
                    assert table.column(field).to_pylist() == [stored[i][field] for i in batch]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_fields_by_name_in_the_order_asked_and_by_get(service, stored, layout):
    with Client(service.url) as client:
        got = client.get_batch(layout, [5, 77, 5], fields=["cls", "bin"])
    assert [list(fields_of(s).items()) for s in got] == [[("cls", stored[i]["cls"]), ("bin", stored[i]["bin"])]
                                                         for i in (5, 77, 5)]
    answer = requests.get(f"{service.url}/v1/datasets/{layout}/samples/77/bin", timeout=30)
    assert answer.status_code == 200 and answer.content == stored[77]["bin"]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("body, status, code", [
    ({"indices": [SAMPLES]}, 404, "sample_out_of_range"),
    ({"indices": [1], "fields": ["nope"]}, 404, "unknown_field"),
    ({"indices": [-1]}, 400, "invalid_index"),
])
def test_requests_beyond_a_layout_are_json_errors(service, layout, body, status, code):
    answer = requests.post(f"{service.url}/v1/batch", json={"dataset": layout, **body}, timeout=30)
    assert answer.status_code == status and answer.json()["error"]["code"] == code
    answer = requests.get(f"{service.url}/v1/datasets/{layout}/samples/{SAMPLES}", timeout=30)
    assert answer.status_code == 404 and answer.json()["error"]["code"] == "sample_out_of_range"


def test_every_layout_rewritten_in_the_store_is_served_at_its_new_bytes_never_the_cached_old(
        moto, stored, tmp_path):
    cache = tmp_path / "cache"
    every = list(range(SAMPLES))
    with serve(moto, cache) as svc, Client(svc.url) as client:
        for layout in LAYOUTS:
            assert [fields_of(s) for s in client.get_batch(layout, every)] == stored
    new = make_samples(2)
    for layout in LAYOUTS:  # the same sizes, other bytes: every offset stays where it was
        put_layout(moto, layout, new, tmp_path / f"new-{layout}")
    with serve(moto, cache) as svc, Client(svc.url) as client:  # a restart on the kept cache
        for layout in LAYOUTS:
            assert [fields_of(s) for s in client.get_batch(layout, every)] == new
    for layout in LAYOUTS:  # and back, under a running service: reopened on the reload route
        put_layout(moto, layout, stored, tmp_path / f"again-{layout}")
    with serve(moto, tmp_path / "cache2") as svc, Client(svc.url) as client:
        for layout in LAYOUTS:
            assert [fields_of(s) for s in client.get_batch(layout, every)] == stored
            put_layout(moto, layout, new, tmp_path / f"last-{layout}")
            requests.post(f"{svc.url}/v1/datasets/{layout}/reload", timeout=60).raise_for_status()
            assert [fields_of(s) for s in client.get_batch(layout, every)] == new
