"""Raw shards served from their compressed objects: MDS's ``zip_data`` and LitData's zstd
chunks, read in place, never rewritten.

A dataset's index names each sample by its RAW shard (``shard.00000.mds``, ``chunk-0-0.bin``)
and offsets into the raw, decompressed bytes. ``CompressedShards`` wraps the dataset's store
and serves those raw shards from the compressed objects beside them (``Compressed``); every
other path passes through. A raw shard's version is its compressed object's (``list`` names it
so), and every read asks for that version: an overwritten shard is ``ObjectChanged``.

Whole-file codecs (MDS's ``zstd``, ``gz``, ``bz2``, ``br``, ``snappy``, at any level; LitData's
``compression_level="chunk"`` ``.zstd.bin``) are read whole once, decompressed in a thread and
held, in a bounded LRU of ``held_bytes`` (``HELD_BYTES``), so the reads that follow are slices
of the held raw shard; concurrent readers share one read. The costs: a shard's first sample
waits for the whole compressed shard and its decompression (figures: docs/architecture.md,
"Compressed shards"), and each held shard costs its raw size in RAM. A read near the start of a shard
that is not held (the index's header scan: a few KiB of each shard) decodes a compressed
prefix instead (``PREFIX_LIMIT``; snappy cannot, and is read whole).

LitData's framed chunks (``LDFZ01``, ``framed.py``) need no whole read: their table is read
once (held too, small), then only the frames a read overlaps, each held as it is decompressed.

Corrupt compressed bytes, or a raw size other than the index's, are ``CorruptObject`` naming
the shard, never bytes. The codecs are Arrow's (``pyarrow``, the index's library already);
their checks are the codecs' own: gzip's and bzip2's checksums, zstd's where the writer
wrote one (MDS and LitData do not), the stream's structure and the sizes otherwise.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterable, AsyncIterator, Mapping
from dataclasses import dataclass

import pyarrow as pa
import xxhash

from shardfeed.buffers import BufferPool
from shardfeed.service.stores.base import AccessDenied, Arrived, CorruptObject, ObjectInfo, ShortRead, Store
from shardfeed.service.stores.framed import FrameTable, FrameTableError, table_size
from shardfeed.service.stores.lru import Lru

HELD_BYTES = 256 << 20
"""Raw bytes held by default: four 64 MiB shards (Streaming's and LitData's default shard size),
decompressed, with their frame tables."""
PREFIX_LIMIT = 1 << 20
"""A read of a shard that is not held, ending within this many raw bytes (and within the first
quarter of the shard, where its size is known: past that, the whole shard is cheaper), decodes
a prefix."""
FIRST_READ = 64 << 10
"""The first ranged read of a prefix or a frame table; a prefix grows by doubling."""
PREFIX_READ_LIMIT = 4 * PREFIX_LIMIT
"""Compressed bytes a prefix may grow to before the shard is read whole instead."""

DIGESTS = {**{name: getattr(hashlib, name) for name in hashlib.algorithms_available
              if hasattr(hashlib, name) and not name.startswith("shake_")},
           **{name: getattr(xxhash, name) for name in xxhash.algorithms_available}}
"""The hashes a peer may record of a shard, as Streaming computes them (``streaming/base/hashing.py``)."""
CODECS = {"zstd": "zstd", "gz": "gzip", "bz2": "bz2", "br": "brotli", "snappy": "snappy"}
"""The peers' codec names (``zstd:7`` is ``zstd`` at level 7) and Arrow's for them."""
STREAMED = {"zstd", "gzip", "bz2", "brotli"}
"""Arrow's codecs that decode a stream, so a prefix: snappy's blocks decode whole only."""


@dataclass(frozen=True)
class Compressed:
    """Where and how a raw shard is stored compressed."""

    path: str
    """The compressed object in the wrapped store (``shard.00000.mds.zstd``; for a framed
    LitData chunk, the raw name itself)."""
    codec: str
    """The peer's name: MDS's ``zstd``, ``zstd:LEVEL``, ``gz``, ``gz:LEVEL``, ``bz2``, ``br``,
    ``snappy``; LitData's ``zstd``, ``zstd:LEVEL``."""
    raw_size: int | None = None
    """The decompressed size, where the peer's ``index.json`` says it (MDS's ``raw_data.bytes``,
    LitData's ``chunk_bytes`` of a ``.zstd.bin`` chunk); checked against the bytes."""
    frames: bool = False
    """LitData's framed zstd layout (``LDFZ01``): read by frames, never whole."""
    digests: tuple[tuple[str, str], ...] = ()
    """``(algorithm, hex digest)`` of the compressed object, where the peer's index records them
    (MDS's ``zip_data.hashes``: ``sha1``, ``xxh64``, ...): a whole read is checked against each."""

    def __post_init__(self):
        for algorithm, _ in self.digests:
            if algorithm not in DIGESTS:
                raise ValueError(f"{self.path}: hash {algorithm!r} is not known (known: {', '.join(sorted(DIGESTS))})")
        family, _, level = self.codec.partition(":")
        if family not in CODECS or (level and not level.isdigit()):
            raise ValueError(f"{self.path}: compression {self.codec!r} is not understood "
                             f"(known: {', '.join(CODECS)}, each with an optional :LEVEL)")
        if self.frames and family != "zstd":
            raise ValueError(f"{self.path}: framed chunks are zstd, not {self.codec!r}")

    @property
    def arrow_codec(self) -> str:
        return CODECS[self.codec.partition(":")[0]]


class CompressedShards(Store):
    """``store``, with the raw shards of ``shards`` (raw path -> ``Compressed``) served from
    their compressed objects. ``held_bytes``: the decompressed shards, frames and frame tables
    kept (least recently used dropped first); a shard larger than that is read again for
    each read, so it should hold a few shards."""

    def __init__(self, store: Store, shards: Mapping[str, Compressed], *, held_bytes: int = HELD_BYTES):
        self.store = store
        self.url = store.url
        self.shards = dict(shards)
        self._raw_of = {shard.path: raw for raw, shard in self.shards.items()}
        self.held: Lru[tuple, pa.Buffer | FrameTable] = Lru(self._load, held_bytes, _held_size)

    # -- raw bytes ---------------------------------------------------------------------------

    async def read_range(self, path: str, offset: int, size: int, version: str | None = None) -> bytes:
        shard = self.shards.get(path)
        if shard is None:
            return await self.store.read_range(path, offset, size, version)
        version = await self._version(shard, version)
        if shard.frames:
            return await self._framed_range(path, offset, size, version)
        whole = ("whole", path, version)
        near = PREFIX_LIMIT if shard.raw_size is None else min(PREFIX_LIMIT, shard.raw_size // 4)
        if offset + size <= near and not self.held.has(whole):
            prefix = await self._prefix(path, offset + size, version)
            if prefix is not None:
                return prefix[offset:]
        return self._cut(path, await self.held.get(whole), offset, size)

    async def read_pieces(self, path: str, offset: int, size: int, piece: int,
                          version: str | None = None, *, arrived: Arrived | None = None,
                          buffers: BufferPool | None = None) -> list[bytes]:
        if path in self.shards:  # cut from one read_range (base.Store's way)
            return await super().read_pieces(path, offset, size, piece, version, arrived=arrived, buffers=buffers)
        return await self.store.read_pieces(path, offset, size, piece, version, arrived=arrived, buffers=buffers)

    async def read(self, path: str, version: str | None = None) -> bytes:
        shard = self.shards.get(path)
        if shard is None:
            return await self.store.read(path, version)
        version = await self._version(shard, version)
        if shard.frames:
            table = await self.held.get(("table", path, version))
            return await self._framed_range(path, 0, table.raw_size, version)
        return (await self.held.get(("whole", path, version))).to_pybytes()

    async def head(self, path: str) -> ObjectInfo:
        """A raw shard's size and its compressed object's version. Where its index gives no
        size, a framed chunk's table or the whole shard is read to learn it."""
        shard = self.shards.get(path)
        if shard is None:
            return await self.store.head(path)
        info = await self.store.head(shard.path)
        size = shard.raw_size
        if size is None and shard.frames:
            size = (await self.held.get(("table", path, info.etag))).raw_size
        elif size is None:
            size = len(await self.held.get(("whole", path, info.etag)))
        return ObjectInfo(path, size, info.etag)

    async def _version(self, shard: Compressed, version: str | None) -> str | None:
        """The version to read: the one asked for, else the compressed object's now (so what
        is held is never of another)."""
        return version if version is not None else (await self.store.head(shard.path)).etag

    def _cut(self, path: str, raw: pa.Buffer, offset: int, size: int) -> bytes:
        if offset + size > len(raw):
            raise ShortRead(f"{self.url}/{path}: wanted {size} bytes at {offset}, "
                            f"got {max(0, len(raw) - offset)}")
        return memoryview(raw)[offset:offset + size].tobytes()

    async def _prefix(self, path: str, want: int, version: str | None) -> bytes | None:
        """The first ``want`` raw bytes, decoded from a compressed prefix read by doubling
        ranges; ``None`` where the shard is to be read whole (too small for the next range, a
        codec that cannot stream, a prefix grown past ``PREFIX_READ_LIMIT``)."""
        shard = self.shards[path]
        if shard.arrow_codec not in STREAMED:
            return None
        prefix = bytearray()
        while len(prefix) < PREFIX_READ_LIMIT:
            try:
                prefix += await self.store.read_range(shard.path, len(prefix), len(prefix) or FIRST_READ, version)
            except ShortRead:  # the whole object is shorter: read it whole, and hold it
                return None
            raw = await asyncio.to_thread(_decode_prefix, shard.arrow_codec, prefix, want)
            if raw is not None:
                return raw
        return None

    async def _framed_range(self, path: str, offset: int, size: int, version: str | None) -> bytes:
        table = await self.held.get(("table", path, version))
        end = offset + size
        if end > table.raw_size:
            raise ShortRead(f"{self.url}/{path}: wanted {size} bytes at {offset}, "
                            f"got {max(0, table.raw_size - offset)}")
        parts = [table.header()[offset:end]] if offset < table.header_size else []
        numbers = table.overlapping(max(offset, table.header_size), end)
        frames = await asyncio.gather(*(self.held.get(("frame", path, version, n)) for n in numbers))
        for n, frame in zip(numbers, frames):
            start = int(table.starts[n])
            parts.append(memoryview(frame)[max(offset - start, 0):end - start])
        return b"".join(parts)

    # -- what is held ------------------------------------------------------------------------

    async def _load(self, key: tuple) -> pa.Buffer | FrameTable:
        kind, path, version, *frame = key
        shard = self.shards[path]
        if kind == "table":
            return await self._load_table(path, shard, version)
        if kind == "frame":
            table = await self.held.get(("table", path, version))
            spec = table.frames[frame[0]]
            data = await self.store.read_range(shard.path, int(spec["compressed_off"]),
                                               int(spec["compressed_len"]), version)
            return await self._decompress(path, shard, data, int(spec["uncompressed_len"]),
                                          f"{shard.path} frame {frame[0]}", "its table")
        data = await self.store.read(shard.path, version)
        if shard.digests:
            await asyncio.to_thread(_check_digests, f"{self.url}/{path}: {shard.path}", data, shard.digests)
        return await self._decompress(path, shard, data, shard.raw_size,
                                      shard.path, "its index")

    async def _load_table(self, path: str, shard: Compressed, version: str | None) -> FrameTable:
        try:
            head, whole = await self.store.read_range(shard.path, 0, FIRST_READ, version), False
        except ShortRead:  # a chunk smaller than that
            head, whole = await self.store.read(shard.path, version), True
        try:
            need = table_size(head)
            if need > len(head) and not whole:
                head += await self.store.read_range(shard.path, len(head), need - len(head), version)
            table = FrameTable.parse(head)
        except (FrameTableError, ShortRead) as err:
            raise CorruptObject(f"{self.url}/{path}: {shard.path} is not a framed zstd chunk: {err}") from None
        if shard.raw_size is not None and shard.raw_size != table.raw_size:
            raise CorruptObject(f"{self.url}/{path}: {shard.path} frames {table.raw_size} raw bytes, "
                                f"its index says {shard.raw_size}")
        return table

    async def _decompress(self, path: str, shard: Compressed, data: bytes, raw_size: int | None,
                          what: str, sizer: str) -> pa.Buffer:
        """``data`` (``what``: the object, or its frame) decompressed in a thread, or
        ``CorruptObject`` naming the raw shard and ``what``; ``raw_size`` bytes where known
        (``sizer`` says it)."""
        where = f"{self.url}/{path}: {what}"
        try:
            raw = await asyncio.to_thread(_decode, shard.arrow_codec, data, raw_size)
        except (OSError, pa.ArrowException, ValueError) as err:
            raise CorruptObject(f"{where} does not decompress as {shard.codec}: {err}") from None
        if raw_size is not None and len(raw) != raw_size:
            raise CorruptObject(f"{where} decompresses to {'more than ' if len(raw) > raw_size else ''}"
                                f"{len(raw)} bytes, {sizer} says {raw_size}")
        return raw

    # -- the rest ----------------------------------------------------------------------------

    async def list(self, prefix: str = "") -> list[ObjectInfo]:
        return self._as_raw(await self.store.list(prefix), prefix)

    async def list_pages(self, prefix: str = "") -> AsyncIterator[list[ObjectInfo]]:
        """Each page of the wrapped store's, with each compressed shard listed under its raw name
        too (in its page, each page sorted), of its version and its raw size where known (else
        its own). An object at a raw shard's name (Streaming's decompressed copy beside its
        ``.mds.zstd``) is not what is served, and is left out."""
        async for page in self.store.list_pages(prefix):
            yield self._as_raw(page, prefix)

    def _as_raw(self, page: list[ObjectInfo], prefix: str) -> list[ObjectInfo]:
        out = [info for info in page if info.path not in self.shards]
        for info in page:
            raw = self._raw_of.get(info.path)
            if raw is not None and raw.startswith(prefix):
                size = self.shards[raw].raw_size
                out.append(ObjectInfo(raw, info.size if size is None else size, info.etag))
        return sorted(out, key=lambda info: info.path)

    async def write(self, path: str, data: bytes) -> None:
        self._refuse(path)
        await self.store.write(path, data)

    async def write_stream(self, path: str, chunks: AsyncIterable[bytes | memoryview]) -> int:
        self._refuse(path)
        return await self.store.write_stream(path, chunks)

    def _refuse(self, path: str) -> None:
        if path in self.shards:
            raise AccessDenied(f"{self.url}/{path}: served from {self.shards[path].path}; shards are never written")

    async def close(self) -> None:
        await self.store.close()


def _held_size(value: pa.Buffer | FrameTable) -> int:
    return value.nbytes if isinstance(value, FrameTable) else value.size


def _check_digests(what: str, data: bytes, digests: tuple[tuple[str, str], ...]) -> None:
    """``CorruptObject`` unless ``data`` has each digest (zstd as the peers write it carries no
    checksum of its own: a flipped byte could decode)."""
    for algorithm, expected in digests:
        found = DIGESTS[algorithm](data).hexdigest()
        if found != expected:
            raise CorruptObject(f"{what}: its {algorithm} is {found}, its index says {expected}")


def _decode(codec: str, data: bytes, raw_size: int | None) -> pa.Buffer:
    """``data`` decompressed whole; with ``raw_size``, at most one byte more is made (a
    corrupt shard cannot blow up past its index's size)."""
    if codec == "snappy":  # raw snappy: its length first, as a varint
        length = _varint(data)
        if raw_size is not None and length != raw_size:
            raise ValueError(f"its length field says {length} bytes, its index says {raw_size}")
        if length > 32 * len(data) + 32:
            raise ValueError(f"its length field says {length} bytes, more than {len(data)} bytes of snappy hold")
        return pa.Codec("snappy").decompress(data, decompressed_size=length)
    stream = pa.CompressedInputStream(pa.py_buffer(data), codec)
    return stream.read_buffer() if raw_size is None else stream.read_buffer(raw_size + 1)


def _decode_prefix(codec: str, prefix: bytearray, want: int) -> bytes | None:
    """The first ``want`` bytes ``prefix`` decodes to; ``None`` if it decodes to fewer, or
    fails (cut mid-block, or corrupt: the whole read will tell which)."""
    try:
        raw = pa.CompressedInputStream(pa.py_buffer(prefix), codec).read(want)
    except (OSError, pa.ArrowException):
        return None
    return raw if len(raw) == want else None


def _varint(data: bytes) -> int:
    value = 0
    for shift, byte in zip(range(0, 35, 7), data):
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value
    raise ValueError("no snappy length")
