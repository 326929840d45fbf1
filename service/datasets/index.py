"""The dataset index: ``index.parquet`` on disk (``indexfile.py``), compact numpy arrays in memory.

Layout ``tar`` (the default): members
are files inside tar shards, and a sample lies in one shard. Layout ``objects``: every
member is a whole object (the "shard", offset 0), and a sample's objects share its key.

In memory there is no Python object per row: members are stored sorted by sample, in
their stored order within a sample, as narrow numpy arrays (field and shard as codes
into sorted lists, offsets and sizes as int32 where they fit), plus one member
start per sample and the keys as one Arrow string array. That is roughly 12 bytes per
member plus 4 bytes and the key per sample: 42 bytes a sample with two fields and 10-byte
keys. A service maps these arrays from one file per host (``mapped.py``), so that is all
its workers hold together (``python -m shardfeed.benchmarks.scale``).
"""

from __future__ import annotations

from functools import cached_property

import asyncio
from bisect import bisect_left
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from shardfeed.service.datasets.indexfile import (
    INDEX_FILE, LAYOUT_KEY, ROWS_KEY, SCHEMA, VERSION, VERSION_KEY, IndexFormatError, IndexStats, first_row,
    index_columns,
)
from shardfeed.service.stores import ObjectInfo, ObjectNotFound, Store
from shardfeed.sizes import format_size


class SampleOutOfRange(LookupError):
    """A sample index is negative or not below the number of samples."""


class UnknownField(LookupError):
    """A requested field does not occur anywhere in the dataset."""


@dataclass
class Members:
    """The result of ``Index.lookup``: one entry per requested member, all arrays of equal length."""

    position: np.ndarray  # int64: index into the request's ``indices``
    sample: np.ndarray  # int64: the sample number
    field: np.ndarray  # int32: code into ``Index.fields``
    shard: np.ndarray  # int32: code into ``Index.shards``; -1 where not found
    offset: np.ndarray  # int64: data offset in the shard; 0 where not found
    size: np.ndarray  # int64: data size; 0 where not found
    found: np.ndarray  # bool: False for a field the dataset has but this sample lacks
    row: np.ndarray  # int64: the member's row in the index (``Index.members``); -1 where not found or not indexed

    def __len__(self) -> int:
        return len(self.position)


class Index:
    """Sample -> (shard, offset, size) for every member of a dataset. Build with ``from_table`` or
    ``load_index``; ``mapped.py`` maps one from a file that a host's processes share."""

    shards: list[str]
    fields: list[str]
    total_bytes: int

    def __init__(self, *, keys: pa.Array, starts: np.ndarray, shard: np.ndarray,
                 field: np.ndarray, offset: np.ndarray, size: np.ndarray,
                 shards: list[str], fields: list[str], layout: str = "tar", records: bool = False,
                 stats: IndexStats | None = None):
        # Internal: callers use from_table(), which validates.
        self.layout = layout
        self.records = records
        """Its rows hold their records' extents, not their fields' (``indexfile.ROWS_KEY``)."""
        self._keys = keys
        self._starts = starts
        self._shard = shard
        self._field = field
        self._offset = offset
        self._size = size
        self.shards = shards
        self.fields = fields
        self._field_code = {name: code for code, name in enumerate(fields)}
        self.stats = stats or IndexStats.of(starts, shard, offset, size, len(shards))
        self._per_sample = self.stats.per_sample
        """``lookup`` finds a batch's rows with half the numpy calls when every sample has as
        many members."""
        self.total_bytes = self.stats.total_bytes

    def __len__(self) -> int:
        return len(self._starts) - 1

    @property
    def members(self) -> int:
        """Number of members (rows of ``index.parquet``)."""
        return len(self._field)

    def arrays(self) -> dict[str, np.ndarray | pa.Array]:
        """The per-sample and per-member arrays, by name (what ``mapped.py`` writes)."""
        return {"keys": self._keys, "starts": self._starts, "shard": self._shard, "field": self._field,
                "offset": self._offset, "size": self._size}

    @property
    def nbytes(self) -> int:
        """Memory held by the index arrays, in bytes."""
        return sum(a.nbytes for a in self.arrays().values())

    def shard_samples(self) -> int:
        """Samples in a typical shard (the median count): what locality shuffles cut by."""
        return self.stats.shard_samples

    def shard_extents(self) -> np.ndarray:
        """int64 per shard: the end offset of its last member's data (0 for none)."""
        return self.stats.extents

    def shard_runs(self) -> tuple[np.ndarray, np.ndarray]:
        """The first sample of each run of consecutive samples in one shard, and that shard's code
        (one run per shard when samples are numbered shard by shard, as ``tarscan.py`` does)."""
        return self.stats.run_starts, self.stats.run_shards

    def sample_extents(self, chunk: int = 1 << 22) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per sample: its first member's shard code (int32), and where its members' data
        starts and ends in it (int64; the lowest offset and the highest end), ``chunk`` samples
        at a time so that no per-member temporary outgrows a chunk."""
        n = len(self)
        shard = np.empty(n, np.int32)
        start = np.empty(n, np.int64)
        end = np.empty(n, np.int64)
        for low in range(0, n, chunk):
            high = min(n, low + chunk)
            first, last = int(self._starts[low]), int(self._starts[high])
            bounds = self._starts[low:high] - first
            shard[low:high] = self._shard[self._starts[low:high]]
            start[low:high] = np.minimum.reduceat(self._offset[first:last], bounds)
            end[low:high] = np.maximum.reduceat(self._offset[first:last].astype(np.int64)
                                                + self._size[first:last], bounds)
        return shard, start, end

    def summary(self) -> str:
        """One line for CLI output: samples, members, fields, shards, bytes."""
        def count(n: int, noun: str) -> str:
            return f"{n} {noun}{'' if n == 1 else 's'}"

        return (f"{count(len(self), 'sample')} ({count(self.members, 'member')}, fields {', '.join(self.fields)})"
                f" in {count(len(self.shards), 'shard')}, {format_size(self.total_bytes)}")

    def _check(self, i: int) -> int:
        n = len(self)
        if not 0 <= i < n:
            raise SampleOutOfRange(f"sample {i} out of range (dataset has {n} samples)")
        return i

    def key(self, i: int) -> str:
        """The WebDataset key of sample ``i``."""
        return self._keys[self._check(int(i))].as_py()

    def keys(self, indices: np.ndarray) -> list[str]:
        """The keys of many samples at once (indices already validated)."""
        return self.key_array(indices).to_pylist()

    def key_array(self, indices: np.ndarray) -> pa.Array:
        """The keys of many samples as an Arrow string array (indices already validated)."""
        return self._keys.take(pa.array(indices, pa.int64()))

    def key_bytes(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The keys of many samples as one UTF-8 text and the 64-bit offsets of each in it (from 0,
        ``len(indices) + 1`` of them): gathered with numpy from the key column's own buffers, for
        a batch's few dozen keys several times quicker than ``take``."""
        starts, text = self.key_buffers
        first, last = starts[indices], starts[indices + 1]
        lengths = last - first
        offsets = np.zeros(len(indices) + 1, np.int64)
        np.cumsum(lengths, out=offsets[1:])
        return offsets, text[np.repeat(first - offsets[:-1], lengths) + np.arange(int(offsets[-1]))]

    @cached_property
    def key_buffers(self) -> tuple[np.ndarray, np.ndarray]:
        """The key column's offsets (int64, one per sample and one past the last) and text (uint8):
        sample ``i``'s key is ``text[offsets[i]:offsets[i + 1]]``, UTF-8."""
        keys = self._keys
        width = 8 if pa.types.is_large_string(keys.type) else 4
        _, offsets, text = keys.buffers()
        starts = np.frombuffer(offsets, f"<i{width}", len(keys) + 1, keys.offset * width).astype(np.int64)
        return starts, np.frombuffer(text, np.uint8) if text is not None else np.zeros(0, np.uint8)

    def first_rows(self, samples: np.ndarray) -> np.ndarray:
        """The row of each sample's first member (its members' rows follow it)."""
        return self._starts[samples]

    def sample_fields(self, i: int) -> list[str]:
        """The fields of sample ``i`` in stored member order."""
        i = self._check(int(i))
        return [self.fields[c] for c in self._field[self._starts[i]:self._starts[i + 1]]]

    def shard_members(self, shard: str) -> dict[str, tuple[int, int, int]]:
        """``{"<key>.<field>": (offset, size, row)}`` of every member of one shard (empty if unknown)."""
        code = self.shard_code(shard)
        if code is None:
            return {}
        rows = np.flatnonzero(self._shard == code)
        owner = np.searchsorted(self._starts, rows, side="right") - 1
        keys = self._keys.take(pa.array(owner, pa.int64())).to_pylist()
        return {f"{key}.{self.fields[f]}": (o, z, r) for key, f, o, z, r in
                zip(keys, self._field[rows].tolist(), self._offset[rows].tolist(), self._size[rows].tolist(),
                    rows.tolist())}

    def row_samples(self, rows: np.ndarray) -> np.ndarray:
        """The sample of each member row."""
        return np.searchsorted(self._starts, rows, side="right") - 1

    def shard_code(self, shard: str) -> int | None:
        """The code of a shard path, ``None`` if the dataset has no such shard."""
        code = bisect_left(self.shards, shard)
        return code if code < len(self.shards) and self.shards[code] == shard else None

    def member(self, i: int, field: str) -> tuple[int, int, int] | None:
        """``(shard code, offset, size)`` of one member of sample ``i`` (already validated), without
        numpy's per-call overhead: ``None`` if the sample has no such field."""
        code = self._field_code.get(field)
        if code is None:
            return None
        starts = self._starts
        for row in range(int(starts[i]), int(starts[i + 1])):
            if self._field[row] == code:
                return int(self._shard[row]), int(self._offset[row]), int(self._size[row])
        return None

    def field_codes(self, fields: Sequence[str]) -> np.ndarray:
        """Codes into ``self.fields``; ``UnknownField`` for a name the dataset lacks."""
        try:
            return np.array([self._field_code[f] for f in fields], dtype=np.int32)
        except KeyError as err:
            raise UnknownField(
                f"unknown field {err.args[0]!r} (dataset has: {', '.join(self.fields)})") from None

    def lookup(self, indices: np.ndarray | Sequence[int],
               fields: Sequence[str] | None = None) -> Members:
        """Locate the members of ``indices`` (any order, repeats allowed), vectorised.

        Rows come in request order (``position``), then in ``fields`` order when given,
        else in each sample's stored member order. A field the dataset has but a sample
        lacks gives a row with ``found=False``. Raises ``SampleOutOfRange`` for the
        first index outside ``0..len-1`` and ``UnknownField`` for a field not in
        ``self.fields``.
        """
        if isinstance(fields, str):
            raise TypeError(f"fields must be a sequence of field names, not the string {fields!r}")
        idx = np.asarray(indices).reshape(-1)
        if idx.size and idx.dtype.kind not in "iu":
            raise TypeError(f"sample indices must be integers, not {idx.dtype}")
        n = len(self)
        bad = (idx < 0) | (idx >= n)
        if bad.any():
            raise SampleOutOfRange(
                f"sample {int(idx[first_row(bad)])} out of range (dataset has {n} samples)")
        idx = idx.astype(np.int64)
        codes = None if fields is None else self.field_codes(fields)

        # Every member of every requested sample, in request then stored order.
        per_sample = self._per_sample
        if per_sample:  # as many members in every sample: k rows from each sample's first
            owner = np.repeat(np.arange(len(idx)), per_sample)
            member = (self._starts[idx][:, None] + np.arange(per_sample, dtype=np.int64)).reshape(-1)
            total = len(member)
        else:
            start = self._starts[idx].astype(np.int64)
            count = self._starts[idx + 1] - start
            total = int(count.sum())
            owner = np.repeat(np.arange(len(idx)), count)
            member = np.arange(total, dtype=np.int64) + np.repeat(start - (np.cumsum(count) - count), count)

        if codes is None:  # every member of every sample: all found, nothing to mask
            return Members(position=owner, sample=idx[owner],
                           field=self._field[member].astype(np.int32, copy=False),
                           shard=self._shard[member].astype(np.int32, copy=False),
                           offset=self._offset[member].astype(np.int64, copy=False),
                           size=self._size[member].astype(np.int64, copy=False),
                           found=np.ones(total, bool), row=member)
        # Scatter members into a (request x wanted-field) grid, then read it in fields order.
        wanted, column_of_wanted = np.unique(codes, return_inverse=True)
        column = np.full(len(self.fields), -1, np.int64)
        column[wanted] = np.arange(len(wanted))
        col = column[self._field[member]]
        keep = col >= 0
        grid = np.full((len(idx), len(wanted)), -1, np.int64)
        grid[owner[keep], col[keep]] = member[keep]
        member = grid[:, column_of_wanted].reshape(-1)
        position = np.repeat(np.arange(len(idx)), len(codes))
        found = member >= 0
        sample = idx[position]
        safe = np.where(found, member, 0)
        return Members(
            position=position.astype(np.int64),
            sample=sample,
            field=np.tile(codes, len(idx)),
            shard=np.where(found, self._shard[safe], -1).astype(np.int32),
            offset=np.where(found, self._offset[safe], 0).astype(np.int64),
            size=np.where(found, self._size[safe], 0).astype(np.int64),
            found=found,
            row=np.where(found, member, -1),
        )

    @classmethod
    def from_table(cls, table: pa.Table) -> "Index":
        """Validate an index table (any row order) and load it; ``IndexFormatError`` names what is wrong."""
        return cls(**index_columns(table))

    def to_table(self) -> pa.Table:
        """The index as an ``index.parquet`` table (one row per member, schema ``SCHEMA``)."""
        counts = np.diff(self._starts)
        sample = np.repeat(np.arange(len(self), dtype=np.int64), counts)
        return pa.table(
            {
                "sample": sample,
                "key": self._keys.take(pa.array(sample)).cast(pa.string()),
                "field": pa.DictionaryArray.from_arrays(self._field.astype(np.int32), self.fields)
                                          .cast(pa.string()),
                "shard": pa.DictionaryArray.from_arrays(self._shard.astype(np.int32), self.shards)
                                          .cast(pa.string()),
                "offset": self._offset.astype(np.int64),
                "size": self._size.astype(np.int64),
            },
            schema=SCHEMA.with_metadata({VERSION_KEY: VERSION, LAYOUT_KEY: self.layout.encode(),
                                         ROWS_KEY: b"records" if self.records else b"fields"}),
        )


def parquet_bytes(table: pa.Table) -> bytes:
    """Serialise an index table as ``index.parquet`` bytes (sorted columns delta-encoded, zstd)."""
    table = table.replace_schema_metadata({**(table.schema.metadata or {}), VERSION_KEY: VERSION})
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, compression="zstd",
                   use_dictionary=["field", "shard"],
                   column_encoding={"sample": "DELTA_BINARY_PACKED", "key": "DELTA_BYTE_ARRAY",
                                    "offset": "DELTA_BINARY_PACKED", "size": "DELTA_BINARY_PACKED"})
    return sink.getvalue().to_pybytes()


def index_from_parquet(data: bytes, name: str = INDEX_FILE) -> Index:
    """Parse ``index.parquet`` bytes; ``IndexFormatError`` naming ``name`` if they are not a valid index."""
    try:
        table = pq.read_table(pa.BufferReader(data), read_dictionary=["field", "shard"])
    except (pa.ArrowException, OSError) as err:
        raise IndexFormatError(f"{name}: not a valid parquet file ({err})") from None
    if (table.schema.metadata or {}).get(VERSION_KEY) is None:
        raise IndexFormatError(f"{name}: not a shardfeed index (no {VERSION_KEY.decode()} metadata)")
    try:
        return Index.from_table(table)
    except IndexFormatError as err:
        raise IndexFormatError(f"{name}: {err}") from None
    finally:
        del table
        pa.default_memory_pool().release_unused()  # hand the decode buffers back to the OS


Share = Callable[[str, str, Callable[[], Awaitable[Index]]], Awaitable[Index]]
"""How an index read from a store is kept for the host's other processes (``mapped.py``'s
``SharedIndexes.share``): called with the dataset URL, the version read, and how to build it."""


def index_version(info: ObjectInfo) -> str:
    """The name a ``Share`` knows an ``index.parquet`` version by."""
    return f"{info.etag}\0{info.size}"


async def unshared(url: str, version: str, build: Callable[[], Awaitable[Index]]) -> Index:
    """The ``Share`` of a process on its own: it builds every index it opens."""
    return await build()


async def load_index(store: Store) -> Index:
    """Read and validate ``index.parquet`` at the store root (parsing runs in a thread)."""
    return (await read_index(store))[0]


async def read_index(store: Store, share: Share = unshared) -> tuple[Index, ObjectInfo]:
    """``load_index``, and the version read: the one its HEAD names, which the read asks for
    (``ObjectChanged`` if the index was replaced in between); ``share`` may find it already read."""
    async def parse() -> Index:
        data = await store.read(INDEX_FILE, info.etag)
        return await asyncio.to_thread(index_from_parquet, data, f"{store.url}/{INDEX_FILE}")

    try:
        info = await store.head(INDEX_FILE)
        return await share(store.url, index_version(info), parse), info
    except ObjectNotFound as err:
        raise ObjectNotFound(f"{err} (create it with `shardfeed index {store.url}`)") from None


async def write_index(store: Store, table_or_index: pa.Table | Index) -> None:
    """Write ``index.parquet`` atomically. Call it last, after every shard is in place."""
    def encode() -> bytes:
        table = table_or_index.to_table() if isinstance(table_or_index, Index) else table_or_index
        return parquet_bytes(table)

    await store.write(INDEX_FILE, await asyncio.to_thread(encode))
