"""The Arrow IPC stream format, as far as batch answers need it: shared by the service (writer)
and the client (reader), with NumPy and the standard library only; and, for the service's
reading of LitData's Arrow-footer chunks (``service/datasets/arrowfooter.py``), an IPC *file*'s
footer and record batches, read where they lie.

A batch answer in ``"format": "arrow"`` is an Arrow IPC *stream*
(https://arrow.apache.org/docs/format/Columnar.html#ipc-streaming-format): a schema message,
one record batch message per group of samples, and the end-of-stream marker. Every message is
``0xFFFFFFFF``, its metadata's length (int32), the metadata (a flatbuffer), then its body.

The service knows every member's size from its index before it has a byte of it, so a record
batch's metadata (its rows, each column's null count, each buffer's offset and length) is
written here from those sizes (:func:`record_batch_message`), ahead of the data; the data then
goes out as it is, from the same blocks the tar path sends. Only the columns a batch has are
handled: top-level ``int64``, ``large_binary`` and ``large_utf8`` (``binary`` and ``utf8`` too,
for reading), no dictionaries, no compression.

Every buffer of a body starts at a multiple of ``ALIGNMENT`` bytes from the stream's start
(metadata is padded to that end, as the format allows), so a column's values read in place as
any dtype whose size divides their lengths.

The reader (:func:`read_stream`) walks the messages of a stream held whole in memory and returns
each record batch's buffers as places in it: nothing per row, nothing copied.

An IPC file (https://arrow.apache.org/docs/format/Columnar.html#ipc-file-format) is ``ARROW1``,
padding, a stream, then its footer (a flatbuffer: the schema, and a Block per record batch: where
its message lies, its metadata's length and its body's), the footer's length (int32) and
``ARROW1`` again. :func:`read_file_footer` reads the footer, :func:`read_record_batches` the
record batches' metadata messages, each read on its own: a reader of a large file reads those
and the buffers it wants, never the file.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

CONTINUATION = b"\xff\xff\xff\xff"
END_OF_STREAM = CONTINUATION + b"\0\0\0\0"
ALIGNMENT = 64
"""Where buffers and bodies start: Arrow's recommended alignment (a cache line, any dtype)."""
MEDIA_TYPE = "application/vnd.apache.arrow.stream"

V5 = 4  # MetadataVersion.V5
SCHEMA, RECORD_BATCH = 1, 3  # MessageHeader union types
# Type union ids (Schema.fbs) of the columns read: the stream reader's, and the footer reader's.
NULL, INT, FLOATING_POINT, BINARY, UTF8, BOOL, LARGE_BINARY, LARGE_UTF8 = 1, 2, 3, 4, 5, 6, 19, 20
_OFFSET_WIDTH = {BINARY: 4, UTF8: 4, LARGE_BINARY: 8, LARGE_UTF8: 8}
TYPE_NAMES = {
    NULL: "null", INT: "int", FLOATING_POINT: "floating point", BINARY: "binary", UTF8: "utf8", BOOL: "bool",
    7: "decimal", 8: "date", 9: "time", 10: "timestamp", 11: "interval", 12: "list", 13: "struct", 14: "union",
    15: "fixed-size binary", 16: "fixed-size list", 17: "map", 18: "duration", LARGE_BINARY: "large binary",
    LARGE_UTF8: "large utf8", 21: "large list", 22: "run-end encoded", 23: "binary view", 24: "utf8 view",
    25: "list view", 26: "large list view"}
"""Every type's name (Schema.fbs's union), for errors."""
NESTED = frozenset({12, 13, 14, 16, 17, 21, 22, 25, 26})
"""The types whose values are their child columns' (lists, structs, maps, unions, ...)."""
FILE_MAGIC = b"ARROW1"
FILE_TAIL = 4 + len(FILE_MAGIC)
"""An IPC file's last bytes: its footer's length (int32), then ``FILE_MAGIC``."""


KEY, INDEX = "__key__", "__index__"
"""A batch answer's columns before one per field: each sample's key (large_utf8) and index (int64)."""


def batch_schema(fields: Sequence[str]):
    """The ``pyarrow.Schema`` of a batch answer with ``fields``: ``KEY``, ``INDEX``, then a large_binary
    column per field. The one place both sides name it; pyarrow is imported here, on first use (the
    bare client reads streams without it)."""
    import pyarrow as pa

    return pa.schema([pa.field(KEY, pa.large_utf8()), pa.field(INDEX, pa.int64(), nullable=False),
                      *(pa.field(name, pa.large_binary()) for name in fields)])


class ArrowFormatError(ValueError):
    """The bytes are not an Arrow IPC stream this module reads (or it is cut short)."""


def aligned(n: int) -> int:
    """``n`` rounded up to ``ALIGNMENT``."""
    return -(-n // ALIGNMENT) * ALIGNMENT


def padding(n: int) -> int:
    return -n % ALIGNMENT


# -- writing ---------------------------------------------------------------------------------

# A record batch message's flatbuffer, laid out front to back (every reference points forward):
#   0  root offset -> Message table at 16
#   4  Message vtable: 12 bytes, 4 fields (version, header_type, header, bodyLength)
#   16 Message table: soffset, header -> RecordBatch table, bodyLength, version, header_type
#   40 RecordBatch vtable: 10 bytes, 3 fields (length, nodes, buffers), 6 bytes of padding
#   56 RecordBatch table: soffset, nodes -> vector, length, buffers -> vector
#   84 nodes: count, then (length, null_count) int64 pairs from 88; buffers: count, then (offset, length)
_HEAD = struct.Struct("<I 6H iIqhBx4x 5H6x iIqI4x")
_MESSAGE_AT, _BATCH_AT, _NODES_AT = 16, 56, 84


def _metadata(rows: int, nodes: np.ndarray, buffers: list[int], body_length: int) -> bytes:
    """The flatbuffer of a record batch message: ``nodes`` (length, null count) per column, an int64
    array of shape ``(n, 2)``, and ``buffers``, each buffer's offset and length one after another."""
    buffers_at = _NODES_AT + 8 + 16 * len(nodes)  # the buffers vector's count (after 4 bytes of padding)
    head = _HEAD.pack(
        _MESSAGE_AT,
        12, 20, 16, 18, 4, 8,  # Message vtable: its size, the table's, then each field's place in it
        _MESSAGE_AT - 4, _BATCH_AT - (_MESSAGE_AT + 4), body_length, V5, RECORD_BATCH,
        10, 24, 8, 4, 16,  # RecordBatch vtable
        _BATCH_AT - 40, _NODES_AT - (_BATCH_AT + 4), rows, buffers_at - (_BATCH_AT + 16),
    )
    return b"".join((head, struct.pack("<4xI", len(nodes)), nodes.astype("<i8").tobytes(),
                     struct.pack(f"<4xI{len(buffers)}q", len(buffers) // 2, *buffers)))


_OURS = ((_MESSAGE_AT, 12, 20, 16, 18, 4, 8, _MESSAGE_AT - 4, _BATCH_AT - (_MESSAGE_AT + 4)),
         (V5, RECORD_BATCH, 10, 24, 8, 4, 16, _BATCH_AT - 40, _NODES_AT - (_BATCH_AT + 4)))
"""The fields of ``_HEAD`` that every record batch message written here has alike (all but the
body's length, the rows and where the buffers vector lies)."""


def _ours(buf: memoryview, at: int) -> tuple[int, int, tuple[int, int], tuple[int, int]] | None:
    """A record batch message written by :func:`record_batch_message`, its metadata at ``at``, read at
    its fixed places (three unpacks, not a walk through its tables: a cold batch of 1 MiB samples
    has a record batch per sample): its rows, body length, and nodes' and buffers' places and
    counts. ``None`` for any other metadata (pyarrow's), which the tables' walk reads."""
    if at + _HEAD.size + 4 > len(buf):
        return None
    head = _HEAD.unpack_from(buf, at)
    if head[:9] != _OURS[0] or head[10:19] != _OURS[1]:
        return None
    buffers = at + _BATCH_AT + 16 + head[20]
    return (head[19], head[9], (at + _NODES_AT + 4, _U32.unpack_from(buf, at + _NODES_AT)[0]),
            (buffers + 4, _U32.unpack_from(buf, buffers)[0]))


def encapsulated(metadata: bytes, at: int = 0) -> bytes:
    """A message's prefix and ``metadata``, padded so that its body (what follows) starts at a
    multiple of ``ALIGNMENT`` in a stream where the message starts at ``at``."""
    size = len(metadata) + padding(at + 8 + len(metadata))
    return b"".join((CONTINUATION, struct.pack("<i", size), metadata, bytes(size - len(metadata))))


def schema_message(serialized: bytes) -> bytes:
    """A schema message (as ``pyarrow.Schema.serialize`` writes it) padded to ``ALIGNMENT``, so the
    record batches after it start aligned."""
    if not serialized.startswith(CONTINUATION):
        raise ArrowFormatError("a schema message starts with the continuation marker")
    (size,) = struct.unpack_from("<i", serialized, 4)
    return encapsulated(bytes(serialized[8:8 + size]))


class BodyLayout:
    """Where the buffers of a record batch's body lie: ``buffers``, (offset, length) of each, every
    start aligned; ``gaps``, the padding after each; the body's ``length``. (A batch has a dozen
    buffers: plain Python lays them out quicker than numpy calls would.)"""

    __slots__ = ("buffers", "gaps", "length")

    def __init__(self, buffers: list[int], gaps: list[int], length: int):
        self.buffers, self.gaps, self.length = buffers, gaps, length

    @classmethod
    def of(cls, lengths: list[int]) -> BodyLayout:
        """The layout of buffers of ``lengths`` bytes, in order, each padded to ``ALIGNMENT``."""
        flat, gaps, at = [], [], 0
        for length in lengths:
            gap = -length % ALIGNMENT
            flat += (at, length)
            gaps.append(gap)
            at += length + gap
        return cls(flat, gaps, at)


def record_batch_message(rows: int, nodes: np.ndarray, body: BodyLayout, at: int = 0) -> bytes:
    """The prefix and metadata of a record batch of ``rows`` rows whose columns are ``nodes``
    ((length, null count) each) and whose body is laid out as ``body``; the message starts at
    ``at`` in the stream (its body then starts aligned)."""
    return encapsulated(_metadata(rows, np.asarray(nodes, np.int64).reshape(-1, 2), body.buffers, body.length), at)


def record_batch_message_length(columns: int, buffers: int) -> int:
    """The length of a record batch message's prefix and metadata (before its body), when it starts
    aligned: the same for every record batch of a stream."""
    return aligned(8 + _NODES_AT + 4 + 16 * columns + 8 + 16 * buffers)


def validity_bitmap(valid: np.ndarray) -> bytes:
    """A validity buffer: bit ``i`` (least significant first) set where ``valid[i]``."""
    return np.packbits(np.asarray(valid, bool), bitorder="little").tobytes()


# -- reading ---------------------------------------------------------------------------------

_U8, _U16, _I32, _U32, _I64 = (struct.Struct(f"<{c}") for c in "BHiIq")


class _Table:
    """A flatbuffer table in ``buf`` at ``at``: its fields by slot number."""

    __slots__ = ("buf", "at", "vtable", "vsize")

    def __init__(self, buf: memoryview, at: int):
        self.buf, self.at = buf, at
        self.vtable = at - _I32.unpack_from(buf, at)[0]
        self.vsize = _U16.unpack_from(buf, self.vtable)[0]

    def _place(self, slot: int) -> int | None:
        entry = 4 + 2 * slot
        if entry >= self.vsize:
            return None
        offset = _U16.unpack_from(self.buf, self.vtable + entry)[0]
        return self.at + offset if offset else None

    def scalar(self, slot: int, kind: struct.Struct, default: int = 0) -> int:
        at = self._place(slot)
        return default if at is None else kind.unpack_from(self.buf, at)[0]

    def _target(self, slot: int) -> int | None:
        at = self._place(slot)
        return None if at is None else at + _U32.unpack_from(self.buf, at)[0]

    def table(self, slot: int) -> _Table | None:
        at = self._target(slot)
        return None if at is None else _Table(self.buf, at)

    def tables(self, slot: int) -> list[_Table]:
        at = self._target(slot)
        if at is None:
            return []
        count = _U32.unpack_from(self.buf, at)[0]
        return [_Table(self.buf, at + 4 + 4 * k + _U32.unpack_from(self.buf, at + 4 + 4 * k)[0]) for k in range(count)]

    def string(self, slot: int) -> str:
        at = self._target(slot)
        if at is None:
            return ""
        size = _U32.unpack_from(self.buf, at)[0]
        return bytes(self.buf[at + 4:at + 4 + size]).decode()

    def vector(self, slot: int) -> tuple[int, int]:
        """Where a vector's elements start, and how many there are (0, 0 when absent)."""
        at = self._target(slot)
        return (0, 0) if at is None else (at + 4, _U32.unpack_from(self.buf, at)[0])


@dataclass(frozen=True)
class Column:
    """A column of the stream's schema: its name, its type (a union id above) and whether it may hold
    nulls."""

    name: str
    type: int
    nullable: bool
    dtype: str | None = None
    """The NumPy dtype of its values when they are fixed-width numbers (int, floating point)."""
    dictionary: bool = False
    """Its values are indices into a dictionary of them."""

    @property
    def buffers(self) -> int:
        """Buffers per record batch: none for nulls; validity and values, and offsets for
        variable-size values (a nested column's children's are not counted)."""
        return 0 if self.type == NULL else 3 if self.type in _OFFSET_WIDTH else 2


@dataclass(frozen=True)
class Stream:
    """An Arrow IPC stream read in place, column by column across its record batches: its
    ``columns``; per record batch its ``rows``, each column's null count (``nulls``) and each
    buffer's place in the stream (``buffers``: absolute offset and length); ``ended``: the
    end-of-stream marker was read. Its columns' values come out as arrays over all record batches
    at once (a few numpy calls per column, not per record batch: a cold batch of 1 MiB samples
    has a record batch per sample)."""

    columns: list[Column]
    rows: np.ndarray
    nulls: np.ndarray
    buffers: np.ndarray
    ended: bool
    end: int = 0
    """Where the stream ended in the buffer read: after its end-of-stream marker (where the next
    stream of an answer of several parts starts), or where the buffer ends when it was cut short."""

    @property
    def total(self) -> int:
        """Rows in all record batches."""
        return int(self.rows.sum())

    def first_buffer(self, column: int) -> int:
        """The index of ``column``'s first buffer (its validity) in a record batch's."""
        return sum(c.buffers for c in self.columns[:column])

    def valid(self, buf, column: int) -> np.ndarray:
        """bool per row: not null."""
        out = np.ones(self.total, bool)
        if not self.nulls[:, column].any():
            return out
        validity = self.buffers[:, self.first_buffer(column)]
        if ((self.nulls[:, column] > 0) & (validity[:, 1] * 8 < self.rows)).any():
            raise ArrowFormatError(f"column {self.columns[column].name!r}: a record batch's nulls lack "
                                   "a validity bit per row")
        starts = np.cumsum(self.rows) - self.rows
        for k in np.flatnonzero(self.nulls[:, column] > 0).tolist():
            rows = int(self.rows[k])
            bits = np.frombuffer(buf, np.uint8, int(validity[k, 1]), int(validity[k, 0]))
            out[starts[k]:starts[k] + rows] = np.unpackbits(bits, count=rows, bitorder="little").astype(bool)
        return out

    def integers(self, buf, column: int) -> np.ndarray:
        """An int64 column's values."""
        return gather(buf, "<i8", self.buffers[:, self.first_buffer(column) + 1, 0], self.rows)

    def spans(self, buf, column: int) -> tuple[np.ndarray, np.ndarray]:
        """A binary or string column's values as places in the stream: each row's absolute offset and
        length (a null's too: it may have one; see :meth:`valid`)."""
        first = self.first_buffer(column)
        offsets, data = self.buffers[:, first + 1], self.buffers[:, first + 2]
        width = _OFFSET_WIDTH[self.columns[column].type]
        ends = gather(buf, f"<i{width}", offsets[:, 0], self.rows + 1)
        if width == 4:
            ends = ends.astype(np.int64)
        if len(self.rows) == 1:  # the usual answer held in RAM: one record batch
            lo, hi, limit, at = ends[:-1], ends[1:], data[0, 1], data[0, 0]
        else:  # each record batch's offsets, its last one left out (lo) or its first (hi)
            kept = np.ones(len(ends), bool)
            kept[np.cumsum(self.rows + 1) - 1] = False
            lo, hi = ends[:-1][kept[:-1]], ends[1:][kept[:-1]]
            limit, at = np.repeat(data[:, 1], self.rows), np.repeat(data[:, 0], self.rows)
        lengths = hi - lo
        if len(lo) and (lo.min() < 0 or lengths.min() < 0 or (hi > limit).any()):
            raise ArrowFormatError(f"column {self.columns[column].name!r}: offsets outside its values")
        return at + lo, lengths

    def fixed_spans(self, column: int) -> tuple[np.ndarray, np.ndarray]:
        """A fixed-width column's values as places in the stream, as :meth:`spans` gives a binary
        column's: each row's absolute offset and its dtype's size (a null's too)."""
        width = np.dtype(self.columns[column].dtype).itemsize
        values = self.buffers[:, self.first_buffer(column) + 1]
        if (values[:, 1] < width * self.rows).any():
            raise ArrowFormatError(f"column {self.columns[column].name!r}: fewer values than rows")
        within = np.arange(self.total) - np.repeat(np.cumsum(self.rows) - self.rows, self.rows)
        return np.repeat(values[:, 0], self.rows) + width * within, np.full(self.total, width, np.int64)


def gather(buf, dtype: str, starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """``counts[k]`` values of ``dtype`` from byte ``starts[k]`` of ``buf``, for every ``k``, one after
    another: one fancy index over ``buf`` seen as ``dtype`` when every start is aligned to it (Arrow
    aligns buffers to 8 bytes), else a view per run, joined."""
    size = np.dtype(dtype).itemsize
    counts = np.asarray(counts, np.int64)
    if len(counts) == 1:
        return np.frombuffer(buf, dtype, int(counts[0]), int(starts[0]))
    if not len(counts):
        return np.empty(0, dtype)
    if (starts % size).any():
        return np.concatenate([np.frombuffer(buf, dtype, int(n), int(at)) for at, n in zip(starts, counts)])
    whole = np.frombuffer(buf, dtype, len(memoryview(buf).cast("B")) // size)
    return whole[np.repeat(starts // size - (np.cumsum(counts) - counts), counts) + np.arange(int(counts.sum()))]


def _columns(schema: _Table) -> list[Column]:
    """The top-level columns of a Schema table, of whatever type."""
    return [Column(field.string(0), field.scalar(2, _U8), bool(field.scalar(1, _U8)),
                   _dtype(field.scalar(2, _U8), field.table(3)), field.table(4) is not None)
            for field in schema.tables(1)]


def _dtype(kind: int, spec: _Table | None) -> str | None:
    """The NumPy dtype of an Int or FloatingPoint type's values (its table: ``spec``); None for others."""
    if kind == INT and spec is not None and spec.scalar(0, _I32) in (8, 16, 32, 64):
        return f"<{'i' if spec.scalar(1, _U8) else 'u'}{spec.scalar(0, _I32) // 8}"
    if kind == FLOATING_POINT:
        precision = 0 if spec is None else spec.scalar(0, _U16)  # HALF, SINGLE, DOUBLE
        return ("<f2", "<f4", "<f8")[precision] if precision < 3 else None
    return None


def _schema(message: _Table) -> list[Column]:
    """A schema message's columns, each of a type the stream reader handles."""
    schema = message.table(2)
    if schema is None:
        raise ArrowFormatError("a schema message without a schema")
    columns = _columns(schema)
    for column in columns:
        if column.type not in (INT, *_OFFSET_WIDTH) or column.dictionary:
            raise ArrowFormatError(f"column {column.name!r} has a type this reader does not handle "
                                   f"({TYPE_NAMES.get(column.type, column.type)})")
        if column.type == INT and column.dtype not in ("<i8", "<u8"):
            raise ArrowFormatError(f"column {column.name!r}: only 64-bit integers are handled")
    return columns


@lru_cache(maxsize=64)
def _schema_of(metadata: bytes) -> list[Column]:
    """The columns of a schema message's metadata, remembered: a client reads the same few schemas
    in every answer."""
    return _schema(_Table(memoryview(metadata), _U32.unpack_from(metadata, 0)[0]))


def _record_batch(message: _Table, columns: int, buffers: int) -> tuple[int, int, int]:
    """A record batch message's rows and where its nodes and buffers vectors' elements lie (their
    counts checked against the schema's ``columns`` and ``buffers``); read, with every other
    record batch's, by :func:`_stream`."""
    batch = message.table(2)
    if batch is None:
        raise ArrowFormatError("a record batch message without a record batch")
    if batch._place(3) is not None:
        raise ArrowFormatError("compressed record batches (each buffer compressed on its own) are not handled")
    nodes, buffers_at = batch.vector(1), batch.vector(2)
    if nodes[1] != columns or buffers_at[1] != buffers:
        raise ArrowFormatError("a record batch does not match its schema")
    return batch.scalar(0, _I64), nodes[0], buffers_at[0]


def read_stream(buf: bytes | memoryview, start: int = 0) -> Stream:
    """The messages of a stream held whole in ``buf`` from byte ``start`` on (its places are counted
    from the start of ``buf``; it ends at its end-of-stream marker, ``Stream.end``, whatever follows).
    A stream cut short returns what it holds so far with ``ended`` False; anything else malformed
    raises ``ArrowFormatError``."""
    buf = memoryview(buf).cast("B")
    end, at = len(buf), start
    columns: list[Column] | None = None
    width = 0  # buffers per record batch, once the schema says
    batches: list[tuple[int, int, int, int, int]] = []  # rows, nodes at, buffers at, body at, body length
    try:
        while at + 8 <= end:
            size = _I32.unpack_from(buf, at)[0]
            if size == -1:  # the continuation marker
                size, at = _I32.unpack_from(buf, at + 4)[0], at + 8
            else:  # the format before 0.15: no continuation marker
                at += 4
            if size == 0:
                return _stream(buf, columns or [], batches, True, at)
            if size < 0 or at + size > end:
                break
            ours = _ours(buf, at) if columns is not None else None
            if ours is not None:
                rows, body_length, nodes, buffers = ours
                body, at = at + size, at + size + body_length
                if at > end:
                    break
                if nodes[1] != len(columns) or buffers[1] != width:
                    raise ArrowFormatError("a record batch does not match its schema")
                batches.append((rows, nodes[0], buffers[0], body, body_length))
                continue
            message = _Table(buf, at + _U32.unpack_from(buf, at)[0])
            kind, body_length = message.scalar(1, _U8), message.scalar(3, _I64)
            body, at = at + size, at + size + body_length
            if at > end:
                break
            if kind == SCHEMA:
                columns = _schema_of(bytes(buf[body - size:body]))
                width = sum(c.buffers for c in columns)
            elif kind == RECORD_BATCH:
                if columns is None:
                    raise ArrowFormatError("a record batch before the schema")
                batches.append((*_record_batch(message, len(columns), width), body, body_length))
            else:
                raise ArrowFormatError(f"a message of a kind this reader does not handle ({kind})")
    except struct.error:
        raise ArrowFormatError("a message's metadata points outside the stream") from None
    return _stream(buf, columns or [], batches, False, end)


def _stream(buf: memoryview, columns: list[Column], batches: list[tuple[int, int, int, int, int]],
            ended: bool, end: int = 0) -> Stream:
    """The stream of ``batches`` (each as :func:`read_stream` found it): every record batch's nodes
    and buffers read, and checked, at once."""
    width = sum(c.buffers for c in columns)
    rows, nodes_at, buffers_at, body, body_length = np.array(batches, np.int64).reshape(-1, 5).T
    n = len(rows)
    nodes = gather(buf, "<i8", nodes_at, np.full(n, 2 * len(columns))).reshape(n, len(columns), 2)
    buffers = gather(buf, "<i8", buffers_at, np.full(n, 2 * width)).reshape(n, width, 2)
    if n and len(columns) and (nodes[:, :, 0] != rows[:, None]).any():
        raise ArrowFormatError("a record batch's columns are not all as long as it")
    if n and width and ((buffers[:, :, 0] + buffers[:, :, 1]).max(axis=1) > body_length).any():
        raise ArrowFormatError("a record batch's buffer lies past its body")
    places = buffers.copy()  # a view of the stream's own bytes, which stay as they came
    places[:, :, 0] += body[:, None]
    return Stream(columns, rows, nodes[:, :, 1], places, ended, end)


# -- an IPC file's footer and record batches -------------------------------------------------

_BLOCK = np.dtype([("offset", "<i8"), ("metadata", "<i4"), ("padding", "V4"), ("body", "<i8")])
"""A Block struct of a file's footer: where a message lies in the file, its metadata's length (its
prefix and padding included) and its body's length."""


@dataclass(frozen=True)
class FileFooter:
    """An IPC file's footer: its ``columns``; per record batch (``batches``, int64 ``(n, 3)``) the
    offset of its message in the file, its metadata's length and its body's length."""

    columns: list[Column]
    batches: np.ndarray


def file_footer_length(tail: bytes) -> int:
    """The length of a file's footer, from its last ``FILE_TAIL`` bytes (``tail``)."""
    if len(tail) != FILE_TAIL or tail[4:] != FILE_MAGIC:
        raise ArrowFormatError(f"not an Arrow IPC file (it does not end in {FILE_MAGIC!r})")
    return _I32.unpack_from(tail, 0)[0]


def read_file_footer(data: bytes) -> FileFooter:
    """A file's footer from its flatbuffer (``data``: the ``file_footer_length`` bytes before the
    file's tail)."""
    buf = memoryview(data).cast("B")
    try:
        footer = _Table(buf, _U32.unpack_from(buf, 0)[0])
        schema = footer.table(1)
        if schema is None:
            raise ArrowFormatError("a file footer without a schema")
        at, count = footer.vector(3)
        blocks = np.frombuffer(buf, _BLOCK, count, at)
        return FileFooter(_columns(schema), np.stack([blocks["offset"], blocks["metadata"].astype(np.int64),
                                                      blocks["body"]], axis=1).reshape(-1, 3))
    except (struct.error, ValueError) as err:
        if isinstance(err, ArrowFormatError):
            raise
        raise ArrowFormatError("a file footer's flatbuffer points outside it") from None


def read_record_batches(columns: list[Column], messages: Sequence[bytes], bodies: np.ndarray) -> Stream:
    """The record batches of a file, each from its metadata message (the bytes its Block names:
    prefix, flatbuffer, padding) and where its body starts (``bodies``): a ``Stream`` whose
    buffers are places as ``bodies`` counts them (in the file, or whatever holds it)."""
    buf = memoryview(b"".join(messages))
    width = sum(c.buffers for c in columns)
    batches, at = [], 0
    try:
        for message, body in zip(messages, np.asarray(bodies, np.int64).tolist(), strict=True):
            start = at + (8 if bytes(message[:4]) == CONTINUATION else 4)
            table = _Table(buf, start + _U32.unpack_from(buf, start)[0])
            if table.scalar(1, _U8) != RECORD_BATCH:
                raise ArrowFormatError("a file's record batch block holds another kind of message")
            batches.append((*_record_batch(table, len(columns), width), body, table.scalar(3, _I64)))
            at += len(message)
    except struct.error:
        raise ArrowFormatError("a record batch's metadata points outside it") from None
    return _stream(buf, columns, batches, True)
