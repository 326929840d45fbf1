"""Where the block cache keeps its blocks: slots in a few large files (slabs), one per slot size.

A file per block cost more CPU to create, rename and unlink than to write its MiB (0.21 ms
a MiB with its eviction, against 0.09 ms for a slot written and punched here:
``python -m shardfeed.benchmarks.slabs``, figures in docs/benchmarks.md). So blocks live
in slots instead, the slots of one size in one file, ``slabs/<slot size, hex>.data``:
a slot is 4 KiB times a power of two, up to the block size rounded up to 4 KiB, and a
block takes the smallest slot that holds it (a shard's short last block, or a small
object of a GetBatch request, does not take a whole block's slot). A block's place is its
slot size's number and its slot, in one 32-bit integer (``place``).

Each slot's header is in a second file, ``slabs/<slot size, hex>.head``, at a fixed size a
slot: the block's name (``block_name``: a digest of its dataset, shard version, block size
and number), its length, and an XXH3-64 digest per 16 KiB chunk. Payloads are written and
large ones read around the page cache (``O_DIRECT``: offsets and lengths are 4 KiB
aligned, buffers come from the pool, ``shardfeed/buffers.py``), headers through it (small,
and read on every read). Why around it: the service keeps its hot blocks in its own RAM
tier (``memtier.py``), so a second copy in the page cache only costs RAM and kernel CPU to
fill (a MiB read through the page cache the first time cost 1.4 ms here, against 0.07 ms
read around it into a pool buffer). A read checks the header's name and the digests of the chunks it
reads, so a slot cut short, overwritten by another block or never written is detected,
never served. That is why a slot is never sent with ``sendfile``/``splice`` (which would
save the read's copy into user space, 0.07 ms a MiB): the kernel would send bytes no one
checked, and a slot can be given back and written again between a check and a send. A read
costs its bytes' copy and their checksums (0.035 ms a MiB), and the bytes sent are the bytes
checked.

The slabs are sparse: a slot is written where it is, and the disk space of a slot let go
of is given back at once (``FALLOC_FL_PUNCH_HOLE``), so the files use what the cache holds
and no more; writing into a hole costs here what writing over old bytes does. Which slots
hold which blocks is the catalogue's (``catalog.py``); this module only reads and writes
slots, and knows which are free (``SlotSpace``).
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import struct
import threading
from pathlib import Path
from typing import NamedTuple

import numpy as np
from xxhash import xxh3_64_intdigest

from shardfeed.buffers import ALIGN, BufferPool, aligned

log = logging.getLogger("shardfeed.cache")

CHUNK = 16 * 1024
"""Bytes a checksum covers: a read verifies only the chunks it reads."""
_HEAD = struct.Struct("<4sIQ")  # magic, payload length, block name
_MAGIC = b"SFS1"
SIZE_SHIFT = 27
"""A place is its slot size's number << ``SIZE_SHIFT`` | its slot."""
POOLED_READ = 64 * 1024
"""Reads this large go around the page cache into a pool buffer; smaller ones through it, into a
new ``bytes`` (cheap at that size, and a small hot sample stays in the page cache)."""
_PUNCH_HOLE = 0x02 | 0x01  # FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE


class BadBlock(ValueError):
    """A slot that fails its checks (not the block asked for, cut short, checksum mismatch)."""


class NotThisBlock(BadBlock):
    """A slot whose header names another block, or none: given back and written again, or never written."""


def block_name(dataset: str, shard: str, block_size: int, block: int) -> int:
    """The 64-bit name of a block, written in its slot's header and checked on every read."""
    return xxh3_64_intdigest(f"{dataset}/{shard}/{block_size}/{block}".encode())


def slot_sizes(block_size: int) -> list[int]:
    """The slot sizes for blocks of ``block_size``: 4 KiB doubling, then the block rounded up."""
    sizes, size = [], ALIGN
    while size < aligned(block_size):
        sizes.append(size)
        size *= 2
    return [*sizes, aligned(block_size)]


def place_of(size_number: int, slot: int) -> int:
    return size_number << SIZE_SHIFT | slot


def split_place(place: int) -> tuple[int, int]:
    return place >> SIZE_SHIFT, place & ((1 << SIZE_SHIFT) - 1)


def header_size(slot_size: int) -> int:
    return _HEAD.size + 8 * -(-slot_size // CHUNK)


class SlotLocation(NamedTuple):
    data: Path  # the slab
    offset: int  # of the slot in it
    size: int  # of the slot
    head: Path  # the slab's headers
    head_offset: int  # of the slot's header in it
    head_size: int  # of a header of this slot size


class SlotSpace:
    """Which slots of each size are free: those below each size's high mark not in use (a
    stack, so a slot let go of is the next taken). Not thread-safe: the cache holds its lock."""

    def __init__(self, block_size: int):
        self.sizes = slot_sizes(block_size)
        self._high = [0] * len(self.sizes)
        self._free: list[list[int]] = [[] for _ in self.sizes]

    def fits(self, length: int) -> int:
        """The number of the smallest slot size that holds ``length`` bytes."""
        need = aligned(max(length, 1))
        return next(n for n, size in enumerate(self.sizes) if size >= need)

    def take(self, length: int) -> int:
        """A free place for a block of ``length`` bytes."""
        number = self.fits(length)
        free = self._free[number]
        if free:
            return place_of(number, free.pop())
        if self._high[number] >= 1 << SIZE_SHIFT:
            raise OverflowError("more than 2^27 slots of one size")
        self._high[number] += 1
        return place_of(number, self._high[number] - 1)

    def give_back(self, place: int) -> None:
        number, slot = split_place(place)
        self._free[number].append(slot)

    def taken(self, places: np.ndarray) -> None:
        """Start from the places a previous run left in use (the catalogue's): the others are free."""
        places = places.astype(np.int64)
        for number in range(len(self.sizes)):
            slots = places[places >> SIZE_SHIFT == number] & ((1 << SIZE_SHIFT) - 1)
            self._high[number] = int(slots.max()) + 1 if len(slots) else 0
            self._free[number] = np.setdiff1d(np.arange(self._high[number]), slots)[::-1].tolist()


class Slabs:
    """The slab files of one cache directory (``directory/slabs``), for one block size.

    Args:
        directory: the cache directory.
        block_size: the blocks' size: it fixes the slot sizes.
        direct: payloads written (and large ones read) around the page cache where the
            filesystem allows; where it refuses (tmpfs before Linux 6.6, some FUSE
            filesystems), through it, and ``direct`` turns ``False``.
        buffers: the pool large reads land in, and whole blocks are written from uncopied.
        writable: ``False``: open the files read-only (a sibling worker's, ``siblings.py``).
    """

    def __init__(self, directory: Path, block_size: int, *, direct: bool = True,
                 buffers: BufferPool | None = None, writable: bool = True):
        self.directory = Path(directory) / "slabs"
        self.block_size = block_size
        self.sizes = slot_sizes(block_size)
        self.direct = direct and hasattr(os, "O_DIRECT")
        self.buffers = buffers
        self.writable = writable
        self._files: dict[tuple[int, bool], int] = {}  # (size number, direct) -> fd of its data file
        self._heads: dict[int, int] = {}  # size number -> fd of its header file
        self._lock = threading.Lock()
        self._scratch = threading.local()  # per thread: an aligned buffer to copy unaligned payloads into

    def path(self, number: int, kind: str) -> Path:
        return self.directory / f"{self.sizes[number]:x}.{kind}"

    def location(self, place: int) -> SlotLocation:
        """Where a place's payload and header are."""
        number, slot = split_place(place)
        size = self.sizes[number]
        return SlotLocation(self.path(number, "data"), slot * size, size, self.path(number, "head"),
                            slot * header_size(size), header_size(size))

    def close(self) -> None:
        with self._lock:
            for fd in [*self._files.values(), *self._heads.values()]:
                os.close(fd)
            self._files.clear()
            self._heads.clear()

    # -- writes ------------------------------------------------------------------------
    def write(self, place: int, name: int, payload: bytes | memoryview) -> None:
        """Write a block into a free place: its payload, then its header. ``OSError`` if the
        disk refuses (``ENOSPC``: full)."""
        number, slot = split_place(place)
        size = self.sizes[number]
        view = memoryview(payload)
        if len(view) > size:
            raise ValueError(f"a {len(view)}-byte block does not fit a {size}-byte slot")
        self._write_payload(number, slot * size, view)
        digests = [xxh3_64_intdigest(view[i:i + CHUNK]) for i in range(0, len(view), CHUNK)]
        header = _HEAD.pack(_MAGIC, len(view), name) + struct.pack(f"<{len(digests)}Q", *digests)
        if os.pwrite(self._head(number), header, slot * header_size(size)) != len(header):
            raise OSError(errno.ENOSPC, "short write")

    def _write_payload(self, number: int, offset: int, view: memoryview) -> None:
        if self.direct:
            try:
                self._write_direct(number, offset, view)
                return
            except OSError as err:
                if err.errno != errno.EINVAL:
                    raise
                log.info("the cache's filesystem refuses O_DIRECT: slabs are written and read through the page cache")
                self.direct = False
        if os.pwrite(self._data(number, False), view, offset) != len(view):
            raise OSError(errno.ENOSPC, "short write")

    def _write_direct(self, number: int, offset: int, view: memoryview) -> None:
        # A payload at the start of a pool buffer goes out from there; another is copied
        # into an aligned buffer first. Either is padded to 4 KiB: the slot has the room.
        source = self.buffers.whole(view) if self.buffers is not None else None
        if source is None:
            scratch = getattr(self._scratch, "buffer", None)
            if scratch is None or len(scratch) < aligned(len(view)):
                scratch = self._scratch.buffer = mmap.mmap(-1, max(aligned(len(view)), self.sizes[-1]))
            scratch[:len(view)] = view
            source = memoryview(scratch)[:aligned(len(view))]
        with source:
            if os.pwrite(self._data(number, True), source, offset) != len(source):
                raise OSError(errno.ENOSPC, "short write")

    def punch(self, place: int) -> None:
        """Give a free place's disk space back (its bytes read as zeros from now on)."""
        number, slot = split_place(place)
        size = self.sizes[number]
        try:
            fd = self._data(number, False)
        except OSError:  # no slab to punch (the write that took the place could not open it)
            return
        if _fallocate(fd, _PUNCH_HOLE, slot * size, size) != 0:
            err = ctypes.get_errno()
            if err not in (errno.EOPNOTSUPP, errno.ENOSYS):
                log.debug("punching a hole in %s: %s", self.path(number, "data"), os.strerror(err))

    # -- reads -------------------------------------------------------------------------
    def read(self, place: int, name: int, ranges: list[tuple[int, int]] | None) -> list[bytes | memoryview]:
        """Bytes ``[start, end)`` of the block in ``place`` for each range (``None``: the whole
        payload), verified to be the block ``name``: views of the bytes read, never a copy.
        ``BadBlock`` or ``OSError`` (a file missing: ``FileNotFoundError``) otherwise."""
        number, slot = split_place(place)
        size = self.sizes[number]
        head_size = header_size(size)
        head = os.pread(self._head(number), head_size, slot * head_size)
        if len(head) < _HEAD.size:
            raise BadBlock("no header")
        magic, length, written = _HEAD.unpack_from(head)
        if magic != _MAGIC or written != name or length > size:
            raise NotThisBlock("not this block")
        chunks = -(-length // CHUNK)
        if len(head) < _HEAD.size + 8 * chunks:
            raise BadBlock("header cut short")
        digests = struct.unpack_from(f"<{chunks}Q", head, _HEAD.size)
        ranges = [(0, length)] if ranges is None else ranges
        if max(end for _, end in ranges) > length:
            raise BadBlock("range past the end of the block")
        spans = [(start // CHUNK, (end - 1) // CHUNK) for start, end in ranges]
        first, last = min(f for f, _ in spans), max(l for _, l in spans)
        if last - first + 1 <= 2 * sum(l - f + 1 for f, l in spans):
            # Close together (a sample's members, neighbouring samples): one read.
            data = self._verified(number, slot * size, length, digests, first, last)
            base = first * CHUNK
            return [data[start - base:end - base] for start, end in ranges]
        out = []
        for (start, end), (f, l) in zip(ranges, spans):
            data = self._verified(number, slot * size, length, digests, f, l)
            out.append(data[start - f * CHUNK:end - f * CHUNK])
        return out

    def _verified(self, number: int, offset: int, length: int, digests, first: int, last: int) -> memoryview:
        """Chunks ``first..last`` of a payload, each checked against its digest."""
        stop = min((last + 1) * CHUNK, length)  # the last chunk may be short
        size = stop - first * CHUNK
        at = offset + first * CHUNK
        if size >= POOLED_READ and self.buffers is not None:
            data = self.buffers.take(aligned(size))
            got = os.preadv(self._data(number, self.direct), [data], at)
            data = data[:min(got, size)]
        else:
            data = memoryview(os.pread(self._data(number, False), size, at))
        if len(data) != size:
            raise BadBlock("slab cut short")
        for i in range(last - first + 1):
            if xxh3_64_intdigest(data[i * CHUNK:(i + 1) * CHUNK]) != digests[first + i]:
                raise BadBlock("checksum mismatch")
        return data

    # -- files -------------------------------------------------------------------------
    def _data(self, number: int, direct: bool) -> int:
        fd = self._files.get((number, direct))
        if fd is None:
            flags = (os.O_RDWR | os.O_CREAT if self.writable else os.O_RDONLY) | (os.O_DIRECT if direct else 0)
            try:
                fd = self._open((number, direct), self.path(number, "data"), flags, self._files)
            except OSError as err:
                if not direct or err.errno != errno.EINVAL:
                    raise
                self.direct = False  # the filesystem refuses O_DIRECT at open (tmpfs)
                return self._data(number, False)
        return fd

    def _head(self, number: int) -> int:
        fd = self._heads.get(number)
        if fd is None:
            flags = os.O_RDWR | os.O_CREAT if self.writable else os.O_RDONLY
            fd = self._open(number, self.path(number, "head"), flags, self._heads)
        return fd

    def _open(self, key, path: Path, flags: int, table: dict) -> int:
        with self._lock:
            if key not in table:
                if self.writable:
                    self.directory.mkdir(parents=True, exist_ok=True)
                table[key] = os.open(path, flags, 0o644)
            return table[key]


def _fallocate(fd: int, mode: int, offset: int, length: int) -> int:
    return _libc.fallocate(fd, mode, ctypes.c_long(offset), ctypes.c_long(length))


_libc = ctypes.CDLL(None, use_errno=True)
