"""A peer's ``index.json`` read into a layout (``peerindex.py``, ``mds.py``, ``litdata.py``): the
fields named as the fixtures' readers of the peers' own output name them, in record order; and
LitData's Arrow-footer chunks indexed at each value's own bytes, from a few small ranges of each
(``arrowfooter.py``)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from shardfeed.service.datasets import arrowfooter
from shardfeed.service.datasets.index import index_from_parquet, parquet_bytes
from shardfeed.service.datasets.indexfile import ROWS_KEY
from shardfeed.service.datasets.mapped import map_index, write_mapped
from shardfeed.service.datasets.peerindex import index_records, peer_layout
from shardfeed.service.stores.file import FileStore

from common.peerdatasets import litdata_dataset, mds_dataset, plain_item


def layout_of(dataset):
    return peer_layout((dataset.root / "index.json").read_bytes(), "index.json", set())


@pytest.mark.parametrize("item", [
    lambda k: (np.full((2, 2), k, np.uint8), {"label": k, "boxes": (b"x" * k, "y")}),  # tuples, nested
    lambda k: np.arange(k + 1, dtype=np.int64),  # a bare leaf
    lambda k: {"zeta": k, "alpha": {"b": "s" * k, "a": np.zeros(k + 1, np.int16)}},  # insertion order
])
def test_litdata_leaves_are_fields_in_the_items_own_order(tmp_path, item):
    dataset = litdata_dataset(tmp_path, samples=4, item=item)
    layout = layout_of(dataset)
    assert [(c.name, c.encoding) for c in layout.format.columns] == list(dataset.encodings.items())
    assert sum(shard.samples for shard in layout.shards) == 4


@pytest.mark.parametrize("compression", [None, "zstd", "bz2"])
def test_mds_columns_are_fields_sized_where_fixed_and_compressed_shards_read_from_their_zip(tmp_path, compression):
    dataset = mds_dataset(tmp_path, compression=compression)
    layout = layout_of(dataset)
    assert [(c.name, c.encoding) for c in layout.format.columns] == list(dataset.encodings.items())
    sizes = {c.name: c.size for c in layout.format.columns}  # fixed-size: no size in the record's header
    assert (sizes["id"], sizes["label"], sizes["box"], sizes["blob"]) == (8, 1, 24, None)
    assert all((shard.codec is None) == (compression is None) for shard in layout.shards)
    assert all(shard.stored.endswith(f".mds.{compression}") for shard in layout.shards if compression)


class CountingStore(FileStore):
    """The file store, keeping the extent of every ranged read."""

    def __init__(self, root):
        super().__init__(f"file://{root}", root)
        self.reads: list[tuple[str, int, int]] = []

    async def read_range(self, path: str, offset: int, size: int, version: str | None = None) -> bytes:
        self.reads.append((path, offset, size))
        return await super().read_range(path, offset, size, version)


def peer_index(dataset):
    """The index of ``dataset`` built from its files, and the store that read them."""
    store = CountingStore(dataset.root)
    layout = layout_of(dataset)
    sizes = [(dataset.root / shard.name).stat().st_size for shard in layout.shards]
    return asyncio.run(index_records(store, layout, sizes)), store


def test_litdata_arrow_footer_chunks_are_indexed_at_each_values_own_bytes(tmp_path):
    dataset = litdata_dataset(tmp_path, samples=1000, chunk_bytes=3 << 13, item=plain_item)
    chunks = dataset.index["chunks"]
    assert len(chunks) > 2 and sum(chunk["chunk_size"] > 256 for chunk in chunks) > 1  # several record batches
    index, _ = peer_index(dataset)
    assert (index.layout, index.records, len(index)) == ("litdata", False, 1000)
    assert index.total_bytes == sum(map(len, dataset.raw.values()))
    files = {name: (tmp_path / name).read_bytes() for name in index.shards}
    for i in range(1000):
        for field in dataset.fields:
            member = index.member(i, field)
            assert (member is None) == ((i, field) not in dataset.raw), (i, field)
            if member is not None:
                shard, offset, size = member
                assert files[index.shards[shard]][offset:offset + size] == dataset.raw[i, field], (i, field)
    assert sum((i, "note") not in dataset.raw for i in range(1000)) == len(range(3, 1000, 7))  # the nulls
    assert any(dataset.raw[i, "caption"] == b"" for i in range(1000))
    assert any(dataset.raw[i, "blob"] == b"" for i in range(1000))


def test_an_arrow_footer_is_indexed_from_small_ranges_never_its_values(tmp_path):
    dataset = litdata_dataset(tmp_path, samples=600, chunk_bytes=2 << 20,
                              item=lambda k: {"text": "t" * (4000 + k), "data": bytes(k % 300), "n": k})
    index, store = peer_index(dataset)
    sizes = {name: (tmp_path / name).stat().st_size for name in index.shards}
    assert len(index) == 600 and not index.records
    read = sum(size for _, _, size in store.reads)
    assert read < 0.01 * sum(sizes.values()), (read, sizes)
    assert max(size for _, _, size in store.reads) <= arrowfooter.LOOKAHEAD + 2048, store.reads
    batches = [-(-chunk["chunk_size"] // 256) for chunk in dataset.index["chunks"]]
    # Per chunk its header, its tail and its footer; per record batch its metadata, with text's offsets
    # after it (LOOKAHEAD), and data's offsets after text's values.
    assert len(store.reads) == sum(3 + 2 * n for n in batches), store.reads


def test_an_index_says_whether_its_rows_are_records_kept_or_mapped_and_an_older_peer_index_holds_records(tmp_path):
    footers, _ = peer_index(litdata_dataset(tmp_path / "footers", samples=4, item=plain_item))
    records, _ = peer_index(litdata_dataset(tmp_path / "records", samples=4))
    assert (footers.records, records.records) == (False, True)
    for index in (footers, records):
        assert index_from_parquet(parquet_bytes(index.to_table())).records == index.records
        write_mapped(index, tmp_path / f"{index.records}.idx")
        assert map_index(tmp_path / f"{index.records}.idx").records == index.records
    table = records.to_table()
    older = table.replace_schema_metadata({k: v for k, v in table.schema.metadata.items() if k != ROWS_KEY})
    assert index_from_parquet(parquet_bytes(older)).records  # kept before the key: a peer's were all records


def test_an_empty_value_where_the_next_one_starts_leaves_its_bytes_counted(tmp_path):
    dataset = litdata_dataset(tmp_path, samples=4, item=lambda k: {"tag": "", "n": k})  # tag's data: 0 bytes
    index, _ = peer_index(dataset)
    assert index.member(0, "tag")[1] == index.member(0, "n")[1]  # the same offset, n's values 8 bytes each
    assert index.total_bytes == 4 * 8
