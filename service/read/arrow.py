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

from collections.abc import Callable, Sequence
from functools import cached_property, lru_cache

import numpy as np

from shardfeed.arrowipc import (
    ALIGNMENT, END_OF_STREAM, BodyLayout, batch_schema, record_batch_message, record_batch_message_length,
    validity_bitmap,
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
    return encapsulated_schema(batch_schema(fields).serialize().to_pybytes())


@lru_cache(maxsize=1024)
def _column_order(dataset_fields: tuple[str, ...], fields: tuple[str, ...], stored: bytes) -> np.ndarray | slice | None:
    """``ArrowFraming.order``, remembered: a dataset's samples have one or a few member orders."""
    codes = np.frombuffer(stored, np.int32)
    columns = np.array([fields.index(dataset_fields[c]) if dataset_fields[c] in fields else -1 for c in codes])
    order = np.argsort(columns)
    if (columns[order] != np.arange(len(fields))).any():
        return None
    return slice(None) if (order == np.arange(len(order))).all() else order


class _Group:
    """Where a group's values lie, sample by field: each cell's member row (-1: null) and size."""

    def __init__(self, framing: ArrowFraming, dataset: Dataset, members: Members, indices: np.ndarray,
                 failed: dict[int, object]):
        positions = members.position
        self.first = first = int(positions[0]) if len(positions) else 0
        self.rows = n = int(positions[-1]) - first + 1 if len(positions) else 0
        self.indices = indices[first:first + n]
        self.key_offsets, self.key_text = dataset.index.key_bytes(self.indices)
        self.served = None  # every sample served; else a bool per row
        columns = len(framing.fields)
        if not failed and len(members) == n * columns and self._uniform(framing, members, n, columns):
            return
        if failed:
            self.served = np.ones(n, bool)
            self.served[[p - first for p in failed if 0 <= p - first < n]] = False
        local = positions - first
        column = framing.column_of[members.field]
        kept = members.found & (column >= 0)
        if self.served is not None:
            kept &= self.served[local]
        self.member = np.full((n, columns), -1, np.int64)
        self.member[local[kept], column[kept]] = np.flatnonzero(kept)
        self.size = np.zeros(self.member.shape, np.int64)
        self.size[local[kept], column[kept]] = members.size[kept]

    @property
    def samples_served(self) -> int:
        return self.rows if self.served is None else int(self.served.sum())

    def _uniform(self, framing: ArrowFraming, members: Members, n: int, columns: int) -> bool:
        """The usual group: every sample has each column's member, in the same order; its cells are
        then a reshape of the rows (no scatter). Whether it is one."""
        if not n or not members.found.all():
            return False
        field = members.field.reshape(n, columns)
        if not (field == field[0]).all():
            return False
        order = framing.order(field[0])
        if order is None:
            return False
        self.member = np.arange(n * columns, dtype=np.int64).reshape(n, columns)
        self.size = members.size.reshape(n, columns)
        if not isinstance(order, slice):
            self.member, self.size = self.member[:, order], self.size[:, order]
        return True

    @cached_property
    def buffers(self) -> tuple[np.ndarray, list]:
        """The record batch's nodes ((rows, nulls) per column) and buffers, each as its bytes or as
        ``(bytes, member rows)`` for a field's values (sent from their blocks or payloads)."""
        n, served = self.rows, self.served
        keys = [memoryview(self.key_offsets.astype("<i8", copy=False)).cast("B"), memoryview(self.key_text)]
        index = self.indices.astype("<i8", copy=False)
        nodes = np.zeros((2 + self.member.shape[1], 2), np.int64)
        nodes[:, 0] = n
        out: list = [b"" if served is None else validity_bitmap(served), *keys, b"", memoryview(index).cast("B")]
        if served is not None:
            nodes[0, 1] = n - int(served.sum())
        ends = np.zeros((self.member.shape[1], n + 1), "<i8")  # each column's offsets, one row each
        np.cumsum(self.size.T, axis=1, out=ends[:, 1:])
        present = self.member >= 0
        everywhere = present.all(axis=0)
        for c, whole in enumerate(everywhere.tolist()):
            if whole:
                out += [b"", memoryview(ends[c]).cast("B"), (int(ends[c, -1]), self.member[:, c])]
                continue
            valid = present[:, c]
            nodes[2 + c, 1] = n - int(valid.sum())
            out += [validity_bitmap(valid), memoryview(ends[c]).cast("B"), (int(ends[c, -1]), self.member[valid, c])]
        return nodes, out


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
        self._laid_out: dict[tuple[int, int], _Group] = {}  # by (first position, members): length's, for held
        self.dataset_fields = tuple(names)

    def head(self) -> list:
        return [self.schema]

    def order(self, stored: np.ndarray) -> np.ndarray | slice | None:
        """How a sample whose members come in the field order ``stored`` (codes) reads in column
        order: a slice when it already does, the permutation, or ``None`` when its members are not
        one per column."""
        return _column_order(self.dataset_fields, self.fields, stored.astype(np.int32, copy=False).tobytes())

    def end(self) -> bytes:
        return END_OF_STREAM

    def held(self, held: HeldGroup, base: int, dataset: Dataset, members: Members, indices: np.ndarray) -> list:
        """The record batch of a group of found members all held in RAM, whose rows start at ``base``."""
        group = self._group(dataset, members, indices, {})
        return self._record_batch(group, lambda rows: held.payloads(base + rows))

    def read(self, dataset: Dataset, members: Members, indices: np.ndarray, data: Callable[[int], Sequence],
             failed: dict[int, BaseException | None]) -> tuple[list, int]:
        """The record batch of a group member by member (``data(row)``: a member's payload as parts;
        ``failed``: positions of samples not served), and how many samples it served."""
        group = self._group(dataset, members, indices, failed)
        return self._record_batch(group, lambda rows: [p for row in rows.tolist() for p in data(row)]), \
            group.samples_served

    def _group(self, dataset: Dataset, members: Members, indices: np.ndarray, failed: dict) -> _Group:
        """The group's layout; the one ``length`` found for it, if it found one (nothing failed)."""
        first = int(members.position[0]) if len(members) else 0
        made = self._laid_out.pop((first, len(members)), None)
        return made if made is not None and not failed else _Group(self, dataset, members, indices, failed)

    def _record_batch(self, group: _Group, payloads: Callable[[np.ndarray], list]) -> list:
        nodes, buffers = group.buffers
        body = BodyLayout.of([_length(b) for b in buffers])
        out = [record_batch_message(group.rows, nodes, body)]
        for buffer, gap in zip(buffers, body.gaps):
            if isinstance(buffer, tuple):
                out += payloads(buffer[1])
            elif buffer:
                out.append(buffer)
            if gap:
                out.append(_GAPS[gap])
        return out

    def length(self, dataset: Dataset, members: Members, indices: np.ndarray, held: HeldGroup | None,
               groups: list[tuple[int, int]]) -> int:
        """The stream's length if every sample is served as the index describes it (exact when
        ``held``: nothing can fail), the groups cut as ``groups`` (member row ranges)."""
        unfound = {} if members.found.all() else \
            {int(p): None for p in np.unique(members.position[~members.found]).tolist()}
        total = len(self.schema) + len(END_OF_STREAM)
        for lo, hi in groups:
            group = members if hi - lo == len(members) else take(members, slice(lo, hi))
            laid_out = _Group(self, dataset, group, indices, unfound)
            if not unfound:
                self._laid_out[(int(group.position[0]) if len(group) else 0, len(group))] = laid_out
            nodes, buffers = laid_out.buffers
            total += record_batch_message_length(len(nodes), len(buffers))
            total += BodyLayout.of([_length(b) for b in buffers]).length
        return total
