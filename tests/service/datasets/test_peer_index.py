"""A peer's ``index.json`` read into a layout (``peerindex.py``, ``mds.py``, ``litdata.py``): the
fields named as the fixtures' readers of the peers' own output name them, in record order."""

from __future__ import annotations

import numpy as np
import pytest

from shardfeed.service.datasets.peerindex import peer_layout

from common.peerdatasets import litdata_dataset, mds_dataset


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
