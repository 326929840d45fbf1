"""One block file of the cache: its format, the one way of writing it, and the one way of
reading it verified.

A block file is the block's payload, then an XXH3-64 digest per 16 KiB chunk, then a
footer (magic, payload length, chunk count). A reader verifies only the chunks it reads,
so a 10 KiB sample costs one small ``pread`` plus a checksum over at most two chunks, and a
corrupt or truncated file is detected, never served.

Files are written whole under a temporary name and renamed into place, and removed by
unlinking, never changed in place: an open ``BlockFile`` keeps reading the bytes it was
opened on, whatever happens to the name meanwhile. Its owner (``cache.py``) and a sibling
worker reading the owner's directory (``siblings.py``) both read through this class.
"""

from __future__ import annotations

import errno
import io
import mmap
import os
import struct
import threading

from xxhash import xxh3_64_intdigest

CHUNK = 16 * 1024
_FOOTER = struct.Struct("<4sQI")  # magic, payload length, chunk count
_MAGIC = b"SFB2"


class BadBlock(ValueError):
    """A block file that fails its checks (truncated, bad footer, checksum mismatch)."""


def file_size(length: int) -> int:
    """The size of the block file of a ``length``-byte payload."""
    return length + 8 * -(-length // CHUNK) + _FOOTER.size


def trailer(payload: bytes | memoryview) -> bytes:
    """What follows ``payload`` in its block file: the chunk digests and the footer."""
    view = memoryview(payload)
    digests = [xxh3_64_intdigest(view[i:i + CHUNK]) for i in range(0, len(view), CHUNK)]
    return struct.pack(f"<{len(digests)}Q", *digests) + _FOOTER.pack(_MAGIC, len(view), len(digests))


def write_file(path: str | os.PathLike, payload: bytes | memoryview, *, direct: bool) -> bool:
    """Write ``payload`` and its trailer as a new block file at ``path``; whether it went
    direct. With ``direct``, the file is written around the page cache (``O_DIRECT``) if
    the filesystem allows; where it refuses (tmpfs before Linux 6.6, some FUSE
    filesystems), the file is written buffered and ``False`` returned.

    Why direct: the service keeps its hot blocks in its own RAM tier (``memtier.py``), so
    a second copy in the page cache only costs RAM, and kernel CPU to fill it (about eight
    times the CPU of a direct write: docs/benchmarks.md, "Figures behind the code").
    """
    tail = trailer(payload)
    if direct and hasattr(os, "O_DIRECT"):
        try:
            _write_direct(path, memoryview(payload), tail)
            return True
        except OSError as err:
            if err.errno != errno.EINVAL:
                raise
    with open(path, "wb") as f:
        f.write(payload)
        f.write(tail)
    return False


_PIECE = (1 << 20) + (64 << 10)  # bytes per direct write (a 1 MiB block and its trailer in one), per thread
_ALIGN = 4096  # O_DIRECT wants buffers, lengths and offsets aligned to the device's blocks
_buffers = threading.local()


def _write_direct(path, payload: memoryview, tail: bytes) -> int:
    buffer = getattr(_buffers, "buffer", None)
    if buffer is None:
        buffer = _buffers.buffer = mmap.mmap(-1, _PIECE)  # mmap'd memory is page-aligned
    size = len(payload) + len(tail)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
    try:
        filled = 0
        for piece in [payload[i:i + _PIECE] for i in range(0, len(payload), _PIECE)] + [memoryview(tail)]:
            while piece:
                n = min(len(piece), _PIECE - filled)
                buffer[filled:filled + n] = piece[:n]
                filled, piece = filled + n, piece[n:]
                if filled == _PIECE:
                    _write_all(fd, buffer)
                    filled = 0
        if filled:  # the last piece goes out padded to the alignment, then is cut to size
            with memoryview(buffer) as view:
                _write_all(fd, view[:-(-filled // _ALIGN) * _ALIGN])
            os.ftruncate(fd, size)
    finally:
        os.close(fd)
    return size


def _write_all(fd: int, data) -> None:
    if os.write(fd, data) != len(data):  # a direct write is whole or fails; short means a full disk
        raise OSError(errno.ENOSPC, "short write")


class BlockFile:
    """An open block file whose size and footer have been checked.

    Opening raises ``OSError`` (``FileNotFoundError``: no such block) or ``BadBlock``;
    ``read`` raises ``OSError`` or ``BadBlock``. The file closes when the last reference
    to it goes, so dropping one never closes a file under a reader.
    """

    __slots__ = ("file", "size", "length", "digests")

    def __init__(self, path: str | os.PathLike, size: int | None = None):
        """Open ``path``; ``size``: the file size the caller knows it by (checked)."""
        self.file = io.FileIO(path, "r")
        fd = self.file.fileno()
        self.size = os.fstat(fd).st_size
        if size is not None and self.size != size:
            raise BadBlock("size changed")
        if self.size < _FOOTER.size:
            raise BadBlock("truncated")
        try:
            magic, length, chunks = _FOOTER.unpack(os.pread(fd, _FOOTER.size, self.size - _FOOTER.size))
            if magic != _MAGIC or length + 8 * chunks + _FOOTER.size != self.size or chunks != -(-length // CHUNK):
                raise BadBlock("bad footer")
            self.digests = struct.unpack(f"<{chunks}Q", os.pread(fd, 8 * chunks, length))
        except struct.error:  # the file shrank under us
            raise BadBlock("truncated") from None
        self.length = length

    def read(self, ranges: list[tuple[int, int]] | None) -> list[bytes | memoryview]:
        """Bytes ``[start, end)`` of the payload for each range (``None``: the whole payload),
        verified: views of the bytes read (the whole payload: those bytes), never a copy."""
        ranges = [(0, self.length)] if ranges is None else ranges
        if max(end for _, end in ranges) > self.length:
            raise BadBlock("range past the end of the block")
        spans = [(start // CHUNK, (end - 1) // CHUNK) for start, end in ranges]
        first, last = min(f for f, _ in spans), max(l for _, l in spans)
        if last - first + 1 <= 2 * sum(l - f + 1 for f, l in spans):
            # Close together (a sample's members, neighbouring samples): one read.
            data = self._verified(first, last)
            if ranges == [(0, self.length)]:
                return [data.obj]
            base = first * CHUNK
            return [data[start - base:end - base] for start, end in ranges]
        out = []
        for (start, end), (f, l) in zip(ranges, spans):
            data = self._verified(f, l)
            out.append(data[start - f * CHUNK:end - f * CHUNK])
        return out

    def _verified(self, first: int, last: int) -> memoryview:
        """Chunks ``first..last`` of the payload, each checked against its digest."""
        stop = min((last + 1) * CHUNK, self.length)  # the last chunk may be short
        data = memoryview(os.pread(self.file.fileno(), stop - first * CHUNK, first * CHUNK))
        if len(data) != stop - first * CHUNK:
            raise BadBlock("file shrank")
        digests = self.digests
        for i in range(last - first + 1):
            if xxh3_64_intdigest(data[i * CHUNK:(i + 1) * CHUNK]) != digests[first + i]:
                raise BadBlock("checksum mismatch")
        return data
