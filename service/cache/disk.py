"""The block cache: shard bytes kept on local disk (NVMe) in aligned, checksummed blocks.

A block is ``block_size`` bytes of one shard starting at a multiple of ``block_size``.
Each block is one checksummed file (``blockfile.py``: a reader verifies only the chunks it
reads); a corrupt or truncated file is dropped, never served. Recently read block files
stay open (a bounded set), so a warm read is a ``pread`` and no ``open``.

Blocks are named by the version of their shard (``shard_id``: path, ETag, size), so a
block of a replaced object is never read for the new one; ``retain`` drops them once a
dataset is opened again.

Crash safety: a block is written to a temporary file and renamed into place, so it
becomes visible only when complete; after a restart the directory is scanned and the
blocks are reused. Eviction is LRU over whole blocks, bounded by ``capacity`` bytes,
unless a ``victims`` policy orders the candidates (plans: the block used farthest in the
future goes first, ``service/plans/``).
LRU fits the access pattern: a random epoch touches every block once, and a block
read by one batch is likely to be read again by the next samples of the same shard,
while the blocks of the batch being served are already in memory and eviction cannot
hurt it. A second process on the same directory is refused (an exclusive lock).
Whoever mirrors blocks elsewhere (the RAM tier, ``memtier.py``) sets ``on_forget`` and
hears of every block that leaves the cache.

Every method here blocks: callers run them in a thread.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import NamedTuple

from shardfeed.service.cache.blockfile import BadBlock, BlockFile, file_size, write_file
from shardfeed.service.observe.metrics import Metrics

log = logging.getLogger("shardfeed.cache")

_OPEN_FILES = 512  # block files kept open for reads
_SUFFIX = ".blk"


class CacheLocked(RuntimeError):
    """Another process already uses this cache directory."""


class BlockKey(NamedTuple):
    dataset: str  # dataset_id() of the dataset URL
    shard: str  # shard_id() of the shard path
    block: int

    def filename(self, block_size: int) -> str:
        return f"{self.dataset}/{self.shard}-{block_size:x}-{self.block:08x}{_SUFFIX}"

    @classmethod
    def from_filename(cls, name: str) -> BlockKey:
        """The key of a file name made by ``filename``."""
        dataset, _, rest = name.partition("/")
        shard, _, rest = rest.partition("-")
        return cls(dataset, shard, int(rest.partition("-")[2][:-len(_SUFFIX)], 16))


def dataset_id(url: str) -> str:
    """A short stable name for a dataset URL (a directory of the cache)."""
    return hashlib.sha1(url.encode()).hexdigest()[:12]


def shard_id(path: str, etag: str | None = None, size: int | None = None) -> str:
    """A short stable name for a version of a shard (part of its blocks' file names): the
    path, and the object's ETag and size where known, so the blocks of a replaced object
    are never taken for the new one's."""
    name = path if etag is None else f"{path}\0{etag}\0{size}"
    return hashlib.sha1(name.encode()).hexdigest()[:20]


class HeldBlocks:
    """The blocks of one dataset that the cache holds (of its block size): in all, per
    shard id, and a count of the changes, so that an answer drawn from them can be kept
    until they change."""

    __slots__ = ("total", "per_shard", "changes")

    def __init__(self) -> None:
        self.total = 0
        self.per_shard: dict[str, int] = {}
        self.changes = 0


class _Entry:
    __slots__ = ("file_size", "file")

    def __init__(self, file_size: int):
        self.file_size = file_size
        self.file: BlockFile | None = None  # open while among the recently read, shared by readers


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
    """

    def __init__(self, directory: str | os.PathLike, capacity: int, block_size: int, metrics: Metrics, *,
                 direct_writes: bool = True):
        self.directory = Path(directory)
        self.capacity = capacity
        self.block_size = block_size
        self.metrics = metrics
        self.direct_writes = direct_writes
        self.writable = True
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._open_files: OrderedDict[str, None] = OrderedDict()
        self._bytes = 0
        self._held: dict[str, HeldBlocks] = {}
        self._lock = threading.Lock()
        self._lock_file = None
        self._last_warning = -1e9
        self.on_forget: Callable[[BlockKey], None] = lambda key: None
        """Called with the key of every block evicted, replaced or dropped as corrupt."""
        self.victims: Callable[[list[str]], Iterable[str]] | None = None
        """Orders eviction candidates, given as file names least recently used first (the
        first returned goes first); ``None`` keeps LRU. Called with the lock held."""

    # -- lifecycle ---------------------------------------------------------------------
    def open(self) -> None:
        """Lock the directory and index the blocks a previous run left behind."""
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._lock_directory()
        except OSError as err:
            self._disable(f"cache directory {self.directory} is not usable ({err.strerror})")
            return
        found = []
        for path in self.directory.glob(f"*/*{_SUFFIX}"):
            try:
                st = path.stat()
            except FileNotFoundError:
                continue
            found.append((st.st_atime, str(path.relative_to(self.directory)), st.st_size))
        for path in self.directory.glob("*/.tmp-*"):  # a crash mid-write leaves these
            path.unlink(missing_ok=True)
        with self._lock:
            for _, name, size in sorted(found):
                self._entries[name] = _Entry(size)
                self._count(name, 1)
                self._bytes += size
            evicted = self._evict_locked()
        for victim in evicted:  # the capacity may have shrunk since the last run
            self._forget(victim)
            (self.directory / victim).unlink(missing_ok=True)
        self._update_gauges()
        log.info("block cache %s: %d blocks, %d bytes reused", self.directory, len(found), self._bytes)

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
        if self._lock_file is not None:
            self._lock_file.close()
            self._lock_file = None

    def _disable(self, why: str) -> None:
        if self.writable:
            log.warning("%s: serving straight from the store", why)
        self.writable = False

    # -- reads -----------------------------------------------------------------------------
    def __contains__(self, key: BlockKey) -> bool:
        return key.filename(self.block_size) in self._entries

    def held(self, dataset: str) -> HeldBlocks:
        """What the cache holds of dataset id ``dataset`` (read without the lock: a moment's view)."""
        return self._held.get(dataset) or HeldBlocks()

    def read(self, key: BlockKey, ranges: list[tuple[int, int]] | None) -> list[bytes] | None:
        """Bytes ``[start, end)`` of the block for each range (``None``: the whole block), verified;
        ``None`` if absent or bad."""
        name = key.filename(self.block_size)
        with self._lock:
            entry = self._entries.get(name)
            if entry is None:
                return None
            self._entries.move_to_end(name)
            file = entry.file
        try:
            if file is None:
                file = self._open(name, entry)
            return file.read(ranges)
        except (OSError, BadBlock) as err:
            self._drop(name, str(err))
            return None

    def _open(self, name: str, entry: _Entry) -> BlockFile:
        """Open a block file, checked, and keep it open for the next reads."""
        file = BlockFile(self.directory / name, entry.file_size)
        with self._lock:
            if self._entries.get(name) is entry:
                entry.file = file
                self._open_files[name] = None
                self._open_files.move_to_end(name)
                while len(self._open_files) > _OPEN_FILES:
                    victim = self._entries.get(self._open_files.popitem(last=False)[0])
                    if victim is not None:
                        victim.file = None
        return file

    def _forget(self, name: str) -> None:
        self.on_forget(BlockKey.from_filename(name))

    def _drop(self, name: str, why: str) -> None:
        log.warning("cache block %s %s: dropped, will refetch", name, why)
        self.metrics.cache_corrupt.inc()
        self._forget(name)
        with self._lock:
            entry = self._entries.pop(name, None)
            self._open_files.pop(name, None)
            if entry is not None:
                self._count(name, -1)
                self._bytes -= entry.file_size
        (self.directory / name).unlink(missing_ok=True)
        self._update_gauges()

    def retain(self, dataset: str, shard_ids: Iterable[str]) -> int:
        """Drop every block of dataset id ``dataset`` whose shard id is not among ``shard_ids``
        (a replaced object's blocks: their space is reclaimed at once); how many were dropped."""
        keep = set(shard_ids)
        with self._lock:
            stale = [name for name in self._entries if name.startswith(f"{dataset}/")
                     and BlockKey.from_filename(name).shard not in keep]
            for name in stale:
                entry = self._entries.pop(name)
                self._open_files.pop(name, None)
                self._count(name, -1)
                self._bytes -= entry.file_size
        for name in stale:
            self._forget(name)
            (self.directory / name).unlink(missing_ok=True)
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
        # Make room first, so the files on disk never exceed the capacity, even briefly.
        with self._lock:
            old = self._entries.pop(name, None)
            self._open_files.pop(name, None)
            if old is not None:
                self._count(name, -1)
            self._bytes += size - (old.file_size if old is not None else 0)
            evicted = self._evict_locked()
        if old is not None:
            self._forget(name)
        for victim in evicted:
            self._forget(victim)
            (self.directory / victim).unlink(missing_ok=True)
        try:
            try:
                direct = write_file(tmp, payload, direct=self.direct_writes)
            except FileNotFoundError:  # first block of a dataset, or someone removed the directory
                path.parent.mkdir(parents=True, exist_ok=True)
                if not (self.directory / ".lock").exists():  # removed with the directory: lock anew
                    self._lock_directory()
                direct = write_file(tmp, payload, direct=self.direct_writes)
            if self.direct_writes and not direct:
                self.direct_writes = False
                log.info("the cache's filesystem refuses O_DIRECT: block files are written buffered")
            os.replace(tmp, path)
        except CacheLocked as err:  # another process took the recreated directory
            with self._lock:
                self._bytes -= size
            self._disable(str(err))
            return False
        except OSError as err:
            with contextlib.suppress(OSError):  # the directory itself may be what is broken
                tmp.unlink(missing_ok=True)
            with self._lock:
                self._bytes -= size
            self._update_gauges()
            self.metrics.cache_write_errors.inc()
            now = time.monotonic()
            if now - self._last_warning > 30:  # a full disk fails every write: warn, don't flood
                self._last_warning = now
                log.warning("cannot write cache block %s (%s): serving from the store", path, err.strerror)
            return False
        with self._lock:
            self._entries[name] = _Entry(size)
            self._count(name, 1)
        self._update_gauges()
        return True

    def _evict_locked(self) -> list[str]:
        evicted = []
        if self._bytes <= self.capacity:
            return evicted
        names = list(self._entries)
        for name in names if self.victims is None else self.victims(names):
            if self._bytes <= self.capacity:
                break
            entry = self._entries.pop(name)
            self._open_files.pop(name, None)
            self._count(name, -1)
            self._bytes -= entry.file_size
            evicted.append(name)
        if evicted:
            self.metrics.cache_evictions.inc(len(evicted))
        return evicted

    def _count(self, name: str, step: int) -> None:
        """Count block file ``name`` in (``step`` 1) or out (-1) of its dataset's ``HeldBlocks``;
        called with the lock held. Files of another block size (a previous run's) are not counted."""
        dataset, _, rest = name.partition("/")
        shard, size, _ = rest.split("-", 2)
        if int(size, 16) != self.block_size:
            return
        held = self._held.get(dataset)
        if held is None:
            held = self._held[dataset] = HeldBlocks()
        held.total += step
        held.per_shard[shard] = held.per_shard.get(shard, 0) + step
        held.changes += 1

    def _update_gauges(self) -> None:
        self.metrics.cache_bytes.set(self._bytes)
        self.metrics.cache_blocks.set(len(self._entries))

    @property
    def bytes(self) -> int:
        return self._bytes
