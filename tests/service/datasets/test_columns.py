"""An index's per-sample columns made chunk by chunk (``datasets/columns.py``): any split into
chunks gives the same column, for keys of mixed lengths and samples with and without a field.
(Through the service and the client, against the datasets' sources: ``tests/service/api/test_index_columns.py``.)"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from shardfeed.service.datasets import columns
from shardfeed.service.datasets.index import Index
from shardfeed.service.datasets.indexfile import SCHEMA

SAMPLES = 1000


@pytest.fixture(scope="module")
def index() -> Index:
    """Keys of 1 to 11 bytes; every sample has ``bin``, every third ``txt`` (stored first)."""
    rows = []
    for i in range(SAMPLES):
        key = "k" * (i % 7) + str(i * 37)
        members = [("txt", 3 + i % 5)] if i % 3 == 0 else []
        members.append(("bin", 100 + i))
        rows += [(i, key, field, f"s{i // 300}.tar", 512 * n, size) for n, (field, size) in enumerate(members)]
    return Index.from_table(pa.table(dict(zip(SCHEMA.names, zip(*rows))), schema=SCHEMA))


@pytest.mark.parametrize("name", ["key", "shard", "bytes", "bytes.bin", "bytes.txt"])
def test_any_split_into_chunks_makes_the_same_column(index, name):
    column = columns.column(index, name)
    whole = column.chunk(0, SAMPLES)
    cuts = np.sort(np.random.default_rng(5).choice(np.arange(1, SAMPLES), 40, replace=False))
    bounds = [0, *cuts.tolist(), SAMPLES]
    pieces = [column.chunk(low, high) for low, high in zip(bounds, bounds[1:])]
    assert all(piece.dtype == column.dtype for piece in pieces)
    assert np.array_equal(np.concatenate(pieces), whole)
    expected = {
        "key": ["k" * (i % 7) + str(i * 37) for i in range(SAMPLES)],
        "shard": [i // 300 for i in range(SAMPLES)],
        "bytes": [100 + i + (3 + i % 5 if i % 3 == 0 else 0) for i in range(SAMPLES)],
        "bytes.bin": [100 + i for i in range(SAMPLES)],
        "bytes.txt": [3 + i % 5 if i % 3 == 0 else 0 for i in range(SAMPLES)],
    }[name]
    assert (np.char.decode(whole).tolist() if name == "key" else whole.tolist()) == expected


def test_a_chunk_is_bounded_in_bytes_whatever_its_width(index):
    assert columns.column(index, "bytes").rows == columns.CHUNK_BYTES // 8
    key = columns.column(index, "key")
    assert key.dtype == np.dtype("S11") and key.rows == columns.CHUNK_BYTES // 11
