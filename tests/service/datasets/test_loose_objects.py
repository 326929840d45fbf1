"""Loose-object datasets (layout ``objects``): one S3 object per member, served through the
native API (``Client``, ``ShardfeedDataset``) and GetBatch, over moto and the real service."""

from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest
from aistore.sdk import Client as AisClient
from torch.utils.data import DataLoader

from shardfeed.client import Client
from shardfeed.client.torch import ShardfeedDataset
from shardfeed.process import start_service

pytestmark = pytest.mark.slow  # indexes and serves loose objects on S3 through several services

BUCKET = "loose-data"
SAMPLES = 40


@pytest.fixture(scope="module")
def loose(moto):
    """``img/NNNN.jpg`` + ``img/NNNN.cls`` (+ ``.json`` on some) under two prefixes; source bytes."""
    rng = random.Random(5)
    moto.create_bucket(BUCKET)
    s3 = moto.client()
    source = {}
    for i in range(SAMPLES):
        fields = {"jpg": rng.randbytes(rng.randint(0, 40_000)), "cls": b"%d" % (i % 10)}
        if i % 5 == 0:
            fields["json"] = b'{"i": %d}' % i
        for field, data in fields.items():
            source[(i, field)] = data
            for prefix in ("indexed", "built"):
                s3.put_object(Bucket=BUCKET, Key=f"{prefix}/img/{i:04d}.{field}", Body=data)
    s3.put_object(Bucket=BUCKET, Key="indexed/README", Body=b"no extension: not a sample")
    return source


def expected(source, i, fields=("cls", "jpg", "json")):
    return {f: source[(i, f)] for f in fields if (i, f) in source}


@pytest.fixture(scope="module")
def service(loose, moto, tmp_path_factory):
    out = subprocess.run([sys.executable, "-m", "shardfeed", "index", "--objects", "-q", f"s3://{BUCKET}/indexed"],
                         env={**os.environ, **moto.env()}, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert f"indexed {SAMPLES} samples" in out.stdout
    cache = tmp_path_factory.mktemp("loose") / "cache"
    with start_service({"indexed": f"s3://{BUCKET}/indexed/", "built": f"s3://{BUCKET}/built"}, cache_dir=cache,
                       env=moto.env(), args=["--index-objects", "--bucket", BUCKET]) as svc:
        yield svc


@pytest.mark.parametrize("name", ["indexed", "built"])
def test_samples_are_objects_sharing_a_key_through_the_client(service, loose, name):
    with Client(service.url) as client:
        info = client.info(name)
        assert (info["samples"], info["fields"]) == (SAMPLES, ["cls", "jpg", "json"])
        indices = [7, 0, 39, 7, 15]
        for _ in range(2):  # cold, then from the block cache
            batch = client.get_batch(name, indices)
            assert [s["__key__"] for s in batch] == [f"img/{i:04d}" for i in indices]
            assert [{k: v for k, v in s.items() if not k.startswith("__")} for s in batch] == \
                [expected(loose, i) for i in indices]
        assert client.get_field(name, 10, "json") == loose[(10, "json")]


def test_the_pytorch_dataset_reads_loose_objects_unchanged(service, loose):
    ds = ShardfeedDataset(service.url, "indexed", fields=["jpg", "cls"])
    loader = DataLoader(ds, batch_size=8, shuffle=False, collate_fn=list)
    seen = [s for batch in loader for s in batch]
    assert len(seen) == SAMPLES
    assert all(s["jpg"] == loose[(s["__index__"], "jpg")] and s["cls"] == loose[(s["__index__"], "cls")]
               for s in seen)


def test_getbatch_reads_objects_of_a_loose_dataset_by_name(service, loose):
    client = AisClient(service.url)
    keys = [f"built/img/{i:04d}.jpg" for i in (3, 1, 2)]
    got = [data for _, data in client.batch(keys, bucket=client.bucket(BUCKET, provider="s3")).get()]
    assert got == [loose[(i, "jpg")] for i in (3, 1, 2)]


def test_a_dataset_without_index_is_refused_without_index_objects(loose, moto, tmp_path):
    with pytest.raises(RuntimeError, match="shardfeed index"):
        start_service({"built": f"s3://{BUCKET}/built"}, cache_dir=tmp_path / "cache", env=moto.env(), timeout=30)


def test_getbatch_shares_the_cached_blocks_of_the_dataset_that_indexes_its_entries(service, loose):
    from common.service import metrics

    with Client(service.url) as client:
        client.get_batch("built", [20, 21, 22], fields=["jpg"])  # cached through the native API
    before = metrics(service.url)["shardfeed_store_requests_total"]
    ais = AisClient(service.url)
    keys = [f"built/img/{i:04d}.jpg" for i in (22, 20, 21)]
    got = [data for _, data in ais.batch(keys, bucket=ais.bucket(BUCKET, provider="s3")).get()]
    assert got == [loose[(i, "jpg")] for i in (22, 20, 21)]
    assert metrics(service.url)["shardfeed_store_requests_total"] == before  # not one store read
