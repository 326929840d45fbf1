"""``index.parquet``: the dataset index's on-disk format, and its checks.

One row per member (docs/architecture.md): ``sample`` (int64, dense 0..N-1), ``key``,
``field`` (lowercased), ``shard`` (path relative to the dataset root), ``offset`` (of the
member's data in the shard) and ``size``, with the format version, the layout and what a
row's extent is (``ROWS_KEY``) in the schema metadata. ``index_columns`` checks a table and
turns it into the compact arrays an ``Index`` (``index.py``) holds; ``split_member_name`` is
WebDataset's naming, shared by every writer of an index (the shard writer, ``pack``, the
layouts).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

INDEX_FILE = "index.parquet"
VERSION_KEY = b"shardfeed.index.version"
VERSION = b"1"
LAYOUT_KEY = b"shardfeed.index.layout"
LAYOUTS = ("tar", "objects", "mds", "litdata")
ROWS_KEY = b"shardfeed.index.rows"
"""What a row's offset and size are: ``fields``, the member's own bytes, or ``records``, its
record's, in which its record's own header places it (``read/fields.py``). When absent:
``records`` for the layouts ``mds`` and ``litdata`` (as every index of theirs was before the
key), ``fields`` for the others."""
RECORD_LAYOUTS = ("mds", "litdata")

SCHEMA = pa.schema(
    [("sample", pa.int64()), ("key", pa.string()), ("field", pa.string()),
     ("shard", pa.string()), ("offset", pa.int64()), ("size", pa.int64())],
    metadata={VERSION_KEY: VERSION},
)


class IndexFormatError(ValueError):
    """An index, shard or source directory does not hold a valid dataset; the message names the culprit."""


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


def narrow(values: np.ndarray) -> np.ndarray:
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


def first_row(mask: np.ndarray) -> int:
    return int(np.flatnonzero(mask)[0])


def index_columns(table: pa.Table) -> dict:
    """Check an index table (any row order); the arguments of ``Index(...)`` for it, members
    sorted by sample. ``IndexFormatError`` names what is wrong."""
    version = (table.schema.metadata or {}).get(VERSION_KEY)
    if version not in (None, VERSION):
        raise IndexFormatError(f"unsupported index version {version.decode(errors='replace')!r} "
                               f"(this shardfeed reads version {VERSION.decode()})")
    layout = (table.schema.metadata or {}).get(LAYOUT_KEY, b"tar").decode(errors="replace")
    if layout not in LAYOUTS:
        raise IndexFormatError(f"unknown index layout {layout!r} (known: {', '.join(LAYOUTS)})")
    rows = (table.schema.metadata or {}).get(ROWS_KEY, b"records" if layout in RECORD_LAYOUTS else b"fields")
    if rows not in (b"records", b"fields"):
        raise IndexFormatError(f"unknown index rows {rows.decode(errors='replace')!r} (known: records, fields)")
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
        missing = 0 if sample[0] != 0 else int(sample[first_row(step > 1)]) + 1
        raise IndexFormatError(f"index samples are not dense: sample {missing} is missing")
    starts = np.concatenate(([0], np.flatnonzero(step) + 1, [len(sample)]))
    same = step == 0
    if layout == "tar" and (same & (shard[1:] != shard[:-1])).any():
        raise IndexFormatError(f"sample {int(sample[first_row(same & (shard[1:] != shard[:-1]))])} "
                               "spans more than one shard")
    # Duplicate (sample, field): sort the composite key; nearly sorted already, so cheap.
    composite = np.sort(sample * len(fields) + field, kind="stable")
    dup = composite[1:] == composite[:-1]
    if dup.any():
        at = int(composite[first_row(dup)])
        raise IndexFormatError(f"sample {at // len(fields)} has field {fields[at % len(fields)]!r} twice")

    member_keys = keys if order is None else keys.take(pa.array(order))
    if same.any():
        equal = pc.equal(member_keys.slice(1), member_keys.slice(0, len(sample) - 1)).to_numpy()
        if (same & ~equal).any():
            raise IndexFormatError(f"sample {int(sample[first_row(same & ~equal)])} has members "
                                   "with different keys")
    sample_keys = member_keys.take(pa.array(starts[:-1]))
    try:
        sample_keys = sample_keys.combine_chunks()
    except pa.ArrowInvalid:  # over 2 GiB of key text: needs 64-bit offsets
        sample_keys = sample_keys.cast(pa.large_string()).combine_chunks()
    return dict(
        keys=sample_keys,
        starts=narrow(starts),
        shard=shard.astype(np.int16 if len(shards) < 2**15 else np.int32),
        field=field.astype(np.int16 if len(fields) < 2**15 else np.int32),
        offset=narrow(offset),
        size=narrow(size),
        shards=shards,
        fields=fields,
        layout=layout,
        records=rows == b"records",
    )


@dataclass(frozen=True)
class IndexStats:
    """What an index's consumers ask of all of it, computed once (``of``) or read from a map
    (``mapped.py``): opening a memory-mapped index then touches none of its per-sample pages."""

    total_bytes: int
    per_sample: int
    """Members of every sample when all have as many (the usual dataset), else 0."""
    shard_samples: int
    """Samples in a typical shard (the median count): what locality shuffles cut by."""
    extents: np.ndarray
    """int64 per shard: the end offset of its last member's data (0 for none)."""
    run_starts: np.ndarray
    """int64: the first sample of each run of consecutive samples in one shard."""
    run_shards: np.ndarray
    """int32: each run's shard code."""

    @classmethod
    def of(cls, starts: np.ndarray, shard: np.ndarray, offset: np.ndarray, size: np.ndarray,
           shards: int) -> IndexStats:
        counts = np.diff(starts)
        per_sample = int(counts[0]) if len(counts) and (counts == counts[0]).all() else 0
        del counts
        extents = np.zeros(shards, np.int64)
        np.maximum.at(extents, shard, offset.astype(np.int64) + size)
        sample_shard = shard[starts[:-1]]  # a sample's first member names its shard
        per_shard = np.bincount(sample_shard, minlength=shards)
        run_starts = np.flatnonzero(np.diff(sample_shard)) + 1
        if len(sample_shard):
            run_starts = np.concatenate(([0], run_starts))
        run_starts = run_starts.astype(np.int64)
        # Bytes of distinct extents: a record layout's fields share their record's (``records.py``);
        # a field's own extent may start where an empty one's lies (an Arrow footer's), and counts.
        shared = (offset[1:] == offset[:-1]) & (shard[1:] == shard[:-1]) & (size[1:] == size[:-1])
        total_bytes = int(size.sum(dtype=np.int64)) - int(size[1:][shared].sum(dtype=np.int64))
        return cls(total_bytes=total_bytes, per_sample=per_sample,
                   shard_samples=int(np.median(per_shard[per_shard > 0])) if len(sample_shard) else 0,
                   extents=extents, run_starts=run_starts,
                   run_shards=sample_shard[run_starts].astype(np.int32))
