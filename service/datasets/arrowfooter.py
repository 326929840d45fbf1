"""LitData's Arrow-footer chunks: where each value of their items lies, found with ranged reads.

LitData 0.2.76 (``writer.py`` ``_create_chunk``, ``item_loader.py`` ``append_arrow_row_footer``)
writes a chunk of dict items whose leaves are all plain values not as records but as an Arrow
IPC *file* of the items (record batches of 256 rows), after a header whose records are empty::

    num_items | num_items + 1 offsets, each the header's size | IPC file | its length (u32) | LDARW01\\0

Every value is then a byte range of the chunk: a string's or bytes' lies in its record batch's
data buffer between two of its offsets, and an int's or float's is 8 bytes of its values buffer,
little-endian int64 or float64: what LitData's ``int`` and ``float`` serializers write, as a
string's UTF-8 is what ``str`` writes. So the index holds each field's own extent, and the
fields need no placing (``read/fields.py``). A null is a field the item lacks.

``footer_rows`` finds them with a few small reads, never a value: the chunk's last bytes (the
IPC file's length and LitData's magic, the file's footer length and its own), the file's footer
(its schema, and where each record batch lies), each record batch's metadata, then the offsets
of its variable-size columns and the validity bitmaps of its columns with nulls. What is no
byte range is refused by name: compressed record batches (LitData's ``ipc_compression``, when
its writer was asked to compress), booleans (bit-packed), nested values (lists, dicts) and
dictionary-encoded columns; and a chunk whose columns are not the items' leaves that
``index.json`` names, or not of their serializers' types.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace

import numpy as np

import shardfeed.arrowipc as arrowipc
from shardfeed.arrowipc import ArrowFormatError, Stream
from shardfeed.service.datasets.indexfile import IndexFormatError
from shardfeed.service.datasets.records import Column
from shardfeed.service.datasets.tarscan import bounded_map
from shardfeed.service.stores import Store

MAGIC = b"LDARW01\0"
TAIL = arrowipc.FILE_TAIL + 4 + len(MAGIC)
"""The chunk's last bytes: the IPC file's tail, the file's length (uint32) and ``MAGIC``."""
LOOKAHEAD = 4 << 10
"""Bytes of a record batch's body read with its metadata: the first columns' offsets (1 KiB for
256 rows) come along, and need no read of their own."""
MERGE_GAP = 16 << 10
"""Buffers of a chunk closer than this are read as one range: a request costs more than a few KiB."""
CONCURRENCY = 16
"""Reads of one chunk at a time (the chunks themselves are read ``peerindex``'s concurrency at a time)."""


def _serializer(column: arrowipc.Column) -> str | None:
    """The LitData serializer that writes a value of ``column`` as the bytes Arrow stores."""
    if column.type in (arrowipc.UTF8, arrowipc.LARGE_UTF8):
        return "str"
    if column.type in (arrowipc.BINARY, arrowipc.LARGE_BINARY):
        return "bytes"
    return {"<i8": "int", "<f8": "float"}.get(column.dtype)


@dataclass(frozen=True)
class FooterRows:
    """The values of a chunk's items, item by item and in column order within an item: each
    one's ``item`` (its number in the chunk), ``column`` (in the dataset's columns) and extent
    in the chunk (``offset``, ``size``)."""

    item: np.ndarray
    column: np.ndarray
    offset: np.ndarray
    size: np.ndarray


async def footer_rows(store: Store, name: str, size: int, columns: tuple[Column, ...], header: int,
                      items: int) -> FooterRows:
    """The values of the ``items`` items of chunk ``name`` (``size`` bytes; its header, ``header``
    bytes, says its records are empty), read through ``store``; ``IndexFormatError`` naming it
    when it does not end in an Arrow footer of ``columns`` that this module reads."""
    async def read(at: int, length: int) -> bytes:
        return await store.read_range(name, at, length)

    if size < header + TAIL:
        raise IndexFormatError(f"{name}: its records are empty, and it is too short to end in LitData's Arrow footer")
    tail = await read(size - TAIL, TAIL)
    if tail[-len(MAGIC):] != MAGIC:
        raise IndexFormatError(f"{name}: its records are empty, and it does not end in LitData's Arrow footer "
                               f"({MAGIC!r})")
    start = size - TAIL + arrowipc.FILE_TAIL - int.from_bytes(tail[arrowipc.FILE_TAIL:-len(MAGIC)], "little")
    end = size - TAIL  # where the IPC file's footer ends
    try:
        footer_at = end - arrowipc.file_footer_length(tail[:arrowipc.FILE_TAIL])
        if not header <= start < footer_at < end:
            raise ArrowFormatError(f"the file ({start}..{end}) or its footer (from {footer_at}) lies outside the chunk")
        footer = arrowipc.read_file_footer(await read(footer_at, end - footer_at))
        places = _checked_columns(footer.columns, columns)
        blocks = footer.batches
        bodies = start + blocks[:, 0] + blocks[:, 1]
        if len(blocks) and ((blocks[:, 0] < len(arrowipc.FILE_MAGIC)) | (blocks[:, 1] <= 8) | (blocks[:, 2] < 0)
                            | (bodies + blocks[:, 2] > footer_at)).any():
            raise ArrowFormatError("a record batch lies outside the file")
        heads = await bounded_map(lambda block: read(start + block[0], block[1] + min(block[2], LOOKAHEAD)),
                                  blocks.tolist(), CONCURRENCY)
        lengths = blocks[:, 1].tolist()
        stream = arrowipc.read_record_batches(footer.columns, [head[:n] for head, n in zip(heads, lengths)], bodies)
        if stream.total != items:
            raise ArrowFormatError(f"it holds {stream.total} rows, the chunk's header {items} items")
        held = [(body, head[n:]) for head, n, body in zip(heads, lengths, bodies.tolist())]
        fetched, stream = await _with_buffers(read, stream, _wanted(stream), held)
        return _values(stream, fetched, places, items)
    except ArrowFormatError as err:
        raise IndexFormatError(f"{name}: LitData's Arrow footer cannot be served in place: {err}") from None


def _checked_columns(found: list[arrowipc.Column], columns: tuple[Column, ...]) -> list[int]:
    """The place in ``columns`` (the items' leaves, from ``index.json``) of each column of the
    footer; ``ArrowFormatError`` for a column whose values are not byte ranges, or not the
    leaves' or not of their serializers' types."""
    for column in found:
        if column.dictionary:
            raise ArrowFormatError(f"column {column.name!r} is dictionary-encoded")
        if column.type == arrowipc.BOOL:
            raise ArrowFormatError(f"column {column.name!r} holds booleans, which Arrow packs 8 to a byte")
        if column.type in arrowipc.NESTED:
            raise ArrowFormatError(f"column {column.name!r} holds nested values "
                                   f"({arrowipc.TYPE_NAMES[column.type]}), not a byte range each")
        if column.type != arrowipc.NULL and _serializer(column) is None:
            kind = column.dtype or arrowipc.TYPE_NAMES.get(column.type, column.type)
            raise ArrowFormatError(f"column {column.name!r} is of a type not read ({kind})")
    names = [column.name.lower() for column in found]  # as ``field_names`` names the leaves
    leaves = [column.name for column in columns]
    if sorted(names) != sorted(leaves):
        raise ArrowFormatError(f"its columns {names} are not the items' leaves {leaves} (index.json's data_spec)")
    places = [leaves.index(name) for name in names]
    for column, place in zip(found, places):
        wanted = columns[place].encoding.partition(":")[0]
        if column.type != arrowipc.NULL and _serializer(column) != wanted:
            raise ArrowFormatError(f"column {column.name!r} holds {_serializer(column)} values, index.json's "
                                   f"serializer of its leaf is {columns[place].encoding!r}")
    return places


def _wanted(stream: Stream) -> list[int]:
    """The buffers (numbers in a record batch's) that place the values: each variable-size
    column's offsets, and the validity bitmap of each column with nulls."""
    wanted = []
    for k, column in enumerate(stream.columns):
        first = stream.first_buffer(k)
        if column.type != arrowipc.NULL and stream.nulls[:, k].any():
            wanted.append(first)
        if column.dtype is None and column.type != arrowipc.NULL:
            wanted.append(first + 1)
    return wanted


async def _with_buffers(read: Callable[[int, int], Awaitable[bytes]], stream: Stream, wanted: list[int],
                        held: list[tuple[int, bytes]]) -> tuple[bytes, Stream]:
    """The buffers ``wanted`` of every record batch, found in ``held`` (bytes read already: where
    each run of them starts in the chunk, and its bytes) or read now (those closer than
    ``MERGE_GAP`` as one range); and ``stream`` with their places moved into all those bytes
    joined. The other buffers' places stay where they lie in the chunk."""
    places = stream.buffers[:, wanted].reshape(-1, 2)
    held = sorted(held, key=lambda run: run[0])
    held_starts = np.array([at for at, _ in held], np.int64)
    held_ends = held_starts + np.array([len(data) for _, data in held], np.int64)
    in_held = _containing(held_starts, held_ends, places)
    run_starts, run_ends = _merged(places[(in_held < 0) & (places[:, 1] > 0)])
    parts = await bounded_map(lambda run: read(run[0], run[1] - run[0]),
                              list(zip(run_starts.tolist(), run_ends.tolist())), CONCURRENCY)
    run = np.where(in_held >= 0, in_held, len(held) + _containing(run_starts, run_ends, places))
    starts = np.concatenate([held_starts, run_starts])
    bases = np.cumsum([0, *(len(data) for _, data in held), *map(len, parts)])
    moved = stream.buffers.copy()
    # (A place of no bytes is in no run: any run's index stands in, a record batch's held run at least.)
    at = np.where(places[:, 1] > 0, bases[run] + places[:, 0] - starts[run], 0)
    moved[:, wanted, 0] = at.reshape(len(stream.rows), len(wanted))
    return b"".join([*(data for _, data in held), *parts]), replace(stream, buffers=moved)


def _containing(starts: np.ndarray, ends: np.ndarray, places: np.ndarray) -> np.ndarray:
    """Per place ((start, length) each), the run (``starts`` sorted, runs apart) that holds it
    whole; -1 where none does."""
    if not len(starts):
        return np.full(len(places), -1, np.int64)
    run = np.searchsorted(starts, places[:, 0], side="right") - 1
    return np.where((run >= 0) & (places[:, 0] + places[:, 1] <= ends[np.maximum(run, 0)]), run, -1)


def _merged(places: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Ranges that cover ``places`` ((start, length) each), those closer than ``MERGE_GAP`` in one."""
    places = places[np.argsort(places[:, 0], kind="stable")]
    ends = places[:, 0] + places[:, 1]
    new = np.concatenate(([True], places[1:, 0] - np.maximum.accumulate(ends)[:-1] > MERGE_GAP))[:len(places)]
    return places[new, 0], np.maximum.reduceat(ends, np.flatnonzero(new)) if len(places) else ends


def _values(stream: Stream, fetched: bytes, places: list[int], items: int) -> FooterRows:
    """The extents of the values (nulls left out) of ``stream`` (its wanted buffers in ``fetched``),
    item by item, the columns in the dataset's order (``places``)."""
    item, column, offset, size = [], [], [], []
    for k, kind in enumerate(stream.columns):
        if kind.type == arrowipc.NULL:  # every value a null
            continue
        at, lengths = stream.fixed_spans(k) if kind.dtype is not None else stream.spans(fetched, k)
        kept = np.flatnonzero(stream.valid(fetched, k))
        item.append(kept)
        column.append(np.full(len(kept), places[k], np.int64))
        offset.append(at[kept])
        size.append(lengths[kept])
    rows = FooterRows(*(np.concatenate([*parts, np.empty(0, np.int64)]).astype(np.int64)
                        for parts in (item, column, offset, size)))
    empty = np.bincount(rows.item, minlength=items) == 0
    if empty.any():  # a sample without a field: the index has none
        raise ArrowFormatError(f"item {int(np.flatnonzero(empty)[0])} has nulls alone")
    order = np.lexsort((rows.column, rows.item))
    return FooterRows(*(values[order] for values in (rows.item, rows.column, rows.offset, rows.size)))
