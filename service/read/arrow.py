"""Arrow framing of a batch (``"format": "arrow"``): an Arrow IPC stream, a record batch per group.

The tar framing's sibling (``framing.py``), with the same three entry points, so ``stream.py``
sends either without knowing which:

    head      the schema: ``__key__`` (large_utf8), ``__index__`` (int64), then a ``large_binary``
              column per field (the fields asked for, in order, or every field of the dataset)
    held      a group whose blocks are all in RAM
    read      a group read through the coalescer, some of its samples perhaps failed

A group is one record batch, a row per sample. Its metadata (each buffer's offset and length)
is written from the index's sizes ahead of the data (``shardfeed/arrowipc.py``), then each
column's values go out as the same block views or payloads the tar path sends, a field's
members back to back: nothing is copied here. A sample that could not be served
(``continue_on_error``) is a null in every column but ``__index__``; a sample that lacks a
field (every field asked for implicitly) is a null in that column only.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache

import numpy as np
import pyarrow as pa

from shardfeed.arrowipc import (
    ALIGNMENT, END_OF_STREAM, BodyLayout, record_batch_message, record_batch_message_length, validity_bitmap,
)
from shardfeed.arrowipc import schema_message as encapsulated_schema
from shardfeed.service.datasets.dataset import Dataset
from shardfeed.service.datasets.index import Members
from shardfeed.service.read.planner import take
from shardfeed.service.read.warm import HeldGroup

_GAPS = [bytes(n) for n in range(ALIGNMENT)]
"""Padding after a buffer, by its length."""


@lru_cache(maxsize=256)
def schema_message(fields: tuple[str, ...]) -> bytes:
    """The stream's schema message for a batch of ``fields``."""
    schema = pa.schema([pa.field("__key__", pa.large_utf8()), pa.field("__index__", pa.int64(), nullable=False),
                        *(pa.field(name, pa.large_binary()) for name in fields)])
    return encapsulated_schema(schema.serialize().to_pybytes())


class _Group:
    """Where a group's values lie, sample by field: each cell's member row (-1: null) and size."""

    def __init__(self, framing: ArrowFraming, dataset: Dataset, members: Members, indices: np.ndarray,
                 failed: dict[int, object]):
        positions = members.position
        self.first = int(positions[0]) if len(positions) else 0
        self.rows = n = int(positions[-1]) - self.first + 1 if len(positions) else 0
        self.served = np.ones(n, bool)
        self.served[[p - self.first for p in failed if 0 <= p - self.first < n]] = False
        local = positions - self.first
        column = framing.column_of[members.field]
        kept = members.found & self.served[local] & (column >= 0)
        self.member = np.full((n, len(framing.fields)), -1, np.int64)
        self.member[local[kept], column[kept]] = np.flatnonzero(kept)
        self.size = np.zeros(self.member.shape, np.int64)
        self.size[local[kept], column[kept]] = members.size[kept]
        keys = dataset.index.key_array(indices[self.first:self.first + n]).cast(pa.large_utf8())
        offsets = np.frombuffer(keys.buffers()[1], np.int64, n + 1, keys.offset * 8) if n else np.zeros(1, np.int64)
        self.key_offsets = offsets - offsets[0]
        self.key_data = memoryview(keys.buffers()[2] or b"")[int(offsets[0]):int(offsets[-1])]
        self.indices = indices[self.first:self.first + n]

    def buffers(self) -> tuple[np.ndarray, list]:
        """The record batch's nodes ((rows, nulls) per column) and buffers, each as its bytes or as
        ``(column, member rows)`` for a field's values (sent from their blocks or payloads)."""
        n = self.rows
        served = self.served.all()
        nodes = [(n, n - int(self.served.sum())), (n, 0)]
        out: list = [b"" if served else validity_bitmap(self.served), self.key_offsets.tobytes(),
                     self.key_data, b"", self.indices.astype("<i8").tobytes()]
        present = self.member >= 0
        for c in range(self.member.shape[1]):
            valid = present[:, c]
            everywhere = valid.all()
            nodes.append((n, 0 if everywhere else n - int(valid.sum())))
            offsets = np.zeros(n + 1, "<i8")
            np.cumsum(self.size[:, c], out=offsets[1:])
            out += [b"" if everywhere else validity_bitmap(valid), offsets.tobytes(),
                    (int(offsets[-1]), self.member[valid, c])]
        return np.array(nodes, np.int64), out


def _length(buffer) -> int:
    return buffer[0] if isinstance(buffer, tuple) else len(buffer)


class ArrowFraming:
    """A batch as an Arrow IPC stream (``"format": "arrow"``), for ``dataset`` and the ``fields``
    asked for (``None``: all; a name asked twice is one column)."""

    def __init__(self, dataset: Dataset, fields: list[str] | None):
        names = dataset.index.fields
        self.fields = tuple(dict.fromkeys(fields)) if fields is not None else tuple(names)
        self.column_of = np.full(len(names), -1, np.int64)
        self.column_of[dataset.index.field_codes(self.fields)] = np.arange(len(self.fields))
        self.schema = schema_message(self.fields)

    def head(self) -> list:
        return [self.schema]

    def end(self) -> bytes:
        return END_OF_STREAM

    def held(self, held: HeldGroup, base: int, dataset: Dataset, members: Members, indices: np.ndarray) -> list:
        """The record batch of a group of found members all held in RAM, whose rows start at ``base``."""
        return self._record_batch(_Group(self, dataset, members, indices, {}), lambda row: held.data(base + row))

    def read(self, dataset: Dataset, members: Members, indices: np.ndarray, data: Callable[[int], list],
             failed: dict[int, BaseException | None]) -> tuple[list, int]:
        """The record batch of a group member by member (``data(row)``: a member's payload as parts;
        ``failed``: positions of samples not served), and how many samples it served."""
        group = _Group(self, dataset, members, indices, failed)
        return self._record_batch(group, data), int(group.served.sum())

    def _record_batch(self, group: _Group, data: Callable[[int], list]) -> list:
        nodes, buffers = group.buffers()
        body = BodyLayout.of([_length(b) for b in buffers])
        out = [record_batch_message(group.rows, nodes, body)]
        for buffer, gap in zip(buffers, body.gaps()):
            if isinstance(buffer, tuple):
                for row in buffer[1].tolist():
                    out += data(row)
            elif buffer:
                out.append(buffer)
            if gap:
                out.append(_GAPS[gap])
        return out

    def length(self, dataset: Dataset, members: Members, indices: np.ndarray, held: HeldGroup | None,
               groups: list[tuple[int, int]]) -> int:
        """The stream's length if every sample is served as the index describes it (exact when
        ``held``: nothing can fail), the groups cut as ``groups`` (member row ranges)."""
        unfound = {int(p): None for p in np.unique(members.position[~members.found]).tolist()}
        total = len(self.schema) + len(END_OF_STREAM)
        for lo, hi in groups:
            group = members if hi - lo == len(members) else take(members, slice(lo, hi))
            nodes, buffers = _Group(self, dataset, group, indices, unfound).buffers()
            total += record_batch_message_length(len(nodes), len(buffers))
            total += BodyLayout.of([_length(b) for b in buffers]).length
        return total
