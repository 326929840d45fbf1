"""The block cache: shard bytes kept on local disk (NVMe) in aligned, checksummed blocks.

A block is ``block_size`` bytes of one shard starting at a multiple of ``block_size``.
Blocks live in slots of a few large files, one per slot size (``slabs.py``: no file to
create per block, no rename, no unlink), each slot's header naming its block and
holding a checksum per 16 KiB chunk: a reader verifies only the chunks it reads, and a
slot that is cut short, overwritten or corrupt is dropped, never served.

Blocks are named by the version of their shard (``names.py``: path, ETag, size), so a
block of a replaced object is never read for the new one; ``retain`` drops them once a
dataset is opened again.

Which blocks are held, where, and when each was last read, is the catalogue's
(``catalog.py``): a few dozen bytes a block in numpy arrays, and records on disk that a
restart reads in one go (a kept cache of 10^7 blocks opens in seconds, without a look at
the slabs). Crash safety: a block is written in a free place, then recorded, so it becomes
visible only when complete; a place is recorded free before it is written again, and
every read checks the slot's header and checksums, so a crash at any point leaves nothing
that would be served wrong. Eviction is LRU over whole blocks, bounded by ``capacity``
bytes of disk (a block takes its length rounded up to 4 KiB: the rest of its slot stays a
hole), unless a ``VictimOrder`` orders the candidates (plans: the block used
farthest in the future goes first, ``service/plans/``); either ranks 64 blocks drawn at
random rather than all of them, so an eviction costs the same at any size. An evicted
block's slot is given back to the filesystem (a hole), so the slabs hold what the cache
holds. LRU fits the access pattern: a random epoch touches every block once, and a block
read by one batch is likely to be read again by the next samples of the same shard,
while the blocks of the batch being served are already in memory and eviction cannot
hurt it. A second process on the same directory is refused (an exclusive lock).
Whoever mirrors blocks elsewhere (the RAM tier, ``memtier.py``) is given as ``on_forget`` and
hears of every block that leaves the cache; sibling workers find blocks through the
``hints`` this cache publishes (``hints.py``, ``siblings.py``).

Every method here blocks: callers run them in a thread.
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
import shutil
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Protocol

import numpy as np

from shardfeed.buffers import BufferPool, aligned
from shardfeed.service.cache.catalog import Catalog, block_key
from shardfeed.service.cache.hints import Hints, hint_entries
from shardfeed.service.cache.names import BlockKey
from shardfeed.service.cache.slabs import BadBlock, Slabs, SlotLocation, SlotSpace, block_name
from shardfeed.service.observe.metrics import Metrics

log = logging.getLogger("shardfeed.cache")

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
        directory: where the slabs and the catalogue live.
        capacity: the most bytes of disk the blocks take (each its length rounded up to 4 KiB,
            ``slabs.py``); least recently used go first.
        block_size: bytes per block; part of each block's name, so a restart with another
            block size simply starts cold.
        metrics: counters for hits, misses, evictions, corruption and write errors.
        direct_writes: write payloads around the page cache where the filesystem allows
            (``slabs.py``); after one refusal, through it.
        victims: orders eviction candidates; ``None`` keeps LRU.
        on_forget: called with the key of every block evicted, replaced or dropped as corrupt
            (the RAM tier's ``discard``: it mirrors the disk).
        buffers: the block buffers (``shardfeed/buffers.py``) large reads land in and whole
            blocks are written from, uncopied; the store's reads fill them (``fetcher.py``).
        hints: publish where each block is for sibling workers (``hints.py``).
    """

    def __init__(self, directory: str | os.PathLike, capacity: int, block_size: int, metrics: Metrics, *,
                 direct_writes: bool = True, victims: VictimOrder | None = None,
                 on_forget: Callable[[BlockKey], None] | None = None, buffers: BufferPool | None = None,
                 hints: bool = False):
        self.directory = Path(directory)
        self.capacity = capacity
        self.block_size = block_size
        self.metrics = metrics
        self.buffers = buffers
        self.writable = True
        self._space = SlotSpace(block_size)
        self._slabs = Slabs(self.directory, block_size, direct=direct_writes, buffers=buffers)
        self._catalog = Catalog(self.directory, block_size)
        self._publish_hints = hints
        self._hints: Hints | None = None
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
        """Lock the directory and take up the blocks a previous run left behind (from the
        catalogue, ``catalog.py``); a directory without one starts empty."""
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._lock_directory()
        except OSError as err:
            self._disable(f"cache directory {self.directory} is not usable ({err.strerror})")
            return
        with self._lock:
            if not self._catalog.load():  # slabs no record vouches for: their bytes are of no use
                shutil.rmtree(self._slabs.directory, ignore_errors=True)
            for stream, count in enumerate(self._catalog.stream_counts().tolist()):
                if count:
                    self._count(stream, count)
            self._space.taken(self._catalog.places())
            try:
                self._catalog.start()
            except OSError as err:
                self._disable(f"cache catalogue in {self.directory} is not writable ({err.strerror})")
            victims = self._catalog.oldest(self.bytes - self.capacity).tolist()
            evicted = [self._remove_locked(slot) for slot in victims]
            if evicted:
                self.metrics.cache_evictions.inc(len(evicted))
            if self._publish_hints and self.writable:
                self._hints = Hints.publish(self.directory, hint_entries(self.capacity, self.block_size))
                for slot in self._catalog.slots().tolist():
                    self._hints.put(self._name(self._catalog.key(slot)), self._catalog.place(slot))
        self._let_go(evicted)  # the capacity may have shrunk since the last run
        self._update_gauges()
        log.info("block cache %s: %d blocks, %d bytes reused", self.directory, self._catalog.count,
                 self._catalog.bytes)
        # An older shardfeed's block files (a file a block, in a folder a dataset): not read any more.
        threading.Thread(target=_remove_block_files, args=(self.directory,), name="cache-old-files",
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
            self._slabs.close()
        if self._lock_file is not None:
            self._lock_file.close()
            self._lock_file = None

    def _disable(self, why: str) -> None:
        if self.writable:
            log.warning("%s: serving straight from the store", why)
        self.writable = False

    @property
    def direct_writes(self) -> bool:
        """Whether payloads go around the page cache (``False`` once the filesystem refused)."""
        return self._slabs.direct

    # -- names -----------------------------------------------------------------------------
    def _key_of(self, key: BlockKey, *, make: bool = False) -> int | None:
        """The catalogue's key of a block of this block size (None: a stream never seen)."""
        if make:
            return block_key(self._catalog.stream(key.dataset, key.shard, self.block_size), key.block)
        code = self._catalog.stream_code.get((key.dataset, key.shard, self.block_size))
        return None if code is None else block_key(code, key.block)

    def _block_of(self, key: int) -> BlockKey:
        """The ``BlockKey`` of a catalogue key."""
        dataset, shard, _ = self._catalog.streams[key >> 32]
        return BlockKey(dataset, shard, key & 0xFFFFFFFF)

    def _name(self, key: int) -> int:
        """The name a catalogue key's block has in its slot's header (``slabs.block_name``)."""
        dataset, shard, block_size = self._catalog.streams[key >> 32]
        return block_name(dataset, shard, block_size, key & 0xFFFFFFFF)

    def location(self, key: BlockKey) -> SlotLocation | None:
        """Where a held block is (for tools and tests)."""
        with self._lock:
            code = self._key_of(key)
            slot = -1 if code is None else self._catalog.find(code)
            return None if slot < 0 else self._slabs.location(self._catalog.place(slot))

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

    def read(self, key: BlockKey, ranges: list[tuple[int, int]] | None) -> list[bytes | memoryview] | None:
        """Bytes ``[start, end)`` of the block for each range (``None``: the whole block), verified;
        ``None`` if absent or bad."""
        with self._lock:
            code = self._key_of(key)
            slot = -1 if code is None else self._catalog.find(code)
            if slot < 0:
                return None
            self._catalog.touch(slot)
            place = self._catalog.place(slot)
        try:
            return self._slabs.read(place, block_name(key.dataset, key.shard, self.block_size, key.block), ranges)
        except (OSError, BadBlock) as err:
            self._drop(code, place, str(err))
            return None

    def _drop(self, code: int, place: int, why: str) -> None:
        """Let go of a block whose read failed, unless it was let go of (and its place perhaps
        written again) while it was read: that read found another block's bytes, rightly refused."""
        with self._lock:
            slot = self._catalog.find(code)
            if slot < 0 or self._catalog.place(slot) != place:
                return
            self._remove_locked(slot)
        log.warning("cache block %s (%s): dropped, will refetch", self._block_of(code), why)
        self.metrics.cache_corrupt.inc()
        self._let_go([(code, place)])
        self._update_gauges()

    def retain(self, dataset: str, shard_ids: Iterable[str]) -> int:
        """Drop every block of dataset id ``dataset`` whose shard id is not among ``shard_ids``
        (a replaced object's blocks: their space is reclaimed at once); how many were dropped."""
        keep = set(shard_ids)
        with self._lock:
            stale_streams = np.array([code for code, (d, shard, _) in enumerate(self._catalog.streams)
                                      if d == dataset and shard not in keep], np.int64)
            stale = [self._remove_locked(slot) for slot in self._catalog.stream_slots(stale_streams).tolist()]
        self._let_go(stale)
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
        try:
            self._recreate_if_removed()
        except CacheLocked as err:  # another process took the recreated directory
            self._disable(str(err))
            return False
        except OSError as err:
            self.metrics.cache_write_errors.inc()
            log.warning("cannot recreate the cache directory %s (%s)", self.directory, err.strerror)
            return False
        size = aligned(len(payload))  # the disk it takes: the rest of its slot stays a hole
        if size > self.capacity:
            return False
        # Make room first, so the slots in use never exceed the capacity, even briefly: the
        # blocks being written count from here (``_writing``) until they are held.
        with self._lock:
            code = self._key_of(key, make=True)
            old = self._catalog.find(code)
            let_go = [self._remove_locked(old)] if old >= 0 else []
            let_go += self._evict_locked(size)
            room = self._catalog.bytes + self._writing + size <= self.capacity
            if room:
                self._writing += size
                place = self._space.take(len(payload))
        self._let_go(let_go)
        if not room:  # more blocks being written at once than the cache holds: this one is not kept
            return False
        name = block_name(key.dataset, key.shard, self.block_size, key.block)
        replaced = []
        try:
            self._slabs.write(place, name, payload)
            # The record after the block is in place: a crash before it leaves a free place.
            with self._lock:
                if (held := self._catalog.find(code)) >= 0:  # another writer of this block came first
                    replaced = [self._remove_locked(held)]
                self._catalog.add(code, place, size)
                self._count(code >> 32, 1)
                if self._hints is not None:
                    self._hints.put(name, place)
        except OSError as err:
            self.metrics.cache_write_errors.inc()
            self._let_go([(code, place)], forget=False)
            now = time.monotonic()
            if now - self._last_warning > 30:  # a full disk fails every write: warn, don't flood
                self._last_warning = now
                log.warning("cannot write cache block %s (%s): serving from the store", key, err.strerror)
            return False
        finally:
            with self._lock:
                self._writing -= size
        self._let_go(replaced)
        self._update_gauges()
        return True

    def _recreate_if_removed(self) -> None:
        """Someone removed the directory (its lock file is gone): its blocks went with it.
        Start again empty there, locked (``CacheLocked`` if another process came first)."""
        if self._lock_file is None or os.fstat(self._lock_file.fileno()).st_nlink:
            return
        with self._lock:
            if os.fstat(self._lock_file.fileno()).st_nlink:  # another writer did it meanwhile
                return
            gone = [self._remove_locked(slot) for slot in self._catalog.slots().tolist()]
            self._space = SlotSpace(self.block_size)
            self._slabs.close()
            self.directory.mkdir(parents=True, exist_ok=True)
            self._lock_directory()
            self._catalog.renew()
            if self._hints is not None:
                self._hints = Hints.publish(self.directory, hint_entries(self.capacity, self.block_size))
        log.warning("cache directory %s was removed: recreated, empty", self.directory)
        for code, _ in gone:
            self.on_forget(self._block_of(code))
        self._update_gauges()

    def _evict_locked(self, incoming: int = 0) -> list[tuple[int, int]]:
        """Let go of blocks until ``incoming`` more bytes fit; their keys and places. Each goes
        first among ``_CANDIDATES`` drawn at random (LRU, or the ``victims`` order), so an
        eviction costs the same with 10^4 blocks as with 10^7 (docs/benchmarks.md, scale)."""
        evicted = []
        catalog = self._catalog
        while catalog.count and catalog.bytes + self._writing + incoming > self.capacity:
            slots = catalog.candidates(self._random, _CANDIDATES)
            victim = int(slots[0])
            if self.victims is not None:
                keys = [self._block_of(catalog.key(s)) for s in slots.tolist()]
                victim = int(slots[keys.index(self.victims.victim_order(keys)[0])])
            evicted.append(self._remove_locked(victim))
        if evicted:
            self.metrics.cache_evictions.inc(len(evicted))
        return evicted

    def _remove_locked(self, slot: int) -> tuple[int, int]:
        """Unlist a block (its record written); its key and place, for ``_let_go``."""
        code, place = self._catalog.key(slot), self._catalog.place(slot)
        self._count(code >> 32, -1)
        self._catalog.remove(slot)
        if self._hints is not None:
            self._hints.drop(self._name(code), place)
        return code, place

    def _let_go(self, blocks: list[tuple[int, int]], *, forget: bool = True) -> None:
        """After blocks were unlisted: tell ``on_forget`` (``forget``), give their slots' disk
        back, then free their places (not before: a hole punched in a place written again
        would lose the new block)."""
        for code, place in blocks:
            if forget:
                self.on_forget(self._block_of(code))
            self._slabs.punch(place)
            with self._lock:
                self._space.give_back(place)

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


def _remove_block_files(directory: Path) -> None:
    """Remove the folders of block files an older shardfeed kept (``<dataset id>/*.blk``)."""
    for folder in directory.iterdir():
        if folder.is_dir() and re.fullmatch(r"[0-9a-f]{12}", folder.name):
            shutil.rmtree(folder, ignore_errors=True)
