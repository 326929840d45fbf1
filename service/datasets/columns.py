"""Per-sample columns of a dataset's index, what a client selects a subset of its samples by
(issue 41's subsets: a key list, or a predicate over these columns evaluated once, vectorised,
by the client); served by ``GET /v1/datasets/{name}/index/{column}`` (``api/index.py``).

    key             the sample's key, UTF-8, as fixed-width bytes (``S<longest key>``, padded with
                    NULs, which numpy drops when it reads one): the longest key's bytes a sample
    shard           the code of its shard in ``Index.shards`` (int32): its first member's shard
    bytes           its payload bytes, every field's summed (int64); a record layout's (MDS,
                    LitData) rows hold their record's extent: its record's bytes, header included
    bytes.<field>   one field's payload bytes (int64; 0 where the sample lacks the field); not for
                    a record layout, whose index does not hold its fields' sizes

A column is made ``chunk(low, high)`` samples at a time, each chunk of at most ``CHUNK_BYTES``
(``Column.rows`` samples), so that no temporary outgrows a chunk whatever the dataset's size.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from shardfeed.service.datasets.index import Index

CHUNK_BYTES = 8 << 20
"""Bytes of a column made at once: 2^20 samples of an int64 column."""

FIELD_BYTES = "bytes."
"""The prefix of a field's own bytes column: ``bytes.<field>``."""


class UnknownColumn(LookupError):
    """A column name the index has no column for; the message names those it has."""


@dataclass(frozen=True)
class Column:
    """One column of an index: its values for samples ``low`` up to ``high`` are ``chunk(low, high)``."""

    name: str
    dtype: np.dtype
    chunk: Callable[[int, int], np.ndarray]

    @property
    def rows(self) -> int:
        """Samples a chunk holds, at most: ``CHUNK_BYTES`` of them."""
        return max(1, CHUNK_BYTES // self.dtype.itemsize)


def column_names(index: Index) -> list[str]:
    """The columns ``column`` makes of ``index``: the ``bytes.<field>`` ones where its rows are fields."""
    fields = [] if index.records else [FIELD_BYTES + field for field in index.fields]
    return ["key", "shard", "bytes", *fields]


def column(index: Index, name: str) -> Column:
    """The column ``name`` of ``index``; ``UnknownColumn`` naming those it has if it has none."""
    arrays = index.arrays()
    starts, shard, field, size = arrays["starts"], arrays["shard"], arrays["field"], arrays["size"]
    if name == "key":
        return _keys(index)
    if name == "shard":
        return Column(name, np.dtype(np.int32), lambda low, high: shard[starts[low:high]].astype(np.int32))
    if name == "bytes" and index.records:  # every row of a sample is its record's extent
        return Column(name, np.dtype(np.int64), lambda low, high: size[starts[low:high]].astype(np.int64))
    if name == "bytes":
        def summed(low: int, high: int) -> np.ndarray:
            first, last = int(starts[low]), int(starts[high])
            return np.add.reduceat(size[first:last].astype(np.int64), starts[low:high] - first)

        return Column(name, np.dtype(np.int64), summed)
    if name.startswith(FIELD_BYTES) and not index.records and name[len(FIELD_BYTES):] in index.fields:
        code = index.fields.index(name[len(FIELD_BYTES):])

        def field_bytes(low: int, high: int) -> np.ndarray:
            first, last = int(starts[low]), int(starts[high])
            own = np.where(field[first:last] == code, size[first:last], 0)  # one a sample at most
            return np.add.reduceat(own.astype(np.int64, copy=False), starts[low:high] - first)

        return Column(name, np.dtype(np.int64), field_bytes)
    why = " (an MDS or LitData index holds its records' sizes, not its fields')" \
        if index.records and name.startswith(FIELD_BYTES) else ""
    raise UnknownColumn(f"no index column {name[:200]!r}{why} (columns: {', '.join(column_names(index))})")


def _keys(index: Index) -> Column:
    """The keys as ``S<longest>``: each key's bytes copied into its own fixed-width row, a chunk's
    rows at once from a window view over its keys' text; where every key is as long, the text is
    the column already."""
    starts, text = index.key_buffers
    step = CHUNK_BYTES // 8
    shortest, longest = zip(*((int(d.min()), int(d.max())) for d in
                              (np.diff(starts[low:low + step + 1]) for low in range(0, len(index), step))))
    width = max(1, max(longest))
    uniform = min(shortest) == width
    dtype = np.dtype(f"S{width}")

    def keys(low: int, high: int) -> np.ndarray:
        first, last = int(starts[low]), int(starts[high])
        if uniform:
            return text[first:last].view(dtype)
        padded = np.zeros(last - first + width, np.uint8)  # a window may reach past the last key
        padded[:last - first] = text[first:last]
        rows = sliding_window_view(padded, width)[starts[low:high] - first]
        rows[np.arange(width) >= np.diff(starts[low:high + 1])[:, None]] = 0  # the next keys' bytes
        return rows.reshape(-1).view(dtype)

    return Column("key", dtype, keys)
