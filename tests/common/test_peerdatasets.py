"""The peers' datasets of ``common.peerdatasets``: written as the module docstring says, several
shards, every field's bytes as the peer's reader hands them to its decoder, empty values and
grayscale images among them, and an upload that puts every file in the bucket."""

import json
import struct

import numpy as np
import pytest

from common.peerdatasets import (
    LITDATA_LAYOUTS, MDS_COLUMNS, PeerCannotDecode, leaf_names, litdata_dataset, litdata_item, mds_dataset,
    mds_sample, plain_item, upload,
)


def image_modes(dataset, field: str) -> set[str]:
    return {dataset.decoded[i, field].mode for i in range(dataset.samples)}


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_mds_dataset_is_read_through_streamings_own_decode(tmp_path, compression):
    dataset = mds_dataset(tmp_path / "mds", compression=compression)
    shards = dataset.index["shards"]
    assert len(shards) >= 3 and sum(shard["samples"] for shard in shards) == dataset.samples == 24
    assert {shard["compression"] for shard in shards} == {compression}
    # Compressed, only the .mds.zstd files: the reader wrote nothing here.
    assert sorted(path.name for path in dataset.root.iterdir()) == ["index.json"] + [
        shard["zip_data" if compression else "raw_data"]["basename"] for shard in shards]
    assert all(shard["raw_data"]["basename"].endswith(".mds") for shard in shards)
    if compression is None:  # the offsets table, then the shard's own JSON, then the samples
        head = (dataset.root / shards[0]["raw_data"]["basename"]).read_bytes()
        count, first = struct.unpack_from("<II", head)
        assert count == shards[0]["samples"]
        own = {key: value for key, value in shards[0].items() if key not in ("samples", "raw_data", "zip_data")}
        assert json.loads(head[4 * (count + 2):first]) == own
    # Columns sorted by name, with the encodings given to the writer.
    assert dataset.fields == sorted(MDS_COLUMNS) and dataset.encodings == {f: MDS_COLUMNS[f] for f in dataset.fields}
    fixed = dict(zip(shards[0]["column_names"], shards[0]["column_sizes"]))
    assert {f for f, size in fixed.items() if size} == {"id", "label", "weight", "box"}

    for i in range(dataset.samples):
        sample = mds_sample(i)
        assert dataset.raw[i, "id"] == np.int64(i).tobytes()
        assert dataset.raw[i, "label"] == bytes([i])
        assert dataset.raw[i, "caption"] == sample["caption"].encode()
        assert dataset.raw[i, "blob"] == sample["blob"]
        assert dataset.raw[i, "box"] == sample["box"].tobytes()
        assert dataset.raw[i, "scan"].startswith(b"\x89PNG") and dataset.raw[i, "photo"].startswith(b"\xff\xd8")
        assert all(len(dataset.raw[i, f]) == size for f, size in fixed.items() if size)
        assert dataset.decoded[i, "caption"] == sample["caption"] and dataset.decoded[i, "id"] == i
        np.testing.assert_array_equal(dataset.decoded[i, "tokens"], sample["tokens"])
        np.testing.assert_array_equal(dataset.decoded[i, "pixels"], sample["pixels"])
    assert {dataset.decoded[i, "tokens"].dtype.name for i in range(dataset.samples)} == {"int32", "float64"}
    for field in ("caption", "blob"):
        assert any(dataset.raw[i, field] == b"" for i in range(dataset.samples))
        assert len({dataset.raw[i, field] for i in range(dataset.samples)}) > dataset.samples // 2
    for field in ("photo", "scan", "picture"):
        assert image_modes(dataset, field) == {"L", "RGB"}


@pytest.mark.parametrize("layout", LITDATA_LAYOUTS)
def test_litdata_dataset_is_read_through_litdatas_own_deserializers(tmp_path, layout):
    from litdata.streaming.framed_zstd import parse_framed_header

    dataset = litdata_dataset(tmp_path / "litdata", layout=layout)
    index = dataset.index
    config, chunks = index["config"], index["chunks"]
    assert len(chunks) >= 3 and sum(chunk["chunk_size"] for chunk in chunks) == dataset.samples == 24
    files = sorted(["index.json"] + [chunk["filename"] for chunk in chunks])
    assert sorted(path.name for path in dataset.root.iterdir()) == files  # the reader wrote nothing here
    compression = {"plain": (None, None), "framed": ("zstd", "batch"), "whole": ("zstd", None)}[layout]
    assert (config["compression"], config["compression_level"]) == compression
    first = (dataset.root / chunks[0]["filename"]).read_bytes()
    if layout == "whole":
        assert all(c["filename"].endswith(".zstd.bin") for c in chunks) and first.startswith(b"\x28\xb5\x2f\xfd")
    else:
        assert all(c["filename"].endswith(".bin") and ".zstd" not in c["filename"] for c in chunks)
    if layout == "framed":
        assert first.startswith(b"LDFZ01\0\0") and len(parse_framed_header(first).frames) >= 2
    if layout == "plain":
        assert struct.unpack_from("<I", first) == (chunks[0]["chunk_size"],)
    assert dataset.encodings == {
        "id": "int", "caption": "str", "photo": "jpeg", "picture": "pil", "tokens": "no_header_numpy:1",
        "mask": "numpy", "blob": "bytes", "score": "float", "meta.source": "str", "meta.rank": "int"}
    assert list(dataset.encodings.values()) == config["data_format"]

    for i in range(dataset.samples):
        item = litdata_item(i)
        assert dataset.raw[i, "id"] == np.int64(i).tobytes() and dataset.raw[i, "meta.rank"] == np.int64(-i).tobytes()
        assert dataset.raw[i, "caption"] == item["caption"].encode()
        assert dataset.raw[i, "blob"] == item["blob"]
        assert dataset.raw[i, "tokens"] == item["tokens"].tobytes()
        assert dataset.raw[i, "photo"].startswith(b"\xff\xd8")
        assert dataset.decoded[i, "meta.source"] == item["meta"]["source"] and dataset.decoded[i, "score"] == i / 4
        np.testing.assert_array_equal(dataset.decoded[i, "mask"], item["mask"])
        photo = dataset.decoded[i, "photo"]  # LitData decodes jpeg with torchvision, to RGB channels first
        assert isinstance(photo, PeerCannotDecode) or photo.shape[0] == 3
    for field in ("caption", "blob"):
        assert any(dataset.raw[i, field] == b"" for i in range(dataset.samples))
    assert image_modes(dataset, "picture") == {"L", "RGB"}


@pytest.mark.parametrize("layout", ["plain", "framed"])
def test_litdata_items_of_plain_values_are_written_in_arrow_footers_and_read_as_its_serializers_write_them(
        tmp_path, layout):
    dataset = litdata_dataset(tmp_path / "arrow", layout=layout, samples=300, chunk_bytes=1 << 14, item=plain_item)
    config, chunks = dataset.index["config"], dataset.index["chunks"]
    assert (config["compression"], config["ipc_compression"]) == ((None, None) if layout == "plain" else (None, "zstd"))
    assert len(chunks) >= 2 and chunks[0]["chunk_size"] > 256  # several chunks, several record batches
    for chunk in chunks:
        data = (dataset.root / chunk["filename"]).read_bytes()
        count, *offsets = struct.unpack_from(f"<{chunk['chunk_size'] + 2}I", data)
        assert offsets == [4 * (count + 2)] * (count + 1) and data.endswith(b"LDARW01\0")
        assert data[offsets[0]:offsets[0] + 6] == b"ARROW1" == data[-18:-12]
        assert len(data) == chunk["chunk_bytes"] == offsets[0] + struct.unpack_from("<I", data, len(data) - 12)[0] + 12
    assert dataset.encodings == {"id": "int", "caption": "str", "score": "float", "blob": "bytes", "note": "str",
                                 "label": "str"}
    for i in range(dataset.samples):
        item = plain_item(i)
        assert dataset.raw[i, "id"] == struct.pack("<q", item["id"]) and dataset.decoded[i, "id"] == item["id"]
        assert dataset.raw[i, "score"] == struct.pack("<d", item["score"])
        assert dataset.raw[i, "caption"] == item["caption"].encode() and dataset.raw[i, "blob"] == item["blob"]
        assert ((i, "note") in dataset.raw) == (item["note"] is not None)  # a null: no field
    for field in ("caption", "blob", "note"):
        assert any(dataset.raw.get((i, field)) == b"" for i in range(dataset.samples))


def test_litdata_leaves_are_named_by_their_path_in_the_item(tmp_path):
    tuples = litdata_dataset(tmp_path / "tuple", samples=6,
                             item=lambda k: (np.full((2, 2), k, np.uint8), {"label": k, "boxes": (b"x" * k, "y")}))
    assert tuples.encodings == {"0": "numpy", "1.label": "int", "1.boxes.0": "bytes", "1.boxes.1": "str"}
    assert [tuples.raw[i, "1.boxes.0"] for i in range(6)] == [b"x" * k for k in range(6)]
    bare = litdata_dataset(tmp_path / "bare", samples=4, item=lambda k: np.arange(k + 1, dtype=np.int64))
    assert bare.encodings == {"item": "no_header_numpy:3"}  # int64 in litdata.constants._NUMPY_DTYPES_MAPPING
    # Dict leaves in insertion order, not sorted: the writer's order is the reader's.
    dicts = litdata_dataset(tmp_path / "dict", samples=4,
                            item=lambda k: {"z": np.zeros(k + 1), "a": {"y": k, "b": "s"}})
    assert leaf_names(dicts.index["config"]["data_spec"]) == dicts.fields == ["z", "a.y", "a.b"]


@pytest.mark.both_s3
def test_upload_puts_every_file_under_the_prefix(tmp_path, s3_server, bucket):
    dataset = mds_dataset(tmp_path / "mds", compression="zstd", samples=6, size_limit=1 << 12)
    url = upload(s3_server, dataset.root, bucket, "peers/mds")
    assert url == f"s3://{bucket}/peers/mds"
    client = s3_server.client()
    listed = client.list_objects_v2(Bucket=bucket, Prefix="peers/mds/")["Contents"]
    assert sorted(item["Key"] for item in listed) == sorted(f"peers/mds/{p.name}" for p in dataset.root.iterdir())
    index = client.get_object(Bucket=bucket, Key="peers/mds/index.json")["Body"].read()
    assert index == (dataset.root / "index.json").read_bytes()
