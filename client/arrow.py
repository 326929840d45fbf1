"""Batches as Arrow tables: ``client.get_batch_arrow("train", [17, 4, 9])``, zero-copy.

The answer is asked for as an Arrow IPC stream (``"format": "arrow"``) and read whole into
one buffer (:mod:`.answers`); ``pyarrow.ipc.open_stream`` over that buffer makes the table
without copying a byte of it, so the table's columns are views of what the socket wrote. The
table has one row per sample asked for, in order: ``__key__`` (large_utf8, null for a sample
the service could not serve, with ``continue_on_error``), ``__index__`` (int64), then one
large_binary column per field (null where a sample lacks it).

A batch read in parts (routing: one request per owner) is one table per part; the batch is
their rows in the order asked for, as a ``pyarrow.Table`` whose columns are chunked: one chunk
per run of consecutive rows from one part, each a zero-copy slice of that part's table (a
batch whose samples alternate between owners has many small chunks;
``table.combine_chunks()`` makes one, with a copy). A service that predates the format answers
tar: the table is then built from it, with a copy of every sample's bytes.

pyarrow is not a dependency of the bare client; it is imported when first used. Polars reads
a large_binary column by copying it into its own binary views: :func:`as_binary_views` casts
the columns first (the views point into the same buffer), so ``polars.from_arrow`` copies no
sample bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from .answers import Regions
from .base import ARROW
from .layout import ABSENT, INDEX, KEY, Columns

if TYPE_CHECKING:
    import pyarrow as pa

    from .base import PartRequest


def pyarrow() -> Any:
    """The ``pyarrow`` module, or an ImportError saying how to get it."""
    try:
        import pyarrow
        import pyarrow.ipc  # noqa: F401  (the stream reader)
    except ImportError:
        raise ImportError("Arrow batches (get_batch_arrow, output='arrow') need pyarrow: "
                          "pip install pyarrow") from None
    return pyarrow


def table_of(requests: Sequence[PartRequest], regions: Regions) -> pa.Table:
    """The batch of the parts' answers read into ``regions``, as one table in the order asked."""
    pa = pyarrow()
    buffer, _, starts = regions.joined()
    whole = pa.py_buffer(buffer)  # holds the array: the table keeps its memory alive
    tables = []
    for request, region, start in zip(requests, regions.regions, starts.tolist()):
        columns = request.columns(region.data())  # checks the answer: whole, the samples asked for
        if request.answer_format == ARROW:
            tables.append(pa.ipc.open_stream(whole.slice(start, region.filled)).read_all())
        else:
            tables.append(_copied(pa, columns, region.data()))
    if not tables:
        return _schema(pa, []).empty_table()
    return in_order(tables, [r.part.positions for r in requests])


def in_order(tables: list[pa.Table], positions: Sequence[Sequence[int]]) -> pa.Table:
    """The rows of each part's table (``tables[p]``'s row ``r`` at ``positions[p][r]`` of the batch)
    in batch order: a zero-copy slice of a part's table per run of its consecutive rows."""
    pa = pyarrow()
    if len(tables) == 1:
        return tables[0]
    n = sum(len(p) for p in positions)
    part, row = np.empty(n, np.int64), np.empty(n, np.int64)
    for number, rows in enumerate(positions):
        part[rows], row[rows] = number, np.arange(len(rows))
    breaks = np.flatnonzero((part[1:] != part[:-1]) | (row[1:] != row[:-1] + 1)) + 1
    firsts, ends = np.concatenate([[0], breaks]), np.concatenate([breaks, [n]])
    runs = [tables[part[a]].slice(row[a], b - a) for a, b in zip(firsts.tolist(), ends.tolist())]
    return pa.concat_tables(runs, promote_options="default")


def _copied(pa: Any, columns: Columns, body: memoryview) -> pa.Table:
    """The table of a tar answer's ``columns`` (offsets in ``body``): each sample's bytes copied."""
    fields = {name: pa.array([None if length == ABSENT else bytes(body[start:start + length])
                              for start, length in zip(columns.offsets[name].tolist(), lengths.tolist())],
                             pa.large_binary())
              for name, lengths in columns.lengths.items()}
    return pa.table({KEY: pa.array(columns.keys, pa.large_utf8()), INDEX: pa.array(columns.indices, pa.int64()),
                     **fields}, schema=_schema(pa, list(fields)))


def _schema(pa: Any, fields: list[str]) -> pa.Schema:
    """The schema of an Arrow answer with ``fields``."""
    return pa.schema([pa.field(KEY, pa.large_utf8()), pa.field(INDEX, pa.int64(), nullable=False),
                      *(pa.field(name, pa.large_binary()) for name in fields)])


def as_binary_views(table: pa.Table) -> pa.Table:
    """``table`` with its binary columns as ``binary_view``: the views point into the same
    buffers, no sample bytes copied; ``polars.from_arrow`` then takes them as they are."""
    pa = pyarrow()
    schema = pa.schema([f.with_type(pa.binary_view()) if pa.types.is_large_binary(f.type) else f
                        for f in table.schema])
    return table.cast(schema)
