"""Datasets in a peer's format served in place (layouts ``mds`` and ``litdata``): written by the
peers' own writers, uploaded to SeaweedFS, served by the real service, every byte compared with
what the peer's own reader hands its decoders."""

from __future__ import annotations

import json

import numpy as np
import pytest
import requests
from aistore.sdk import Client as AisClient

from shardfeed.client import Client
from shardfeed.process import start_service

from common.peerdatasets import expected_litdata, expected_mds, upload, write_litdata, write_mds

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("peer_layouts")]


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    root = tmp_path_factory.mktemp("peers")
    return {"mds": (write_mds(root / "mds"), expected_mds(root / "mds")),
            "litdata": (write_litdata(root / "litdata"), expected_litdata(root / "litdata"))}


@pytest.fixture(scope="module")
def bucket(seaweedfs, written):
    name = "peer-layouts"
    seaweedfs.create_bucket(name)
    for layout, (local, _) in written.items():
        upload(seaweedfs, local, name, layout)
    return name


@pytest.fixture(scope="module")
def service(seaweedfs, bucket, tmp_path_factory):
    cache = tmp_path_factory.mktemp("peer-service") / "cache"
    with start_service({"mds": f"s3://{bucket}/mds", "litdata": f"s3://{bucket}/litdata"}, cache_dir=cache,
                       env=seaweedfs.env(), args=["--bucket", bucket]) as svc:
        yield svc


@pytest.mark.parametrize("layout", ["mds", "litdata"])
def test_every_sample_is_the_peers_own_bytes_cold_and_warm_in_both_formats(service, written, layout):
    expected = written[layout][1]
    n = len(expected)
    order = np.random.default_rng(1).permutation(n).tolist()
    with Client(service.url) as client:
        info = client.info(layout)
        assert info["layout"] == layout and info["samples"] == n
        assert sorted(info["fields"]) == sorted(expected[0])
        for _ in range(2):  # cold, then from the cache
            for lo in range(0, n, 64):
                batch = order[lo:lo + 64]
                for i, sample in zip(batch, client.get_batch(layout, batch)):
                    assert {f: bytes(v) for f, v in sample.items() if not f.startswith("__")} == expected[i]
                table = client.get_batch_arrow(layout, batch)
                for field in expected[0]:
                    assert table.column(field).to_pylist() == [expected[i][field] for i in batch]


@pytest.mark.parametrize("layout", ["mds", "litdata"])
def test_a_field_alone_and_a_sample_by_get(service, written, layout):
    expected = written[layout][1]
    field = sorted(expected[0])[-1]
    with Client(service.url) as client:
        got = client.get_batch(layout, [7, 2, 7], fields=[field])
    assert [bytes(s[field]) for s in got] == [expected[i][field] for i in (7, 2, 7)]
    answer = requests.get(f"{service.url}/v1/datasets/{layout}/samples/3/{field}", timeout=30)
    assert answer.status_code == 200 and answer.content == expected[3][field]


def test_getbatch_reads_a_field_of_a_record_by_its_shard_and_key(service, written, bucket):
    expected = written["mds"][1]
    index = json.loads((written["mds"][0] / "index.json").read_text())
    first = next(shard for shard in index["shards"] if shard["samples"])
    base = sum(s["samples"] for s in index["shards"][:index["shards"].index(first)])
    field = sorted(expected[0])[0]
    with Client(service.url) as client:
        key = client.get_batch("mds", [base + 1])[0]["__key__"]
    ais = AisClient(service.url)
    objects = [f"mds/{first['raw_data']['basename']}"] * 1
    batch = ais.batch(bucket=ais.bucket(bucket, provider="s3"))
    batch.add(objects[0], archpath=f"{key}.{field}")
    assert [data for _, data in batch.get()] == [expected[base + 1][field]]
