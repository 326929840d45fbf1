import asyncio

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from shardfeed.service.datasets.index import (
    Index, SampleOutOfRange, UnknownField, index_from_parquet, load_index, parquet_bytes, write_index,
)
from shardfeed.service.datasets.indexfile import INDEX_FILE, SCHEMA, IndexFormatError, split_member_name
from shardfeed.service.stores import ObjectNotFound, open_store

# Three samples; sample 1 lacks "json", sample 2 stores its members in another order.
ROWS = [
    (0, "a/000", "jpg", "s0.tar", 512, 100),
    (0, "a/000", "cls", "s0.tar", 1536, 1),
    (0, "a/000", "json", "s0.tar", 2560, 20),
    (1, "a/001", "cls", "s0.tar", 3584, 1),
    (1, "a/001", "jpg", "s0.tar", 4608, 200),
    (2, "b/000", "json", "s1.tar", 512, 30),
    (2, "b/000", "jpg", "s1.tar", 1536, 300),
    (2, "b/000", "cls", "s1.tar", 2560, 1),
]


def table(rows=ROWS) -> pa.Table:
    columns = list(zip(*rows)) if rows else [[]] * 6
    return pa.table(dict(zip(SCHEMA.names, columns)), schema=SCHEMA)


@pytest.fixture
def index() -> Index:
    return Index.from_table(table())


def rows_of(m, index):
    return [(int(p), int(s), index.fields[f], index.shards[sh] if sh >= 0 else None, int(o), int(z), bool(ok))
            for p, s, f, sh, o, z, ok in zip(m.position, m.sample, m.field, m.shard, m.offset, m.size, m.found)]


def test_index_exposes_samples_fields_shards_and_keys(index):
    assert len(index) == 3 and index.members == 8
    assert index.fields == ["cls", "jpg", "json"]
    assert index.shards == ["s0.tar", "s1.tar"]
    assert index.total_bytes == 100 + 1 + 20 + 1 + 200 + 30 + 300 + 1
    assert [index.key(i) for i in range(3)] == ["a/000", "a/001", "b/000"]
    assert index.sample_fields(2) == ["json", "jpg", "cls"]
    assert index.shard_extents().tolist() == [4608 + 200, 2560 + 1]


def test_lookup_without_fields_gives_stored_member_order_in_request_order(index):
    m = index.lookup(np.array([2, 0, 2]))
    assert rows_of(m, index) == [
        (0, 2, "json", "s1.tar", 512, 30, True), (0, 2, "jpg", "s1.tar", 1536, 300, True),
        (0, 2, "cls", "s1.tar", 2560, 1, True),
        (1, 0, "jpg", "s0.tar", 512, 100, True), (1, 0, "cls", "s0.tar", 1536, 1, True),
        (1, 0, "json", "s0.tar", 2560, 20, True),
        (2, 2, "json", "s1.tar", 512, 30, True), (2, 2, "jpg", "s1.tar", 1536, 300, True),
        (2, 2, "cls", "s1.tar", 2560, 1, True),
    ]
    assert m.position.dtype == np.int64 and m.field.dtype == np.int32 and m.shard.dtype == np.int32
    assert m.offset.dtype == np.int64 and m.size.dtype == np.int64 and m.found.dtype == bool


def test_lookup_with_fields_follows_fields_order_and_marks_missing_members(index):
    m = index.lookup([1, 2], ["json", "cls", "json"])
    assert rows_of(m, index) == [
        (0, 1, "json", None, 0, 0, False), (0, 1, "cls", "s0.tar", 3584, 1, True),
        (0, 1, "json", None, 0, 0, False),
        (1, 2, "json", "s1.tar", 512, 30, True), (1, 2, "cls", "s1.tar", 2560, 1, True),
        (1, 2, "json", "s1.tar", 512, 30, True),
    ]


def test_lookup_of_nothing_is_empty(index):
    assert len(index.lookup(np.array([], dtype=np.int64))) == 0
    assert len(index.lookup([], ["cls"])) == 0


def test_out_of_range_sample_names_the_index_and_the_sample_count(index):
    with pytest.raises(SampleOutOfRange, match=r"sample 3 out of range \(dataset has 3 samples\)"):
        index.lookup([0, 3, -1])
    with pytest.raises(SampleOutOfRange, match="sample -1 out of range"):
        index.lookup([-1])
    with pytest.raises(LookupError):
        index.key(7)


def test_unknown_field_names_the_field_and_the_valid_ones(index):
    with pytest.raises(UnknownField, match=r"unknown field 'png' \(dataset has: cls, jpg, json\)"):
        index.lookup([0], ["cls", "png"])
    assert issubclass(UnknownField, LookupError)


def test_rows_in_any_order_load_into_the_same_index(index):
    shuffled = table([ROWS[i] for i in (5, 0, 3, 1, 6, 2, 4, 7)])
    other = Index.from_table(shuffled)
    assert other.to_table().equals(index.to_table())
    assert other.sample_fields(2) == ["json", "jpg", "cls"]


def test_to_table_round_trips_through_parquet_with_the_version_metadata(index):
    data = parquet_bytes(index.to_table())
    on_disk = pq.read_table(pa.BufferReader(data))
    assert on_disk.schema.metadata[b"shardfeed.index.version"] == b"1"
    assert [(f.name, str(f.type)) for f in on_disk.schema] == [
        ("sample", "int64"), ("key", "string"), ("field", "string"), ("shard", "string"),
        ("offset", "int64"), ("size", "int64")]
    assert sorted(on_disk.to_pylist(), key=lambda r: (r["sample"], r["offset"])) == \
        sorted(table().to_pylist(), key=lambda r: (r["sample"], r["offset"]))
    assert index_from_parquet(data).to_table().equals(index.to_table())


def test_write_and_load_through_a_store(tmp_path, index):
    async def go():
        async with open_store(str(tmp_path)) as store:
            with pytest.raises(ObjectNotFound, match="shardfeed index"):
                await load_index(store)
            await write_index(store, index)
            return await load_index(store)

    assert asyncio.run(go()).to_table().equals(index.to_table())
    assert [p.name for p in tmp_path.iterdir()] == [INDEX_FILE]


@pytest.mark.parametrize("rows, message", [
    ([], "empty"),
    ([r if r[0] != 2 else (3,) + r[1:] for r in ROWS], "sample 2 is missing"),
    ([r if r != ROWS[1] else (0, "a/000", "jpg") + r[3:] for r in ROWS], "sample 0 has field 'jpg' twice"),
    ([r if r != ROWS[1] else r[:3] + ("s1.tar",) + r[4:] for r in ROWS], "sample 0 spans more than one shard"),
    ([r if r != ROWS[1] else (0, "zzz") + r[2:] for r in ROWS], "sample 0 has members with different keys"),
    ([r if r != ROWS[4] else r[:4] + (-5, 200) for r in ROWS], "'offset' has a negative value"),
    ([r if r != ROWS[4] else r[:5] + (-1,) for r in ROWS], "'size' has a negative value"),
])
def test_invalid_tables_are_refused_with_the_reason(rows, message):
    with pytest.raises(IndexFormatError, match=message):
        Index.from_table(table(rows))


def test_missing_columns_and_foreign_files_are_refused():
    with pytest.raises(IndexFormatError, match="no 'size' column"):
        Index.from_table(table().drop_columns(["size"]))
    with pytest.raises(IndexFormatError, match="not a valid parquet file"):
        index_from_parquet(b"PK\x03\x04 this is a zip file")
    plain = pa.BufferOutputStream()
    pq.write_table(table().replace_schema_metadata(None), plain)
    with pytest.raises(IndexFormatError, match="not a shardfeed index"):
        index_from_parquet(plain.getvalue().to_pybytes())
    with pytest.raises(IndexFormatError, match="unsupported index version '2'"):
        Index.from_table(table().replace_schema_metadata({b"shardfeed.index.version": b"2"}))


def test_memory_per_sample_is_small():
    n = 100_000
    sample = np.repeat(np.arange(n), 2)
    keys = pa.array([f"{i:09d}" for i in range(n)]).take(pa.array(sample))
    big = pa.table({"sample": sample, "key": keys, "field": np.tile(["bin", "cls"], n),
                    "shard": pa.array(["shard-000000.tar"] * 2 * n), "offset": np.arange(2 * n) * 2048 + 512,
                    "size": np.tile([1500, 1], n)}, schema=SCHEMA)
    index = Index.from_table(big)
    assert index.nbytes / n < 50  # keys 13 B + starts 4 + shard 4 + 2 members x (2 + 4 + 4)
    assert index.key(n - 1) == f"{n - 1:09d}"
    assert rows_of(index.lookup([n - 1], ["cls"]), index) == [
        (0, n - 1, "cls", "shard-000000.tar", (2 * n - 1) * 2048 + 512, 1, True)]


def test_webdataset_names_split_at_the_first_dot_of_the_file_name():
    assert split_member_name("a.b/c/0001.seg.PNG") == ("a.b/c/0001", "seg.png")
    assert split_member_name("000123.cls") == ("000123", "cls")
    assert split_member_name("dir/README") is None
    assert split_member_name("dir/.hidden") is None
    assert split_member_name("dir/x.") is None


@pytest.mark.parametrize("chunk", [1, 2, 1 << 22])
def test_sample_extents_are_each_samples_shard_and_span_whatever_the_chunk(index, chunk):
    shard, start, end = index.sample_extents(chunk=chunk)
    assert [index.shards[s] for s in shard] == ["s0.tar", "s0.tar", "s1.tar"]
    assert start.tolist() == [512, 3584, 512]
    assert end.tolist() == [2580, 4808, 2561]
