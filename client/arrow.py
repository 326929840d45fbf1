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

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from shardfeed.arrowipc import INDEX, KEY, batch_schema

from .answers import Allocate, Regions, plain
from .base import ARROW
from .layout import ABSENT, Columns

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


def reading(shared: bool) -> tuple[Allocate, Callable[[Sequence[PartRequest], Regions], pa.Table]]:
    """Where a table's answers are read and what makes the table of them: plain memory, or with
    ``shared`` a pooled shared-memory segment (:mod:`.arrowshared`, which needs torch). Raises the
    ImportError of :func:`pyarrow` before anything is asked."""
    pyarrow()
    if not shared:
        return plain, table_of
    from .arrowshared import allocate, shared_table_of
    return allocate, shared_table_of


def table_of(requests: Sequence[PartRequest], regions: Regions) -> pa.Table:
    """The batch of the parts' answers read into ``regions``, as one table in the order asked."""
    buffer, _, starts = regions.joined()
    return laid_out(buffer, requests, regions, starts)[0]


def laid_out(buffer: np.ndarray, requests: Sequence[PartRequest], regions: Regions,
             starts: np.ndarray) -> tuple[pa.Table, list[tuple[int, int]] | None]:
    """The table of the parts' answers, part ``p``'s at ``starts[p]`` in ``buffer``; and where each
    answer lies there (start, length) when the table lies wholly in ``buffer`` (every answer was
    Arrow: :func:`over` makes it again from these), else ``None``."""
    pa = pyarrow()
    if not requests:
        return batch_schema([]).empty_table(), None
    whole = pa.py_buffer(buffer)  # holds the array: the table keeps its memory alive
    tables, spans = [], []
    for request, region, start in zip(requests, regions.regions, starts.tolist()):
        columns = request.columns(region.data())  # checks the answer: whole, the samples asked for
        spans.append((start, region.filled))
        tables.append(_read(pa, whole, spans[-1]) if request.answer_format == ARROW
                      else _copied(pa, columns, region.data()))
    in_place = all(request.answer_format == ARROW for request in requests)
    return in_order(tables, [r.part.positions for r in requests]), spans if in_place else None


def over(buffer: np.ndarray, spans: Sequence[tuple[int, int]], positions: Sequence[Sequence[int]]) -> pa.Table:
    """The table of Arrow answers lying at ``spans`` of ``buffer`` (which it keeps alive), in the
    order ``positions`` say: no byte of them copied."""
    pa = pyarrow()
    whole = pa.py_buffer(buffer)
    return in_order([_read(pa, whole, span) for span in spans], positions)


def _read(pa: Any, whole: pa.Buffer, span: tuple[int, int]) -> pa.Table:
    """The table of the Arrow answer at ``span`` (start, length) of ``whole``, in place."""
    return pa.ipc.open_stream(whole.slice(*span)).read_all()


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
                     **fields}, schema=batch_schema(list(fields)))


def as_binary_views(table: pa.Table) -> pa.Table:
    """``table`` with its binary columns as ``binary_view``: the views point into the same
    buffers, no sample bytes copied; ``polars.from_arrow`` then takes them as they are."""
    pa = pyarrow()
    schema = pa.schema([f.with_type(pa.binary_view()) if pa.types.is_large_binary(f.type) else f
                        for f in table.schema])
    return table.cast(schema)
