"""Block buffers reused, not allocated: page-aligned, already faulted in, never zeroed again.

A fresh 1 MiB ``bytearray`` filled costs about 0.9 ms of CPU here, a pool buffer filled 0.02 ms
(``calloc`` maps new pages; each is faulted and zeroed on first touch:
``python -m shardfeed.benchmarks.slabs``), more than reading the MiB from the store or
writing it to disk. The service reads every block into a
buffer of this pool instead: the store's answers are received into one (``stores/getter.py``),
the block cache reads into one (``cache/slabs.py``), the RAM tier keeps them (``memtier.py``),
and the cache writes them to disk around the page cache straight from it: a pool buffer is
page-aligned, so an ``O_DIRECT`` write needs no copy.

When is a buffer free again? Whoever uses a block holds a ``memoryview`` of its buffer (a
slice in a response being sent, the RAM tier's entry, a write queued): each such view holds
a reference to the buffer's ``mmap``, and a buffer nothing refers to but the pool is free.
So nothing is ever handed back by hand, and a buffer is never reused under a reader: a
response still sending a slice keeps its buffer out of the pool until the last byte is gone.

Bounded: the pool keeps at most ``limit`` bytes of buffers (the RAM tier's capacity plus
the store reads in flight, ``server.py``); past it a request gets a buffer of its own,
freed as usual when the last view of it goes. A request larger than ``buffer_size`` gets
one of its own too.
"""

from __future__ import annotations

import ctypes
import mmap
import sys
import threading
from collections import OrderedDict

ALIGN = 4096
"""``O_DIRECT`` wants buffers, lengths and offsets aligned to the device's blocks."""


_TRIES = 8
"""Buffers the RAM tier let go of that a take looks at (one still being sent waits its turn)."""
_SEARCH = 16
"""Buffers a take looks at beyond those, round the pool, before it makes a new one (or, at the
pool's limit, one of its own)."""


def aligned(n: int) -> int:
    """``n`` rounded up to a multiple of ``ALIGN``."""
    return -(-n // ALIGN) * ALIGN


class BufferPool:
    """Page-aligned buffers of ``buffer_size`` bytes (rounded up to ``ALIGN``), at most ``limit``
    bytes of them kept. Thread-safe: the event loop takes buffers for the store's answers, the
    cache's threads for disk reads."""

    def __init__(self, buffer_size: int, limit: int):
        self.buffer_size = aligned(max(buffer_size, 1))
        self.limit = limit
        self._buffers: list[mmap.mmap] = []
        self._ours: set[int] = set()  # ids of the pool's buffers
        self._returned: OrderedDict[int, mmap.mmap] = OrderedDict()  # let go of by the RAM tier, oldest first
        self._next = 0  # where a search for a free buffer goes on: round the pool
        self._lock = threading.Lock()
        self.made = 0  # buffers made for the pool (each faulted in once)
        self.outside = 0  # buffers made outside it (past its limit, or larger than its buffers)

    def take(self, length: int) -> memoryview:
        """A writable view of ``length`` bytes at the start of a free buffer (its bytes are
        whatever was there: the caller fills them). Never waits."""
        if length <= self.buffer_size:
            with self._lock:
                buffer = self._free_buffer()
            if buffer is not None:
                return memoryview(buffer)[:length]
        self.outside += 1
        return memoryview(_mapped(aligned(max(length, 1))))[:length]

    def returned(self, view: memoryview) -> None:
        """The RAM tier let go of this block: its buffer is free once the responses still
        sending from it are done. A hint, to find free buffers without a search."""
        buffer = view.obj
        if id(buffer) in self._ours:
            with self._lock:
                self._returned[id(buffer)] = buffer

    def _free_buffer(self) -> mmap.mmap | None:
        # Referred to by the pool's list, ``getrefcount``'s argument and, where said, a local
        # name, and nothing else: no view of the buffer is left anywhere (a view holds its
        # buffer through its ``mmap``).
        returned = self._returned
        for _ in range(min(len(returned), _TRIES)):
            _, buffer = returned.popitem(last=False)
            if sys.getrefcount(buffer) == 3:
                return buffer
            returned[id(buffer)] = buffer  # still being sent: later
        buffers = self._buffers
        buffer = self._search(_SEARCH)
        if buffer is None and (len(buffers) + 1) * self.buffer_size <= self.limit:
            buffer = _mapped(self.buffer_size)
            buffers.append(buffer)
            self._ours.add(id(buffer))
            self.made += 1
        return buffer

    def _search(self, steps: int) -> mmap.mmap | None:
        """A free buffer among the next ``steps`` round the pool."""
        buffers = self._buffers
        count = len(buffers)
        for step in range(min(count, steps)):
            at = (self._next + step) % count
            if sys.getrefcount(buffers[at]) == 2:
                self._next = at + 1
                return buffers[at]
        if count:
            self._next = (self._next + steps) % count
        return None

    @property
    def bytes(self) -> int:
        """Bytes of buffers the pool keeps."""
        return len(self._buffers) * self.buffer_size

    def whole(self, view: memoryview) -> memoryview | None:
        """The aligned extent of a view that starts at the start of a pool-made buffer (the
        bytes from its start, ``len(view)`` rounded up to ``ALIGN``), for an ``O_DIRECT``
        write without a copy; ``None`` for any other view."""
        buffer = view.obj
        if not isinstance(buffer, mmap.mmap) or len(buffer) < aligned(len(view)):
            return None
        with memoryview(buffer) as base:
            if _address(base) != _address(view):
                return None
        return memoryview(buffer)[:aligned(len(view))]


def _mapped(size: int) -> mmap.mmap:
    """New anonymous memory, its pages faulted in at once (``MAP_POPULATE``: in one call, not a
    trap a page when first written, about half the CPU here: 0.40 against 0.76 ms a MiB)."""
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
    return mmap.mmap(-1, size, flags=flags)


def _address(view: memoryview) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(view))
