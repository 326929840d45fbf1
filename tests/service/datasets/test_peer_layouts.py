"""Datasets in a peer's format served in place (layouts ``mds`` and ``litdata``): written by the
peers' own writers with fields of every common encoding, put on SeaweedFS, served by the real
service over ``serve --dataset`` and the one-line form, every field compared with the bytes the
peer's own reader hands its decoders (and with the values they return); LitData's items of plain
values, which it writes in Arrow footers, compared with what its serializers write of the values
its reader returns."""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest
import requests
from aistore.sdk import Client as AisClient

from shardfeed import node
from shardfeed.client import Client
from shardfeed.client.torch import ShardfeedDataset
from shardfeed.process import start_service

from common.peerdatasets import PeerCannotDecode, PeerDataset, litdata_dataset, mds_dataset, plain_item, upload
from common.s3 import point_aws_at

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("peer_layouts")]

BUCKET = "peer-layouts"
DATASETS = {
    "mds": lambda root: mds_dataset(root),
    "mds-zstd": lambda root: mds_dataset(root, compression="zstd"),
    "mds-gz": lambda root: mds_dataset(root, compression="gz:9"),
    "litdata": lambda root: litdata_dataset(root),
    "litdata-framed": lambda root: litdata_dataset(root, layout="framed"),  # LitData's zstd default
    "litdata-whole": lambda root: litdata_dataset(root, layout="whole"),
    # Arrow footers: chunks of 415, 289, 276 and 20 items, record batches of 256 rows.
    "litdata-arrow": lambda root: litdata_dataset(root, samples=1000, chunk_bytes=3 << 13, item=plain_item),
}
"""Each peer's layouts: uncompressed, and compressed as its writer compresses; LitData's Arrow
footers (items of plain values, a field now and then null: the sample lacks it)."""


@pytest.fixture(scope="module")
def written(seaweedfs, tmp_path_factory) -> dict[str, PeerDataset]:
    seaweedfs.create_bucket(BUCKET)
    written = {name: write(tmp_path_factory.mktemp(name)) for name, write in DATASETS.items()}
    for name, dataset in written.items():
        upload(seaweedfs, dataset.root, BUCKET, name)
    return written


@pytest.fixture(scope="module")
def service(seaweedfs, written, tmp_path_factory):
    cache = tmp_path_factory.mktemp("peer-service") / "cache"
    with start_service({name: f"s3://{BUCKET}/{name}" for name in written}, cache_dir=cache,
                       env=seaweedfs.env(), args=["--bucket", BUCKET, "--workers", "2"]) as svc:
        yield svc


def raw_fields(sample: dict) -> dict[str, bytes]:
    return {f: bytes(v) for f, v in sample.items() if not f.startswith("__")}


def peer_fields(peer: PeerDataset, i: int) -> dict[str, bytes]:
    """Sample ``i``'s fields as the peer reads them (those it has)."""
    return {f: peer.raw[(i, f)] for f in peer.fields if (i, f) in peer.raw}


@pytest.mark.parametrize("name", DATASETS)
def test_every_field_is_the_bytes_the_peers_reader_decodes_cold_and_warm_in_both_formats(service, written, name):
    peer = written[name]
    order = np.random.default_rng(1).permutation(peer.samples).tolist()
    with Client(service.url) as client:
        info = client.info(name)
        assert (info["layout"], info["samples"]) == (name.partition("-")[0], peer.samples)
        assert sorted(info["fields"]) == sorted(peer.fields) and info["encodings"] == peer.encodings
        for _ in range(2):  # cold, then from the cache
            for lo in range(0, peer.samples, 10):
                batch = order[lo:lo + 10]
                assert [raw_fields(s) for s in client.get_batch(name, batch)] == [peer_fields(peer, i) for i in batch]
                table = client.get_batch_arrow(name, batch)
                for field in peer.fields:
                    assert table.column(field).to_pylist() == [peer.raw.get((i, field)) for i in batch]


@pytest.mark.parametrize("name", DATASETS)
def test_a_field_alone_and_by_get(service, written, name):
    peer = written[name]
    field = peer.fields[-1]
    with Client(service.url) as client:
        got = client.get_batch(name, [7, 2, 7], fields=[field])
    assert [bytes(s[field]) for s in got] == [peer.raw[(i, field)] for i in (7, 2, 7)]
    answer = requests.get(f"{service.url}/v1/datasets/{name}/samples/3/{field}", timeout=30)
    assert answer.status_code == 200 and answer.content == peer.raw[(3, field)]


def shards_of(peer: PeerDataset) -> list[tuple[str, int]]:
    """Each shard's (or chunk's) file and samples, in the peer's order."""
    index = peer.index
    if "shards" in index:
        return [(shard["raw_data"]["basename"], shard["samples"]) for shard in index["shards"]]
    return [(chunk["filename"], chunk["chunk_size"]) for chunk in index["chunks"]]


@pytest.mark.parametrize("name", ["mds", "litdata-arrow"])
def test_getbatch_reads_a_field_of_a_sample_by_its_shard_and_key(service, written, name):
    peer = written[name]
    shards = shards_of(peer)
    number = next(n for n, (_, samples) in enumerate(shards) if n and samples > 2)
    sample = sum(samples for _, samples in shards[:number]) + 2
    fields = list(peer_fields(peer, sample))[:3]
    with Client(service.url) as client:
        key = client.get_batch(name, [sample])[0]["__key__"]
    ais = AisClient(service.url)
    batch = ais.batch(bucket=ais.bucket(BUCKET, provider="s3"))
    for field in fields:
        batch.add(f"{name}/{shards[number][0]}", archpath=f"{key}.{field}")
    assert [data for _, data in batch.get()] == [peer.raw[(sample, f)] for f in fields]


def same(value, expected) -> bool:
    if isinstance(expected, memoryview):  # LitData's bytes leaves: a view of its chunk; ours: bytes
        return bytes(value) == bytes(expected)
    if isinstance(expected, np.ndarray) or hasattr(expected, "numpy"):
        return np.array_equal(np.asarray(value), np.asarray(expected))
    if hasattr(expected, "tobytes") and hasattr(expected, "mode"):  # a PIL image
        return value.mode == expected.mode and value.size == expected.size and value.tobytes() == expected.tobytes()
    return value == expected and type(value) is type(expected)


@pytest.mark.parametrize("name", ["mds-zstd", "litdata-framed", "litdata-arrow"])
def test_the_one_line_form_reads_a_peers_dataset_decoded_as_the_peer_decodes_it(
        seaweedfs, written, name, tmp_path, monkeypatch):
    point_aws_at(seaweedfs, monkeypatch)
    monkeypatch.setenv("SHARDFEED_RUN_DIR", str(tmp_path / "run"))
    monkeypatch.setenv("SHARDFEED_SERVE_ARGS", f"--cache-dir {tmp_path / 'cache'} --workers 1")
    peer = written[name]
    try:
        ds = ShardfeedDataset(f"s3://{BUCKET}/{name}", decode=True)
        assert len(ds) == peer.samples
        for i in (0, 3, 5, peer.samples - 1):
            sample = ds[i]
            assert {f for f in sample if not f.startswith("__")} == {f for f in peer.fields if (i, f) in peer.raw}
            for field in sample.keys() & set(peer.fields):
                expected = peer.decoded[(i, field)]
                if not isinstance(expected, PeerCannotDecode):
                    assert same(sample[field], expected), (i, field, sample[field], expected)
        raw = ShardfeedDataset(f"s3://{BUCKET}/{name}")
        assert raw_fields(raw[4]) == peer_fields(peer, 4)
    finally:
        for record in node.services():
            if not node.stop_service(record, timeout=20):
                os.killpg(record.pid, signal.SIGKILL)
