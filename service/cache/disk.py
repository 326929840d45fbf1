"""The block cache: shard bytes kept on local disk (NVMe) in aligned, checksummed blocks.

A block is ``block_size`` bytes of one shard starting at a multiple of ``block_size``.
Each block is one checksummed file (``blockfile.py``: a reader verifies only the chunks it
reads); a corrupt or truncated file is dropped, never served. Recently read block files
stay open (a bounded set), so a warm read is a ``pread`` and no ``open``.

Blocks are named by the version of their shard (``names.py``: path, ETag, size), so a
block of a replaced object is never read for the new one; ``retain`` drops them once a
dataset is opened again.

Which blocks are held, and when each was last read, is the catalogue's (``catalog.py``): a
few dozen bytes a block in numpy arrays, and records on disk that a restart reads in one go
(a kept cache of 10^7 blocks opens in seconds, without a look at its files). Crash
safety: a block is written to a temporary file, recorded, then renamed into place, so it
becomes visible only when complete; every read verifies what it reads, and files no
record lists are removed while serving. Eviction is LRU over whole blocks, bounded by
``capacity`` bytes, unless a ``VictimOrder`` orders the candidates (plans: the block
used farthest in the future goes first, ``service/plans/``); either ranks 64 blocks drawn
at random rather than all of them, so an eviction costs the same at any size.
LRU fits the access pattern: a random epoch touches every block once, and a block
read by one batch is likely to be read again by the next samples of the same shard,
while the blocks of the batch being served are already in memory and eviction cannot
hurt it. A second process on the same directory is refused (an exclusive lock).
Whoever mirrors blocks elsewhere (the RAM tier, ``memtier.py``) is given as ``on_forget`` and
hears of every block that leaves the cache.

Every method here blocks: callers run them in a thread.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Protocol

import numpy as np

from shardfeed.service.cache.blockfile import BadBlock, BlockFile, file_size, write_file
from shardfeed.service.cache.catalog import Catalog, block_key
from shardfeed.service.cache.names import BlockKey
from shardfeed.service.observe.metrics import Metrics

log = logging.getLogger("shardfeed.cache")

_OPEN_FILES = 512  # block files kept open for reads
_CANDIDATES = 64
"""Blocks drawn at random per eviction and ranked (all of them in a cache of fewer): the one
least recently used, or the ``victims`` policy's first, goes."""


class VictimOrder(Protocol):
    """Which cached block to evict first (``plans.Plans``: the one used farthest ahead)."""

    def victim_order(self, keys: list[BlockKey]) -> list[BlockKey]:
        """``keys`` (least recently used first) in the order to evict them. Called with the
        cache's lock held, about a few blocks drawn at random, never all."""


class CacheLocked(RuntimeError):
    """Another process already uses this cache directory."""


class HeldBlocks:
    """The blocks of one dataset that the cache holds (of its block size): in all, per
    shard id, and a count of the changes, so that an answer drawn from them can be kept
    until they change."""

    __slots__ = ("total", "per_shard", "changes")

    def __init__(self) -> None:
        self.total = 0
        self.per_shard: dict[str, int] = {}
        self.changes = 0


class BlockCache:
    """A bounded, crash-safe directory of blocks.

    Args:
        directory: where block files live (one subdirectory per dataset).
        capacity: the most bytes of block files kept; least recently used go first.
        block_size: bytes per block; part of each file name, so a restart with another
            block size simply starts cold.
        metrics: counters for hits, misses, evictions, corruption and write errors.
        direct_writes: write block files around the page cache where the filesystem
            allows (``blockfile.write_file``); after one refusal, buffered.
        victims: orders eviction candidates; ``None`` keeps LRU.
        on_forget: called with the key of every block evicted, replaced or dropped as corrupt
            (the RAM tier's ``discard``: it mirrors the disk).
    """

    def __init__(self, directory: str | os.PathLike, capacity: int, block_size: int, metrics: Metrics, *,
                 direct_writes: bool = True, victims: VictimOrder | None = None,
                 on_forget: Callable[[BlockKey], None] | None = None):
        self.directory = Path(directory)
        self.capacity = capacity
        self.block_size = block_size
        self.metrics = metrics
        self.direct_writes = direct_writes
        self.writable = True
        self._catalog = Catalog(self.directory)
        self._open_files: OrderedDict[int, BlockFile] = OrderedDict()  # by block key, recently read
        self._held: dict[str, HeldBlocks] = {}
        self._lock = threading.Lock()
        self._writing = 0  # bytes of blocks being written, room made for them
        self._lock_file = None
        self._last_warning = -1e9
        self._random = np.random.default_rng()
        self.on_forget = on_forget or (lambda key: None)
        self.victims = victims

    # -- lifecycle ---------------------------------------------------------------------
    def open(self) -> None:
        """Lock the directory and take up the blocks a previous run left behind: from the
        catalogue (``catalog.py``), else (a directory without one) by looking at every file."""
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._lock_directory()
        except OSError as err:
            self._disable(f"cache directory {self.directory} is not usable ({err.strerror})")
            return
        began = time.time()
        with self._lock:
            listed = self._catalog.load()
            if not listed:
                self._catalog.scan()
            for stream, count in enumerate(self._catalog.stream_counts().tolist()):
                if count:
                    self._count(stream, count)
            try:
                self._catalog.start()
            except OSError as err:
                self._disable(f"cache catalogue in {self.directory} is not writable ({err.strerror})")
            victims = self._catalog.oldest(self.bytes - self.capacity).tolist()
            evicted = [self._catalog.key(slot) for slot in victims]
            for slot in victims:
                self._remove_locked(slot)
            if evicted:
                self.metrics.cache_evictions.inc(len(evicted))
        self._unlink(evicted)  # the capacity may have shrunk since the last run
        self._update_gauges()
        log.info("block cache %s: %d blocks, %d bytes reused", self.directory, self._catalog.count,
                 self._catalog.bytes)
        if listed:  # files the catalogue does not vouch for: removed while serving
            threading.Thread(target=self._catalog.remove_orphans, args=(began, self._lock), name="cache-orphans",
                             daemon=True).start()

    def _lock_directory(self) -> None:
        """Hold the directory's exclusive lock; ``CacheLocked`` if another process has it."""
        lock_file = open(self.directory / ".lock", "a+")
        try:
            fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock_file.close()
            raise CacheLocked(f"cache directory {self.directory} is in use by another shardfeed "
                              "process; give each process its own --cache-dir") from None
        if self._lock_file is not None:
            self._lock_file.close()
        self._lock_file = lock_file

    def close(self) -> None:
        with self._lock:
            self._catalog.close()
        if self._lock_file is not None:
            self._lock_file.close()
            self._lock_file = None

    def _disable(self, why: str) -> None:
        if self.writable:
            log.warning("%s: serving straight from the store", why)
        self.writable = False

    # -- names -----------------------------------------------------------------------------
    def _key_of(self, key: BlockKey, *, make: bool = False) -> int | None:
        """The catalogue's key of a block of this block size (None: a stream never seen)."""
        if make:
            return block_key(self._catalog.stream(key.dataset, key.shard, self.block_size), key.block)
        code = self._catalog.stream_code.get((key.dataset, key.shard, self.block_size))
        return None if code is None else block_key(code, key.block)

    def _block_of(self, key: int) -> tuple[BlockKey, int]:
        """The ``BlockKey`` and block size of a catalogue key."""
        dataset, shard, block_size = self._catalog.streams[key >> 32]
        return BlockKey(dataset, shard, key & 0xFFFFFFFF), block_size

    def _file(self, key: int) -> str:
        block, block_size = self._block_of(key)
        return block.filename(block_size)

    # -- reads -----------------------------------------------------------------------------
    def __contains__(self, key: BlockKey) -> bool:
        with self._lock:
            code = self._key_of(key)
            return code is not None and self._catalog.find(code) >= 0

    def held(self, dataset: str) -> HeldBlocks:
        """What the cache holds of dataset id ``dataset`` (read without the lock: a moment's view)."""
        return self._held.get(dataset) or HeldBlocks()

    def room_blocks(self) -> int:
        """How many blocks the cache keeps at most: none once it is disabled."""
        return self.capacity // self.block_size if self.writable else 0

    def read(self, key: BlockKey, ranges: list[tuple[int, int]] | None) -> list[bytes] | None:
        """Bytes ``[start, end)`` of the block for each range (``None``: the whole block), verified;
        ``None`` if absent or bad."""
        with self._lock:
            code = self._key_of(key)
            slot = -1 if code is None else self._catalog.find(code)
            if slot < 0:
                return None
            self._catalog.touch(slot)
            size = self._catalog.size(slot)
            file = self._open_files.get(code)
            if file is not None:
                self._open_files.move_to_end(code)
        try:
            if file is None:
                file = self._open(code, size)
            return file.read(ranges)
        except (OSError, BadBlock) as err:
            self._drop(code, str(err))
            return None

    def _open(self, code: int, size: int) -> BlockFile:
        """Open a block file, checked, and keep it open for the next reads."""
        file = BlockFile(self.directory / self._file(code), size)
        with self._lock:
            if self._catalog.find(code) >= 0:
                self._open_files[code] = file
                while len(self._open_files) > _OPEN_FILES:
                    self._open_files.popitem(last=False)
        return file

    def _drop(self, code: int, why: str) -> None:
        name = self._file(code)
        log.warning("cache block %s %s: dropped, will refetch", name, why)
        self.metrics.cache_corrupt.inc()
        self.on_forget(self._block_of(code)[0])
        with self._lock:
            slot = self._catalog.find(code)
            if slot >= 0:
                self._remove_locked(slot)
            (self.directory / name).unlink(missing_ok=True)  # under the lock, as in ``_unlink``
        self._update_gauges()

    def retain(self, dataset: str, shard_ids: Iterable[str]) -> int:
        """Drop every block of dataset id ``dataset`` whose shard id is not among ``shard_ids``
        (a replaced object's blocks: their space is reclaimed at once); how many were dropped."""
        keep = set(shard_ids)
        with self._lock:
            stale_streams = np.array([code for code, (d, shard, _) in enumerate(self._catalog.streams)
                                      if d == dataset and shard not in keep], np.int64)
            stale = []
            for slot in self._catalog.stream_slots(stale_streams).tolist():
                stale.append(self._catalog.key(slot))
                self._remove_locked(slot)
        self._unlink(stale)
        if stale:
            self.metrics.cache_evictions.inc(len(stale))
            self._update_gauges()
            log.info("block cache: %d blocks of replaced objects dropped", len(stale))
        return len(stale)

    # -- writes ----------------------------------------------------------------------------
    def write(self, key: BlockKey, payload: bytes | memoryview) -> bool:
        """Store a complete block; ``False`` (and a metric) if the disk refuses."""
        if not self.writable or self.capacity <= 0:
            return False
        name = key.filename(self.block_size)
        path = self.directory / name
        tmp = path.with_name(f".tmp-{path.name}-{threading.get_ident()}")
        size = file_size(len(payload))
        if size > self.capacity:
            return False
        # Make room first, so the files on disk never exceed the capacity, even briefly: the
        # blocks being written count from here (``_writing``) until they are held.
        with self._lock:
            code = self._key_of(key, make=True)
            old = self._catalog.find(code)
            if old >= 0:
                self._remove_locked(old)
            evicted = self._evict_locked(size)
            room = self._catalog.bytes + self._writing + size <= self.capacity
            self._writing += size if room else 0
        if old >= 0:
            self.on_forget(key)
        self._unlink(evicted)
        if not room:  # more blocks being written at once than the cache holds: this one is not kept
            return False
        try:
            try:
                direct = write_file(tmp, payload, direct=self.direct_writes)
            except FileNotFoundError:  # first block of a dataset, or someone removed the directory
                path.parent.mkdir(parents=True, exist_ok=True)
                if not (self.directory / ".lock").exists():  # removed with the directory: lock anew
                    self._lock_directory()
                    with self._lock:
                        self._catalog.renew()
                direct = write_file(tmp, payload, direct=self.direct_writes)
            if self.direct_writes and not direct:
                self.direct_writes = False
                log.info("the cache's filesystem refuses O_DIRECT: block files are written buffered")
            # The record first: a crash after it leaves a file a read verifies. Both under the
            # lock: an eviction between them would leave a file no record vouches for.
            with self._lock:
                if (held := self._catalog.find(code)) >= 0:  # another writer of this block came first
                    self._remove_locked(held)
                self._catalog.add(code, size)
                self._count(code >> 32, 1)
                os.replace(tmp, path)
        except CacheLocked as err:  # another process took the recreated directory
            self._disable(str(err))
            return False
        except OSError as err:
            with contextlib.suppress(OSError):  # the directory itself may be what is broken
                tmp.unlink(missing_ok=True)
            with self._lock:
                slot = self._catalog.find(code)
                if slot >= 0:
                    self._remove_locked(slot)
            self._update_gauges()
            self.metrics.cache_write_errors.inc()
            now = time.monotonic()
            if now - self._last_warning > 30:  # a full disk fails every write: warn, don't flood
                self._last_warning = now
                log.warning("cannot write cache block %s (%s): serving from the store", path, err.strerror)
            return False
        finally:
            with self._lock:
                self._writing -= size
        self._update_gauges()
        return True

    def _evict_locked(self, incoming: int = 0) -> list[int]:
        """Let go of blocks until ``incoming`` more bytes fit; their keys, to unlink. Each goes
        first among ``_CANDIDATES`` drawn at random (LRU, or the ``victims`` order), so an
        eviction costs the same with 10^4 blocks as with 10^7 (docs/benchmarks.md, scale)."""
        evicted = []
        catalog = self._catalog
        while catalog.count and catalog.bytes + self._writing + incoming > self.capacity:
            slots = catalog.candidates(self._random, _CANDIDATES)
            victim = int(slots[0])
            if self.victims is not None:
                keys = [self._block_of(catalog.key(s))[0] for s in slots.tolist()]
                victim = int(slots[keys.index(self.victims.victim_order(keys)[0])])
            evicted.append(catalog.key(victim))
            self._remove_locked(victim)
        if evicted:
            self.metrics.cache_evictions.inc(len(evicted))
        return evicted

    def _remove_locked(self, slot: int) -> None:
        code = self._catalog.key(slot)
        self._count(code >> 32, -1)
        self._open_files.pop(code, None)
        self._catalog.remove(slot)

    def _unlink(self, codes: list[int]) -> None:
        """Forget and remove the files of blocks let go of (their records already written); not
        the file of a block written again meanwhile (checked under the lock its writer renames in)."""
        for code in codes:
            self.on_forget(self._block_of(code)[0])
            with self._lock:
                if self._catalog.find(code) < 0:
                    (self.directory / self._file(code)).unlink(missing_ok=True)

    def _count(self, stream: int, step: int) -> None:
        """Count ``step`` blocks of a stream in (or out, negative) of its dataset's ``HeldBlocks``;
        called with the lock held. Blocks of another block size (a previous run's) are not counted."""
        dataset, shard, block_size = self._catalog.streams[stream]
        if block_size != self.block_size:
            return
        held = self._held.get(dataset)
        if held is None:
            held = self._held[dataset] = HeldBlocks()
        held.total += step
        held.per_shard[shard] = held.per_shard.get(shard, 0) + step
        held.changes += 1

    def _update_gauges(self) -> None:
        self.metrics.cache_bytes.set(self._catalog.bytes)
        self.metrics.cache_blocks.set(self._catalog.count)

    @property
    def bytes(self) -> int:
        return self._catalog.bytes
