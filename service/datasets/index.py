"""The dataset index: ``index.parquet`` on disk, compact numpy arrays in memory.

On disk (docs/architecture.md) the index has one row per member: ``sample`` (int64, dense
0..N-1), ``key``, ``field`` (lowercased), ``shard`` (path relative to the dataset
root), ``offset`` (of the member's data in the shard) and ``size``, with the format
version and the layout in the schema metadata. Layout ``tar`` (the default): members
are files inside tar shards, and a sample lies in one shard. Layout ``objects``: every
member is a whole object (the "shard", offset 0), and a sample's objects share its key.

In memory there is no Python object per row: members are stored sorted by sample, in
their stored order within a sample, as narrow numpy arrays (field and shard as codes
into sorted lists, offsets and sizes as int32 where they fit), plus one member
start per sample and the keys as one Arrow string array. That is roughly 12 bytes per
member plus 4 bytes and the key per sample, so a 10M-sample index with two fields per
sample stays well under 100 bytes per sample.
"""

from __future__ import annotations

import asyncio
from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from shardfeed.service.stores import ObjectNotFound, Store
from shardfeed.sizes import format_size

INDEX_FILE = "index.parquet"
VERSION_KEY = b"shardfeed.index.version"
VERSION = b"1"
LAYOUT_KEY = b"shardfeed.index.layout"
LAYOUTS = ("tar", "objects")

SCHEMA = pa.schema(
    [("sample", pa.int64()), ("key", pa.string()), ("field", pa.string()),
     ("shard", pa.string()), ("offset", pa.int64()), ("size", pa.int64())],
    metadata={VERSION_KEY: VERSION},
)


class IndexFormatError(ValueError):
    """An index, shard or source directory does not hold a valid dataset; the message names the culprit."""


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


def split_member_name(name: str) -> tuple[str, str] | None:
    """WebDataset naming: ``'a/b/0001.seg.PNG'`` -> ``('a/b/0001', 'seg.png')``.

    The key is the path up to the first dot of the file name (directories kept), the
    field the rest, lowercased. ``None`` for a name WebDataset cannot place in a
    sample: no extension, or a dot-file.
    """
    base = name.rpartition("/")[2]
    stem, dot, field = base.partition(".")
    if not stem or not field:
        return None
    return name[:len(name) - len(base)] + stem, field.lower()


def _narrow(values: np.ndarray) -> np.ndarray:
    """int32 when every (non-negative) value fits, else int64: halves the common case."""
    if len(values) == 0 or int(values.max()) < 2**31:
        return values.astype(np.int32)
    return values.astype(np.int64)


def _encode(column: pa.ChunkedArray) -> tuple[list[str], np.ndarray]:
    """Distinct values (sorted) and an int32 code per row, for a string or dictionary column."""
    if not pa.types.is_dictionary(column.type):
        values = sorted(pc.unique(column).to_pylist())
        codes = pc.index_in(column, value_set=pa.array(values, column.type))
        return values, np.asarray(codes.combine_chunks(), dtype=np.int32)
    # Parquet dictionary pages: recode the (unified) dictionary indices into sorted order.
    column = column.unify_dictionaries()
    dictionary = column.chunk(0).dictionary
    raw = np.concatenate([c.indices.to_numpy(zero_copy_only=False) for c in column.chunks])
    used = np.flatnonzero(np.bincount(raw, minlength=len(dictionary)))
    names = dictionary.take(pa.array(used)).to_pylist()
    order = sorted(range(len(names)), key=names.__getitem__)
    code_of = np.full(len(dictionary), -1, np.int32)
    code_of[used[order]] = np.arange(len(order), dtype=np.int32)
    return [names[i] for i in order], code_of[raw]


def _is_text(type_: pa.DataType) -> bool:
    if pa.types.is_dictionary(type_):
        type_ = type_.value_type
    return pa.types.is_string(type_) or pa.types.is_large_string(type_)


def _first_row(mask: np.ndarray) -> int:
    return int(np.flatnonzero(mask)[0])


class Index:
    """Sample -> (shard, offset, size) for every member of a dataset. Build with ``from_table`` or ``load_index``."""

    shards: list[str]
    fields: list[str]
    total_bytes: int

    def __init__(self, *, keys: pa.Array, starts: np.ndarray, shard: np.ndarray,
                 field: np.ndarray, offset: np.ndarray, size: np.ndarray,
                 shards: list[str], fields: list[str], layout: str = "tar"):
        # Internal: callers use from_table(), which validates.
        self.layout = layout
        self._keys = keys
        self._starts = starts
        self._shard = shard
        self._field = field
        self._offset = offset
        self._size = size
        self.shards = shards
        self.fields = fields
        self._field_code = {name: code for code, name in enumerate(fields)}
        counts = np.diff(starts)
        self._per_sample = int(counts[0]) if len(counts) and (counts == counts[0]).all() else 0
        """Members of every sample when all have as many (the usual dataset), else 0: ``lookup``
        then finds a batch's rows with half the numpy calls (about 4 us a batch)."""
        self.total_bytes = int(size.sum(dtype=np.int64))

    def __len__(self) -> int:
        return len(self._starts) - 1

    @property
    def members(self) -> int:
        """Number of members (rows of ``index.parquet``)."""
        return len(self._field)

    @property
    def nbytes(self) -> int:
        """Memory held by the index arrays, in bytes."""
        arrays = (self._starts, self._shard, self._field, self._offset, self._size)
        return sum(a.nbytes for a in arrays) + self._keys.nbytes

    def shard_samples(self) -> int:
        """Samples in a typical shard (the median count): what locality shuffles cut by."""
        if not len(self):
            return 0
        counts = np.bincount(self._shard[self._starts[:-1]])  # a sample's first member names its shard
        return int(np.median(counts[counts > 0]))

    def shard_extents(self) -> np.ndarray:
        """int64 per shard: the end offset of its last member's data (0 for none), vectorised."""
        ends = self._offset.astype(np.int64) + self._size
        extents = np.zeros(len(self.shards), np.int64)
        np.maximum.at(extents, self._shard, ends)
        return extents

    def shard_runs(self) -> tuple[np.ndarray, np.ndarray]:
        """The first sample of each run of consecutive samples in one shard, and that shard's code
        (one run per shard when samples are numbered shard by shard, as ``indexer.py`` does)."""
        if not len(self):
            return np.zeros(0, np.int64), np.zeros(0, np.int32)
        sample_shard = self._shard[self._starts[:-1]]  # a sample's first member names its shard
        starts = np.concatenate(([0], np.flatnonzero(np.diff(sample_shard)) + 1)).astype(np.int64)
        return starts, sample_shard[starts]

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
        return self._keys.take(pa.array(indices, pa.int64())).to_pylist()

    def sample_fields(self, i: int) -> list[str]:
        """The fields of sample ``i`` in stored member order."""
        i = self._check(int(i))
        return [self.fields[c] for c in self._field[self._starts[i]:self._starts[i + 1]]]

    def shard_members(self, shard: str) -> dict[str, tuple[int, int]]:
        """``{"<key>.<field>": (offset, size)}`` of every member of one shard (empty if unknown)."""
        code = self.shard_code(shard)
        if code is None:
            return {}
        rows = np.flatnonzero(self._shard == code)
        owner = np.searchsorted(self._starts, rows, side="right") - 1
        keys = self._keys.take(pa.array(owner, pa.int64())).to_pylist()
        return {f"{key}.{self.fields[f]}": (o, z) for key, f, o, z in
                zip(keys, self._field[rows].tolist(), self._offset[rows].tolist(), self._size[rows].tolist())}

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
                f"sample {int(idx[_first_row(bad)])} out of range (dataset has {n} samples)")
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
        version = (table.schema.metadata or {}).get(VERSION_KEY)
        if version not in (None, VERSION):
            raise IndexFormatError(f"unsupported index version {version.decode(errors='replace')!r} "
                                   f"(this shardfeed reads version {VERSION.decode()})")
        layout = (table.schema.metadata or {}).get(LAYOUT_KEY, b"tar").decode(errors="replace")
        if layout not in LAYOUTS:
            raise IndexFormatError(f"unknown index layout {layout!r} (known: {', '.join(LAYOUTS)})")
        for name in SCHEMA.names:
            if name not in table.column_names:
                raise IndexFormatError(f"index has no {name!r} column")
            if table.column(name).null_count:
                raise IndexFormatError(f"index column {name!r} has null values")
        if table.num_rows == 0:
            raise IndexFormatError("index is empty (no samples)")

        for name in ("key", "field", "shard"):
            if not _is_text(table.column(name).type):
                raise IndexFormatError(f"index column {name!r} must be strings, not {table.column(name).type}")

        def ints(name: str) -> np.ndarray:
            col = table.column(name)
            if not pa.types.is_integer(col.type):
                raise IndexFormatError(f"index column {name!r} must be integers, not {col.type}")
            return np.asarray(col.combine_chunks().cast(pa.int64()), dtype=np.int64)

        sample, offset, size = ints("sample"), ints("offset"), ints("size")
        for name, values in (("sample", sample), ("offset", offset), ("size", size)):
            if values.min() < 0:
                raise IndexFormatError(f"index column {name!r} has a negative value")
        shards, shard = _encode(table.column("shard"))
        fields, field = _encode(table.column("field"))
        if "" in fields:
            raise IndexFormatError("index has an empty field name")
        if "" in shards:
            raise IndexFormatError("index has an empty shard path")
        keys = table.column("key")

        order = None
        if (np.diff(sample) < 0).any():  # written by another tool in another order
            order = np.argsort(sample, kind="stable")
            sample, offset, size, shard, field = (a[order] for a in (sample, offset, size, shard, field))

        step = np.diff(sample)
        if sample[0] != 0 or (step > 1).any():
            missing = 0 if sample[0] != 0 else int(sample[_first_row(step > 1)]) + 1
            raise IndexFormatError(f"index samples are not dense: sample {missing} is missing")
        starts = np.concatenate(([0], np.flatnonzero(step) + 1, [len(sample)]))
        same = step == 0
        if layout == "tar" and (same & (shard[1:] != shard[:-1])).any():
            raise IndexFormatError(f"sample {int(sample[_first_row(same & (shard[1:] != shard[:-1]))])} "
                                   "spans more than one shard")
        # Duplicate (sample, field): sort the composite key; nearly sorted already, so cheap.
        composite = np.sort(sample * len(fields) + field, kind="stable")
        dup = composite[1:] == composite[:-1]
        if dup.any():
            at = int(composite[_first_row(dup)])
            raise IndexFormatError(f"sample {at // len(fields)} has field {fields[at % len(fields)]!r} twice")

        member_keys = keys if order is None else keys.take(pa.array(order))
        if same.any():
            equal = pc.equal(member_keys.slice(1), member_keys.slice(0, len(sample) - 1)).to_numpy()
            if (same & ~equal).any():
                raise IndexFormatError(f"sample {int(sample[_first_row(same & ~equal)])} has members "
                                       "with different keys")
        sample_keys = member_keys.take(pa.array(starts[:-1]))
        try:
            sample_keys = sample_keys.combine_chunks()
        except pa.ArrowInvalid:  # over 2 GiB of key text: needs 64-bit offsets
            sample_keys = sample_keys.cast(pa.large_string()).combine_chunks()
        return cls(
            keys=sample_keys,
            starts=_narrow(starts),
            shard=shard.astype(np.int16 if len(shards) < 2**15 else np.int32),
            field=field.astype(np.int16 if len(fields) < 2**15 else np.int32),
            offset=_narrow(offset),
            size=_narrow(size),
            shards=shards,
            fields=fields,
            layout=layout,
        )

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
            schema=SCHEMA.with_metadata({VERSION_KEY: VERSION, LAYOUT_KEY: self.layout.encode()}),
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


async def load_index(store: Store) -> Index:
    """Read and validate ``index.parquet`` at the store root (parsing runs in a thread)."""
    try:
        data = await store.read(INDEX_FILE)
    except ObjectNotFound as err:
        raise ObjectNotFound(f"{err} (create it with `shardfeed index {store.url}`)") from None
    return await asyncio.to_thread(index_from_parquet, data, f"{store.url}/{INDEX_FILE}")


async def write_index(store: Store, table_or_index: pa.Table | Index) -> None:
    """Write ``index.parquet`` atomically. Call it last, after every shard is in place."""
    def encode() -> bytes:
        table = table_or_index.to_table() if isinstance(table_or_index, Index) else table_or_index
        return parquet_bytes(table)

    await store.write(INDEX_FILE, await asyncio.to_thread(encode))
