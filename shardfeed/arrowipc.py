"""The Arrow IPC stream format, as far as batch answers need it: shared by the service (writer)
and the client (reader), with NumPy and the standard library only.

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
"""

from __future__ import annotations

import struct
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
# Type union ids (Schema.fbs) of the columns handled.
INT, BINARY, UTF8, LARGE_BINARY, LARGE_UTF8 = 2, 4, 5, 19, 20
_OFFSET_WIDTH = {BINARY: 4, UTF8: 4, LARGE_BINARY: 8, LARGE_UTF8: 8}


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

    def structs(self, slot: int, width: int) -> np.ndarray:
        """A vector of structs of ``width`` int64 each, as an ``(n, width)`` array (a view)."""
        at = self._target(slot)
        if at is None:
            return np.empty((0, width), np.int64)
        count = _U32.unpack_from(self.buf, at)[0]
        return np.frombuffer(self.buf, "<i8", count * width, at + 4).reshape(count, width)


@dataclass(frozen=True)
class Column:
    """A column of the stream's schema: its name, its type (a union id above) and whether it may hold
    nulls."""

    name: str
    type: int
    nullable: bool

    @property
    def buffers(self) -> int:
        """Buffers per record batch: validity and values, and offsets for variable-size values."""
        return 3 if self.type in _OFFSET_WIDTH else 2


@dataclass(frozen=True)
class Values:
    """One column of one record batch, as places in the stream: ``validity`` (offset, length; length 0
    when it holds no nulls), ``offsets`` (``rows + 1`` ints, a view: variable-size columns only, else
    ``None``) and where its values (``data``) start."""

    rows: int
    nulls: int
    validity: tuple[int, int]
    offsets: np.ndarray | None
    data: int
    data_length: int

    def valid(self, buf) -> np.ndarray:
        """bool per row: not null."""
        if self.nulls == 0 or self.validity[1] == 0:
            return np.ones(self.rows, bool)
        bits = np.frombuffer(buf, np.uint8, self.validity[1], self.validity[0])
        return np.unpackbits(bits, count=self.rows, bitorder="little").astype(bool)


@dataclass(frozen=True)
class Stream:
    """An Arrow IPC stream read in place: its ``columns`` and each record batch's ``Values`` per
    column; ``ended``: the end-of-stream marker was read."""

    columns: list[Column]
    batches: list[list[Values]]
    ended: bool

    @property
    def rows(self) -> int:
        return sum(batch[0].rows for batch in self.batches) if self.columns else 0


def _schema(message: _Table) -> list[Column]:
    schema = message.table(2)
    if schema is None:
        raise ArrowFormatError("a schema message without a schema")
    columns = []
    for field in schema.tables(1):
        kind = field.scalar(2, _U8)
        if kind not in (INT, *_OFFSET_WIDTH):
            raise ArrowFormatError(f"column {field.string(0)!r} has a type this reader does not handle ({kind})")
        if kind == INT:
            spec = field.table(3)
            if spec is None or spec.scalar(0, _I32) != 64:
                raise ArrowFormatError(f"column {field.string(0)!r}: only 64-bit integers are handled")
        columns.append(Column(field.string(0), kind, bool(field.scalar(1, _U8))))
    return columns


@lru_cache(maxsize=64)
def _schema_of(metadata: bytes) -> list[Column]:
    """The columns of a schema message's metadata, remembered: a client reads the same few schemas
    in every answer."""
    return _schema(_Table(memoryview(metadata), _U32.unpack_from(metadata, 0)[0]))


def _record_batch(message: _Table, columns: list[Column], body: int, body_length: int) -> list[Values]:
    batch = message.table(2)
    if batch is None:
        raise ArrowFormatError("a record batch message without a record batch")
    if batch.table(3) is not None:
        raise ArrowFormatError("compressed record batches are not handled")
    nodes = batch.structs(1, 2)
    buffers = batch.structs(2, 2)
    if len(nodes) != len(columns) or len(buffers) != sum(c.buffers for c in columns):
        raise ArrowFormatError("a record batch does not match its schema")
    if len(buffers) and int((buffers[:, 0] + buffers[:, 1]).max()) > body_length:
        raise ArrowFormatError("a record batch's buffer lies past its body")
    out, b = [], 0
    for column, (rows, nulls) in zip(columns, nodes.tolist()):
        validity = (body + int(buffers[b, 0]), int(buffers[b, 1]))
        if column.type in _OFFSET_WIDTH:
            width = _OFFSET_WIDTH[column.type]
            at, length = int(buffers[b + 1, 0]), int(buffers[b + 1, 1])
            if length < (rows + 1) * width:
                raise ArrowFormatError(f"column {column.name!r}: an offsets buffer too short for {rows} rows")
            offsets = np.frombuffer(message.buf, f"<i{width}", rows + 1, body + at)
            data = (body + int(buffers[b + 2, 0]), int(buffers[b + 2, 1]))
        else:
            offsets, data = None, (body + int(buffers[b + 1, 0]), int(buffers[b + 1, 1]))
        out.append(Values(rows, nulls, validity, offsets, *data))
        b += column.buffers
    return out


def read_stream(buf: bytes | memoryview) -> Stream:
    """The messages of a stream held whole in ``buf``. A stream cut short returns what it holds so far
    with ``ended`` False; anything else malformed raises ``ArrowFormatError``."""
    buf = memoryview(buf).cast("B")
    end, at = len(buf), 0
    columns: list[Column] | None = None
    batches: list[list[Values]] = []
    try:
        while at + 8 <= end:
            size = _I32.unpack_from(buf, at)[0]
            if buf[at:at + 4] == CONTINUATION:
                size, at = _I32.unpack_from(buf, at + 4)[0], at + 8
            else:  # the format before 0.15: no continuation marker
                at += 4
            if size == 0:
                return Stream(columns or [], batches, True)
            if size < 0 or at + size > end:
                break
            message = _Table(buf, at + _U32.unpack_from(buf, at)[0])
            kind, body_length = message.scalar(1, _U8), message.scalar(3, _I64)
            body, at = at + size, at + size + body_length
            if at > end:
                break
            if kind == SCHEMA:
                columns = _schema_of(bytes(buf[body - size:body]))
            elif kind == RECORD_BATCH:
                if columns is None:
                    raise ArrowFormatError("a record batch before the schema")
                batches.append(_record_batch(message, columns, body, body_length))
            else:
                raise ArrowFormatError(f"a message of a kind this reader does not handle ({kind})")
    except struct.error:
        raise ArrowFormatError("a message's metadata points outside the stream") from None
    return Stream(columns or [], batches, False)
