"""The index's per-sample columns (``GET /v1/datasets/{name}/index[/{column}]``) through the real
service over its socket and both clients, every value checked against the dataset's source:
the keys and members ``tarfile`` wrote (tar shards), the record offsets in an MDS shard's own
header (a record layout); ``.npy`` answers read back by ``np.load`` too."""

from __future__ import annotations

import asyncio
import io
import struct
from collections import defaultdict

import httpx
import numpy as np
import pytest

from shardfeed.client import AsyncClient, Client, ShardfeedHTTPError
from shardfeed.process import start_service

from common.datasets import dir_put, make_dataset, odd_tar_dataset, tar_dataset

PER_SHARD = 50
UNICODE_KEYS = ["é", "ключ-длинный", "日本/語", "a"]
"""Keys of one byte up to 23 (UTF-8), three of them not ASCII."""


@pytest.fixture(scope="module")
def datasets(tmp_path_factory):
    root = tmp_path_factory.mktemp("index-columns")
    train = make_dataset(dir_put(root / "train"), samples=130, per_shard=PER_SHARD)
    odd_url, odd = odd_tar_dataset(root / "odd", samples=20)
    unicode_url = tar_dataset(root / "unicode", [{f"{key}.txt": key.encode() * (n + 1)}
                                                 for n, key in enumerate(UNICODE_KEYS)])
    return root, {"train": (root / "train").as_uri(), "odd": odd_url, "unicode": unicode_url}, train, odd


@pytest.fixture(scope="module")
def service(datasets):
    root, urls, _, _ = datasets
    with start_service(urls, cache_dir=root / "cache") as svc:
        yield svc


def every_column(client: Client, dataset: str) -> dict[str, np.ndarray]:
    return {name: client.index_column(dataset, name) for name in client.index_columns(dataset)}


def test_every_column_of_a_tar_dataset_is_what_its_shards_hold(service, datasets):
    _, _, source, _ = datasets
    samples = 1 + max(i for i, _ in source)
    with Client(service.url) as client:
        fields = client.info("train")["fields"]
        assert client.index_columns("train") == ["key", "shard", "bytes", *(f"bytes.{f}" for f in fields)]
        columns = every_column(client, "train")
        shards = client.shard_names("train")
    assert columns["key"].dtype == np.dtype("S12")
    assert columns["key"].tolist() == [f"sample{i:06d}".encode() for i in range(samples)]
    assert columns["shard"].dtype == np.int32
    assert [shards[s] for s in columns["shard"]] == [f"shards/part-{i // PER_SHARD:04d}.tar" for i in range(samples)]
    assert columns["bytes"].dtype == np.int64
    assert columns["bytes"].tolist() == [sum(len(source.get((i, f), b"")) for f in fields) for i in range(samples)]
    for field in fields:
        assert columns[f"bytes.{field}"].dtype == np.int64
        assert columns[f"bytes.{field}"].tolist() == [len(source.get((i, field), b"")) for i in range(samples)]
    assert (columns["bytes.json"] == 0).sum() == samples - len(range(0, samples, 7))  # the samples lacking it
    assert all(not values.flags.writeable for values in columns.values())  # views of the answers' bytes


def test_keys_of_any_length_and_script_come_back_exactly(service, datasets):
    _, _, _, odd = datasets
    with Client(service.url) as client:
        odd_keys = client.index_column("odd", "key")
        unicode_keys = client.index_column("unicode", "key")
        unicode_bytes = client.index_column("unicode", "bytes")
        seg = client.index_column("odd", "bytes.seg.png")
    names = {i: name[:-len(field) - 1] for (i, field), (name, _) in odd.items()}
    assert odd_keys.dtype.itemsize == max(len(key.encode()) for key in names.values()) > 100
    assert np.char.decode(odd_keys, "utf-8").tolist() == [names[i] for i in range(len(names))]
    assert unicode_keys.dtype == np.dtype("S23")  # the longest key's UTF-8 bytes
    # The index numbers samples in shard order, and a shard here holds one key.
    assert np.char.decode(unicode_keys, "utf-8").tolist() == UNICODE_KEYS
    assert unicode_bytes.tolist() == [len(key.encode()) * (n + 1) for n, key in enumerate(UNICODE_KEYS)]
    assert seg.tolist() == [len(odd[(i, "seg.png")][1]) if (i, "seg.png") in odd else 0 for i in range(len(names))]


def test_a_column_is_a_npy_file_any_reader_takes_with_its_length_and_version(service):
    with Client(service.url) as client:
        version = client.info("train")["version"]
        wanted = client.index_column("train", "bytes.bin")
    resp = httpx.get(f"{service.url}/v1/datasets/train/index/bytes.bin")
    assert resp.status_code == 200
    assert resp.headers["content-type"] == "application/x-npy"
    assert int(resp.headers["content-length"]) == len(resp.content)
    assert resp.headers["x-shardfeed-dataset-version"] == version
    read = np.load(io.BytesIO(resp.content))
    assert read.dtype == np.dtype("<i8") and np.array_equal(read, wanted)
    listing = httpx.get(f"{service.url}/v1/datasets/train/index").json()
    assert listing == {"dataset": "train", "version": version, "samples": 130, "shards": 3,
                       "columns": ["key", "shard", "bytes", "bytes.bin", "bytes.cls", "bytes.json"]}


def test_the_async_client_reads_the_same_columns(service):
    async def read() -> tuple[list[str], np.ndarray, list[str]]:
        async with AsyncClient(service.url) as client:
            return (await client.index_columns("odd"), await client.index_column("odd", "key"),
                    await client.shard_names("odd"))

    columns, keys, shards = asyncio.run(read())
    with Client(service.url) as client:
        assert columns == client.index_columns("odd")
        assert np.array_equal(keys, client.index_column("odd", "key")) and keys.dtype.itemsize > 100
    assert shards == ["shard-0.tar", "shard-1.tar"]


def test_an_unknown_column_or_dataset_is_a_404_naming_what_there_is(service):
    with Client(service.url) as client:
        for column in ("bytes.nope", "size", "bytes."):
            with pytest.raises(ShardfeedHTTPError) as err:
                client.index_column("train", column)
            assert (err.value.status, err.value.code) == (404, "unknown_column")
            assert err.value.message == (f"dataset 'train' has no index column {column!r} (columns: key, shard, "
                                         "bytes, bytes.bin, bytes.cls, bytes.json)")
        for call in (lambda: client.index_column("nope", "bytes"), lambda: client.index_columns("nope"),
                     lambda: client.shard_names("nope")):
            with pytest.raises(ShardfeedHTTPError) as err:
                call()
            assert (err.value.status, err.value.code) == (404, "unknown_dataset")
            assert "no dataset named 'nope'" in err.value.message
    resp = httpx.get(f"{service.url}/v1/datasets/train/index/size")
    assert resp.status_code == 404 and resp.headers["content-type"] == "application/json"


@pytest.mark.slow
def test_a_record_layouts_bytes_are_its_records_and_it_has_no_field_columns(service, tmp_path):
    from common.peerdatasets import mds_dataset

    peer = mds_dataset(tmp_path / "mds", samples=24)
    with Client(service.url) as client:
        client.register_dataset("mds", (tmp_path / "mds").as_uri())
        assert client.index_columns("mds") == ["key", "shard", "bytes"]
        sizes = client.index_column("mds", "bytes")
        shard = client.index_column("mds", "shard")
        names = client.shard_names("mds")
        with pytest.raises(ShardfeedHTTPError) as err:
            client.index_column("mds", "bytes.id")
    assert err.value.message == ("dataset 'mds' has no index column 'bytes.id' (an MDS or LitData index holds "
                                 "its records' sizes, not its fields') (columns: key, shard, bytes)")
    records: dict[str, list[int]] = defaultdict(list)  # each shard's record sizes, from its own header
    for entry in peer.index["shards"]:
        raw = (peer.root / entry["raw_data"]["basename"]).read_bytes()
        count = struct.unpack_from("<I", raw)[0]
        records[entry["raw_data"]["basename"]] = np.diff(np.frombuffer(raw, "<u4", count + 1, 4)).tolist()
    order = [entry["raw_data"]["basename"] for entry in peer.index["shards"]]
    assert sizes.tolist() == [size for name in order for size in records[name]]
    assert [names[s] for s in shard] == [name for name in order for _ in records[name]]
    assert httpx.get(f"{service.url}/v1/datasets/mds/index").json()["samples"] == peer.samples
