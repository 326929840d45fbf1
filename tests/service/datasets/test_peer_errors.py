"""A peer's dataset that cannot be what its ``index.json`` says is refused with a 422 naming the
culprit, never served with wrong bytes; a shard replaced in the store is served at its new version."""

from __future__ import annotations

import io
import json
import re
import struct

import numpy as np
import pytest
import requests

from shardfeed.benchmarks.loaders import import_streaming, streaming_dataset
from shardfeed.client import Client
from shardfeed.process import start_service

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("peer_errors")]

BUCKET = "peer-errors"
COLUMNS = {"data": "bytes", "label": "int", "text": "str"}


def mds_files(tmp_path, samples: int = 40, seed: int = 0) -> dict[str, bytes]:
    """The files of an MDS dataset Streaming's own writer writes, by name."""
    streaming = import_streaming()
    rng = np.random.default_rng(seed)
    out = tmp_path / f"mds-{seed}"
    with streaming.MDSWriter(out=str(out), columns=COLUMNS, size_limit=4096) as writer:
        for i in range(samples):
            writer.write({"data": rng.bytes(int(rng.integers(0, 400))), "label": i, "text": "t" * (i % 7)})
    return {path.name: path.read_bytes() for path in out.iterdir()}


@pytest.fixture(scope="module")
def service(moto, tmp_path_factory):
    moto.create_bucket(BUCKET)
    with start_service({}, cache_dir=tmp_path_factory.mktemp("peer-errors") / "cache", env=moto.env(),
                       args=["--bucket", BUCKET]) as svc:
        yield svc


def put(moto, prefix: str, files: dict[str, bytes]) -> str:
    s3 = moto.client()
    for name, data in files.items():
        s3.put_object(Bucket=BUCKET, Key=f"{prefix}/{name}", Body=data)
    return f"s3://{BUCKET}/{prefix}"


def register(service, name: str, url: str) -> requests.Response:
    return requests.post(f"{service.url}/v1/datasets?wait=30", json={"name": name, "url": url}, timeout=60)


def first_shard(files: dict[str, bytes]) -> str:
    return next(s["raw_data"]["basename"] for s in json.loads(files["index.json"])["shards"] if s["samples"])


@pytest.mark.parametrize("case, culprit", [
    ("not json", "index.json"),
    ("version 3", "index.json"),
    ("unknown encoding", "unknown encoding 'bytes_v9'"),
    ("header disagrees", "shard.0"),
    ("shard missing", "which the store lacks"),
])
def test_a_dataset_that_is_not_what_its_index_says_is_refused_with_a_422(service, moto, tmp_path, case, culprit):
    files = mds_files(tmp_path)
    index = json.loads(files["index.json"])
    if case == "not json":
        files["index.json"] = b"{ shards: oops"
    elif case == "version 3":
        index["version"] = 3
    elif case == "unknown encoding":
        index["shards"][0]["column_encodings"][0] = "bytes_v9"
    elif case == "header disagrees":
        name = first_shard(files)
        files[name] = (np.frombuffer(files[name][:4], "<u4") + 1).tobytes() + files[name][4:]
    else:
        del files[first_shard(files)]
    if case in ("version 3", "unknown encoding"):
        files["index.json"] = json.dumps(index).encode()
    slug = case.replace(" ", "-")
    answer = register(service, slug, put(moto, slug, files))
    assert answer.status_code == 422, answer.text
    assert answer.json()["error"]["code"] == "invalid_index"
    assert culprit in answer.json()["error"]["message"]


def test_a_record_whose_header_disagrees_with_its_shard_fails_its_batch_with_a_422(service, moto, tmp_path):
    files = mds_files(tmp_path)
    name = first_shard(files)
    shard = bytearray(files[name])
    offsets = np.frombuffer(bytes(shard[4:12]), "<u4")  # the first record's extent
    shard[int(offsets[0]):int(offsets[0]) + 4] = (10**6).to_bytes(4, "little")  # its first column's size
    files[name] = bytes(shard)
    assert register(service, "torn", put(moto, "torn", files)).status_code == 200
    answer = requests.post(f"{service.url}/v1/batch", json={"dataset": "torn", "indices": [0]}, timeout=30)
    assert answer.status_code == 422
    assert answer.json()["error"]["code"] == "shard_disagrees" and name in answer.json()["error"]["message"]


def test_a_shard_replaced_in_the_store_is_served_at_its_new_version(service, moto, tmp_path):
    old, new = mds_files(tmp_path, seed=1), mds_files(tmp_path, seed=2)
    url = put(moto, "replaced", old)
    assert register(service, "replaced", url).status_code == 200
    with Client(service.url) as client:
        before = client.get_batch("replaced", list(range(40)))
        put(moto, "replaced", new)  # the peer's writer over the same prefix: index.json and shards
        requests.post(f"{service.url}/v1/datasets/replaced/reload", timeout=60).raise_for_status()
        after = client.get_batch("replaced", list(range(40)))
    streaming = import_streaming()
    (tmp_path / "new").mkdir()
    for name, data in new.items():
        (tmp_path / "new" / name).write_bytes(data)
    peer = streaming_dataset(streaming, local=str(tmp_path / "new"), shuffle=False, batch_size=1)
    assert [bytes(s["data"]) for s in after] == [peer[i]["data"] for i in range(40)]
    assert [bytes(s["data"]) for s in before] != [bytes(s["data"]) for s in after]


def litdata_files(tmp_path, name: str, item, **options) -> dict[str, bytes]:
    """The files of 20 items ``item(i)`` that LitData's own writer writes, 10 a chunk, by name."""
    from litdata.streaming.writer import BinaryWriter

    writer = BinaryWriter(str(tmp_path / name), chunk_size=10, **options)
    for i in range(20):
        writer[i] = item(i)
    writer.done()
    writer.merge()
    return {path.name: path.read_bytes() for path in (tmp_path / name).iterdir()}


@pytest.mark.parametrize("case, options, item, culprit", [
    ("compressed", {"compression": "zstd"}, lambda i: {"text": "t" * i, "n": i}, "compressed record batches"),
    ("booleans", {}, lambda i: {"text": "t" * i, "ok": i % 2 == 0}, "booleans"),
    ("lists", {}, lambda i: {"text": "t" * i, "tags": ["a"] * i}, "nested values (list)"),
    ("dicts", {}, lambda i: {"text": "t", "meta": {"n": i}}, "nested values (struct)"),
    ("a key after the first item", {}, lambda i: {"text": "t", **({"late": i} if i > 2 else {})},
     "not the items' leaves"),
])
def test_litdata_arrow_footers_whose_values_are_not_byte_ranges_are_refused_by_chunk(
        service, moto, tmp_path, case, options, item, culprit):
    """LitData writes items of plain values in an Arrow footer after empty records (served where a
    value is a byte range: test_peer_layouts.py)."""
    slug = "arrow-" + case.replace(" ", "-")
    files = litdata_files(tmp_path, slug, item, **options)
    assert files["chunk-0-0.bin"].endswith(b"LDARW01\0")
    answer = register(service, slug, put(moto, slug, files))
    assert answer.status_code == 422, answer.text
    message = answer.json()["error"]["message"]
    assert re.search(r"chunk-0-[01]\.bin: LitData's Arrow footer", message) and culprit in message, message


def test_a_litdata_dataset_of_arrow_footers_and_records_is_refused_naming_both(service, moto, tmp_path):
    files = litdata_files(tmp_path, "mixed", lambda i: {"text": "t" * i, "n": i})
    records = [struct.pack("<II", i, 8) + b"t" * i + struct.pack("<q", i) for i in range(10, 20)]
    offsets = 4 * (len(records) + 2) + np.cumsum([0, *map(len, records)])
    files["chunk-0-1.bin"] = np.array([len(records), *offsets], "<u4").tobytes() + b"".join(records)  # as records
    answer = register(service, "mixed", put(moto, "mixed", files))
    assert answer.status_code == 422, answer.text
    message = answer.json()["error"]["message"]
    assert "chunk-0-0.bin holds its items in an Arrow footer, chunk-0-1.bin as records" in message, message


def test_a_compressed_shard_whose_bytes_are_not_its_recorded_hash_fails_its_batch_never_decoded(
        service, moto, tmp_path):
    """zstd as Streaming writes it has no checksum of its own: the shard's recorded hashes are."""
    streaming = import_streaming()
    rng = np.random.default_rng(3)
    out = tmp_path / "hashed"
    with streaming.MDSWriter(out=str(out), columns={"data": "bytes"}, compression="zstd",
                             hashes=["sha1", "xxh64"], size_limit=1 << 20) as writer:
        for _ in range(300):
            writer.write({"data": rng.bytes(2048)})  # random: the shard stays ~600 KB compressed
    files = {path.name: path.read_bytes() for path in out.iterdir()}
    name = json.loads(files["index.json"])["shards"][0]["zip_data"]["basename"]
    flipped = bytearray(files[name])
    flipped[-100] ^= 0x01  # past the prefix the open reads its header from
    files[name] = bytes(flipped)
    assert register(service, "hashed", put(moto, "hashed", files)).status_code == 200
    answer = requests.post(f"{service.url}/v1/batch", json={"dataset": "hashed", "indices": [299]}, timeout=30)
    assert answer.status_code == 422, answer.text
    message = answer.json()["error"]["message"]
    assert answer.json()["error"]["code"] == "shard_disagrees" and name in message and "its sha1 is" in message
