"""Arrow tables across DataLoader workers: read into a pooled shared-memory segment, sent as its name.

``output="arrow"`` in a DataLoader worker reads each batch's answers into a segment of the
worker's pool (:mod:`.shm`), as the tensor output does, and makes the table over it
(:func:`.arrow.laid_out`). pyarrow's own pickling of a table writes every byte of it; the
reducer registered here for ``pyarrow.Table`` sends such a table as the segment's name, the
answers' places in it and the rows' order instead, and the training process makes the same
table again over the segment, mapped (:func:`.arrow.over`): no sample byte crosses the pipe.
Any other table (not over a segment, sent before, or built from a tar answer) pickles as
pyarrow pickles it. Importing this module registers the reducer (and hands a DataLoader batch's
table on through ``default_collate`` as it is); it needs torch (the pool) and pyarrow.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from multiprocessing.reduction import ForkingPickler
from typing import TYPE_CHECKING

from torch.utils.data._utils.collate import default_collate_fn_map

from . import shm
from .arrow import laid_out, over, pyarrow
from .tensors import allocator, one_batch

if TYPE_CHECKING:
    import pyarrow as pa

    from .answers import Regions
    from .base import PartRequest

_pooled: dict[int, tuple[shm.Lease, list[tuple[int, int]], list[list[int]]]] = {}
"""The tables over a pooled segment made here, by ``id`` (an entry goes with its table): the
segment's lease, where the answers lie in it and each part's rows."""

allocate = allocator(shared=True)
"""Where the answers are read: the pool's segments (:func:`.tensors.allocator`)."""


def shared_table_of(requests: Sequence[PartRequest], regions: Regions) -> pa.Table:
    """:func:`.arrow.table_of` over a pooled segment (read with :data:`allocate`), noted so that
    pickling it sends the segment's name."""
    buffer, (_, lease), starts = regions.joined()
    table, spans = laid_out(buffer, requests, regions, starts)
    if lease is not None and spans is not None:
        key = id(table)
        _pooled[key] = (lease, spans, [list(r.part.positions) for r in requests])
        weakref.finalize(table, _pooled.pop, key, None)
    return table


def _reduce(table: pa.Table) -> tuple:
    entry = _pooled.get(id(table))
    found = shm.reduce(entry[0]) if entry is not None else None
    if found is None:
        return table.__reduce__()
    return _attached, (*found, entry[1], entry[2])


def _attached(path: str, size: int, spans: list[tuple[int, int]], positions: Sequence[Sequence[int]]) -> pa.Table:
    """A table received from another process, over the pooled segment at ``path``."""
    return over(shm.attach(path, size).numpy(), spans, positions)


ForkingPickler.register(pyarrow().Table, _reduce)
default_collate_fn_map[pyarrow().Table] = one_batch
