"""The RAM tier: whole, verified block payloads kept in memory in front of the block cache.

A disk block is checked (XXH3 per 16 KiB chunk) on every read; a hot block read again and
again pays that, a ``pread`` and a thread hop each time. Here a block is verified once,
when it is read whole from disk or arrives from the store, and then served from memory as
``memoryview`` slices, on the event loop, with no copy and no thread.

The tier holds only blocks the disk cache holds, or is writing: the cache tells it
(``BlockCache.on_forget``) when a block is evicted, replaced or found corrupt, and the tier
drops its copy, so a RAM hit never outlives the disk block it mirrors. A block fetched from
the store enters the tier at once, while it is written, and leaves again if the disk
refuses it (``Coalescer._fetch``). With ``--workers``, it also holds blocks read
from a sibling worker's cache (``siblings.py``), verified the same way; the sibling's
evictions are not heard here, and need not be: a verified block's bytes never change. It
is an LRU bounded by ``capacity`` bytes (``--memory-cache``); a block larger than that is
simply not kept.

Scan resistance: a block fetched from the store enters at once (the batches that wait for
it), but one read from disk only on its second read there within the last reads of about
half the tier's worth of blocks (``admits``; the keys seen once are remembered, not their
bytes). A warm epoch over a dataset larger than the tier reads each block from disk a few
times, far apart: it no longer evicts the blocks read again and again, and its own reads
verify only the chunks of the members asked for, not whole blocks.

Puts and gets run on the event loop; ``discard`` may come from the cache's threads, so
every change holds a lock (uncontended: tens of nanoseconds).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable

from shardfeed.buffers import BufferPool
from shardfeed.service.observe.metrics import Metrics


class MemoryTier:
    """A bounded LRU of verified block payloads, keyed by the block's ``BlockKey`` (a hashable
    tuple: a lookup formats no file name)."""

    def __init__(self, capacity: int, metrics: Metrics, block_size: int, buffers: BufferPool | None = None):
        """``buffers``: the pool the blocks' buffers come from, told of each block let go of."""
        self.capacity = capacity
        self.metrics = metrics
        self.buffers = buffers
        self._blocks: OrderedDict[Hashable, bytes] = OrderedDict()
        self._seen_once: OrderedDict[Hashable, None] = OrderedDict()  # blocks read from disk once lately
        self._seen_limit = max(16, capacity // block_size // 2)
        self._bytes = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._blocks)

    @property
    def bytes(self) -> int:
        return self._bytes

    def get(self, key: Hashable) -> bytes | None:
        """The block's payload, marked recently used; ``None`` if not held."""
        return self.get_many([key])[0]

    def get_many(self, keys: list[Hashable]) -> list[bytes | None]:
        """Per key, the block's payload, marked recently used; ``None`` if not held. One pass
        under one lock: a warm batch asks for all its blocks at once."""
        blocks = self._blocks
        with self._lock:
            payloads = [blocks.get(key) for key in keys]
            for key, payload in zip(keys, payloads):
                if payload is not None:
                    blocks.move_to_end(key)
        return payloads

    def admits(self, key: Hashable) -> bool:
        """Whether a block about to be read from disk should be read whole and kept: on its
        second read within the last ``_seen_limit`` first reads; a first read is noted."""
        with self._lock:
            if key in self._seen_once:
                del self._seen_once[key]
                return True
            self._seen_once[key] = None
            if len(self._seen_once) > self._seen_limit:
                self._seen_once.popitem(last=False)
        return False

    def put(self, key: Hashable, payload: bytes) -> None:
        """Keep a verified block (least recently used blocks make room)."""
        size = len(payload)
        if size > self.capacity:
            return
        with self._lock:
            old = self._blocks.pop(key, None)
            if old is not None:
                self._bytes -= len(old)
                self._let_go(old)
            self._blocks[key] = payload
            self._bytes += size
            while self._bytes > self.capacity:
                _, victim = self._blocks.popitem(last=False)
                self._bytes -= len(victim)
                self._let_go(victim)
        self.metrics.memory_cache_bytes.set(self._bytes)

    def discard(self, key: Hashable) -> None:
        """Forget a block (its disk copy was evicted, replaced or found corrupt)."""
        with self._lock:
            old = self._blocks.pop(key, None)
            if old is not None:
                self._bytes -= len(old)
                self._let_go(old)
        if old is not None:
            self.metrics.memory_cache_bytes.set(self._bytes)

    def _let_go(self, payload) -> None:
        if self.buffers is not None and isinstance(payload, memoryview):
            self.buffers.returned(payload)
