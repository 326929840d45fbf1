"""The block cache's catalogue: which blocks it holds and where, in a few dozen bytes each, kept on disk.

In memory there is no Python object per block: a slot per block in numpy arrays (its key,
its place in the slabs, the disk it takes and its last use), found through a sorted array of the keys plus a dict of the keys
added since that array was sorted (sorted again when the dict reaches an eighth of the
blocks: amortised O(log n) an insertion). A block's key is its stream's code (a dataset,
a shard version and a block size: ``streams``) and its number, in one 64-bit integer.
A few dozen bytes a block (``python -m shardfeed.benchmarks.scale`` measures them; figures in
docs/benchmarks.md).

On disk, beside the slabs: ``catalog`` holds 16-byte records appended as blocks come (the
record goes after the block is written in its place, ``slabs.py``) and go (before its place
is given back), and ``streams`` one JSON line per stream. An open reads them in one go and
keeps the last record of each block, so a kept cache of millions of blocks opens without a
look at the slabs; a torn tail (a crash mid-append) is ignored, and so are the blocks of
another block size (a previous run's: their places are free again). What the records cannot
vouch for is still never served: every read checks the slot's header names the block and
verifies the chunks it reads (``slabs.py``); a place no record lists is free. When the
records outnumber the blocks two to one they are rewritten.

Not thread-safe: the cache calls it with its lock held.
"""

from __future__ import annotations

import json
import logging
import os
import struct
from pathlib import Path
from typing import NamedTuple

import numpy as np

from shardfeed.service.cache.names import BlockKey


log = logging.getLogger("shardfeed.cache")

CATALOG = "catalog"
STREAMS = "streams"
MAGIC = b"shardfeed-cat-2\n"
RECORD = np.dtype([("stream", "<u4"), ("block", "<u4"), ("place", "<u4"), ("size", "<u4")])
"""A block held (its place and the disk it takes) or, with size 0, let go of."""
_PACK = struct.Struct("<IIII").pack  # one RECORD

Stream = tuple[str, str, int]
"""(dataset id, shard id, block size): the blocks of one version of one shard, of one size."""


def _line(code: int, stream: Stream) -> str:
    return json.dumps([code, *stream]) + "\n"


def block_key(stream: int, block: int) -> int:
    return stream << 32 | block


class Catalog:
    """The blocks of one cache directory: slots in memory, records on disk.

    Args:
        directory: the cache directory.
        block_size: the blocks kept; records of another block size are dropped at ``load``
            (``None``: none is, for ``listed``).
    """

    def __init__(self, directory: Path, block_size: int | None):
        self.directory = directory
        self.block_size = block_size
        self.streams: list[Stream] = []
        self.stream_code: dict[Stream, int] = {}
        self.count = 0
        self.bytes = 0
        self._key = np.zeros(0, np.uint64)
        self._size = np.zeros(0, np.uint32)
        self._place = np.zeros(0, np.uint32)
        self._tick = np.zeros(0, np.int64)
        self._live = np.zeros(0, bool)
        self._high = 0  # slots below this have been used
        self._free = np.zeros(0, np.int32)  # a stack of slots below _high that are free
        self._free_top = 0
        self._clock = 0
        self._sorted_keys = np.zeros(0, np.uint64)
        self._sorted_slots = np.zeros(0, np.int32)
        self._recent: dict[int, int] = {}  # key -> slot, added since the sort
        self._records = 0
        self._journal: int | None = None
        self._lost = np.zeros(0, np.uint32)

    # -- opening -------------------------------------------------------------------------
    def load(self) -> bool:
        """Read the catalogue on disk; ``False`` if there is none (or not ours): start empty."""
        path = self.directory / CATALOG
        try:
            with open(path, "rb") as f:
                if f.read(len(MAGIC)) != MAGIC:
                    log.warning("%s is not a block catalogue: the cache directory is scanned instead", path)
                    return False
                records = np.fromfile(f, RECORD, count=(os.fstat(f.fileno()).st_size - len(MAGIC)) // RECORD.itemsize)
        except FileNotFoundError:
            return False
        self._read_streams()
        self._records = len(records)
        # A stream line lost to a crash, or never written: its blocks' places are free.
        records = records[(records["stream"] < len(self.streams)) & ~np.isin(records["stream"], self._lost)]
        keys = records["stream"].astype(np.uint64) << np.uint64(32) | records["block"].astype(np.uint64)
        unique, last_reversed = np.unique(keys[::-1], return_index=True)
        last = len(keys) - 1 - last_reversed
        kept = records["size"][last] > 0
        if self.block_size is not None:
            stream_block_size = np.array([stream[2] for stream in self.streams] or [0], np.int64)
            kept &= stream_block_size[(unique >> np.uint64(32)).astype(np.int64)] == self.block_size
        last = np.sort(last[kept])
        # Two blocks in one place (records lost to a full disk): the later one's, if any, is there.
        _, latest = np.unique(records["place"][last][::-1], return_index=True)
        last = np.sort(last[::-1][latest])  # oldest record first: the LRU order of the last run
        self._fill(keys[last], records["place"][last], records["size"][last])
        return True

    def _read_streams(self) -> None:
        try:
            lines = (self.directory / STREAMS).read_text().splitlines()
        except FileNotFoundError:
            lines = []
        named: dict[int, Stream] = {}
        for line in lines:
            try:
                code, dataset, shard, block_size = json.loads(line)
            except ValueError:  # a torn last line
                break
            named[int(code)] = (dataset, shard, int(block_size))
        for code in range(max(named, default=-1) + 1):
            dataset, shard, block_size = named.get(code, ("", f"lost-{code}", 0))
            self._stream(dataset, shard, block_size, write=False)
        self._lost = np.array(sorted(set(range(len(self.streams))) - set(named)), np.uint32)

    def _fill(self, keys: np.ndarray, places: np.ndarray, sizes: np.ndarray) -> None:
        n = len(keys)
        self._grow(n)
        self._key[:n], self._size[:n], self._place[:n] = keys, sizes, places
        self._tick[:n] = np.arange(n)
        self._live[:n] = True
        self._high = self.count = n
        self._clock = n
        self.bytes = int(sizes.sum(dtype=np.int64))
        self._sort()

    def start(self) -> None:
        """Write the records from now on (the loaded ones rewritten first when mostly stale)."""
        path = self.directory / CATALOG
        size = path.stat().st_size if path.exists() else -1
        # Rewritten when missing, mostly stale, or torn (appending after half a record would
        # shift every later one).
        if self._journal is None and (size < len(MAGIC) or (size - len(MAGIC)) % RECORD.itemsize
                                      or self._records > 2 * self.count + 4096):
            self.rewrite()
        if self._journal is None:
            self._journal = os.open(self.directory / CATALOG, os.O_WRONLY | os.O_APPEND)

    def close(self) -> None:
        if self._journal is not None:
            os.close(self._journal)
            self._journal = None

    def rewrite(self) -> None:
        """Replace the records and streams on disk with what is held (atomically, each);
        ``OSError`` if the disk refuses (then no record is written until the next rewrite)."""
        self.close()
        slots = self.slots()
        slots = slots[np.argsort(self._tick[slots], kind="stable")]
        records = np.zeros(len(slots), RECORD)
        records["stream"] = self._key[slots] >> np.uint64(32)
        records["block"] = self._key[slots] & np.uint64(0xFFFFFFFF)
        records["place"], records["size"] = self._place[slots], self._size[slots]
        lines = "".join(_line(code, stream) for code, stream in enumerate(self.streams))
        temp = self.directory / f".tmp-{STREAMS}"
        temp.write_text(lines)
        os.replace(temp, self.directory / STREAMS)
        temp = self.directory / f".tmp-{CATALOG}"
        with open(temp, "wb") as f:
            f.write(MAGIC)
            records.tofile(f)
        os.replace(temp, self.directory / CATALOG)
        self._records = len(records)
        self._journal = os.open(self.directory / CATALOG, os.O_WRONLY | os.O_APPEND)

    def renew(self) -> None:
        """``rewrite``, and on a refusal ``_stop``: serving goes on."""
        try:
            self.rewrite()
        except OSError as err:
            self._stop(err)

    # -- streams -------------------------------------------------------------------------
    def stream(self, dataset: str, shard: str, block_size: int) -> int:
        """The code of a stream, made (and written down) on first sight."""
        code = self.stream_code.get((dataset, shard, block_size))
        return code if code is not None else self._stream(dataset, shard, block_size, write=True)

    def _stream(self, dataset: str, shard: str, block_size: int, *, write: bool) -> int:
        code = len(self.streams)
        if code >= 1 << 32:
            raise OverflowError("more than 2^32 shard versions in one cache")
        self.streams.append((dataset, shard, block_size))
        self.stream_code[dataset, shard, block_size] = code
        if write and self._journal is not None:
            try:
                with open(self.directory / STREAMS, "a") as f:
                    f.write(_line(code, (dataset, shard, block_size)))
            except OSError as err:
                self._stop(err)
        return code

    # -- blocks --------------------------------------------------------------------------
    def find(self, key: int) -> int:
        """The slot of block ``key``, -1 if not held."""
        slot = self._recent.get(key)
        if slot is not None:
            return slot
        at = int(np.searchsorted(self._sorted_keys, key))
        if at < len(self._sorted_keys) and int(self._sorted_keys[at]) == key:
            slot = int(self._sorted_slots[at])
            if self._live[slot] and int(self._key[slot]) == key:
                return slot
        return -1

    def place(self, slot: int) -> int:
        """Where the block of ``slot`` is in the slabs (``slabs.py``)."""
        return int(self._place[slot])

    def places(self) -> np.ndarray:
        """The places of every block held (O(n))."""
        return self._place[self.slots()]

    def touch(self, slot: int) -> None:
        self._clock += 1
        self._tick[slot] = self._clock

    def size(self, slot: int) -> int:
        return int(self._size[slot])

    def key(self, slot: int) -> int:
        return int(self._key[slot])

    def add(self, key: int, place: int, size: int) -> int:
        """Hold block ``key`` (not held yet), written in ``place``, taking ``size`` bytes of disk;
        its record written first."""
        self._record(key, place, size)
        if self._free_top:
            self._free_top -= 1
            slot = int(self._free[self._free_top])
        else:
            self._grow(self._high + 1)
            slot = self._high
            self._high += 1
        self._key[slot], self._size[slot], self._place[slot], self._live[slot] = key, size, place, True
        self.touch(slot)
        self._recent[key] = slot
        self.count += 1
        self.bytes += size
        if len(self._recent) > max(4096, self.count // 8):
            self._sort()
        return slot

    def remove(self, slot: int) -> None:
        """Let go of the block in ``slot``, its record written first."""
        key = int(self._key[slot])
        self._record(key, 0, 0)
        self._live[slot] = False
        self._recent.pop(key, None)
        self.count -= 1
        self.bytes -= int(self._size[slot])
        if self._free_top == len(self._free):
            self._free = np.resize(self._free, max(16, 2 * len(self._free)))
        self._free[self._free_top] = slot
        self._free_top += 1

    def slots(self) -> np.ndarray:
        """Every slot held (O(n): for rare work)."""
        return np.flatnonzero(self._live[:self._high])

    def stream_slots(self, codes: np.ndarray) -> np.ndarray:
        """The slots held of streams ``codes`` (O(n))."""
        slots = self.slots()
        return slots[np.isin(self._key[slots] >> np.uint64(32), codes.astype(np.uint64))]

    def stream_counts(self) -> np.ndarray:
        """Blocks held per stream code (O(n))."""
        return np.bincount((self._key[self.slots()] >> np.uint64(32)).astype(np.int64), minlength=len(self.streams))

    def oldest(self, excess: int) -> np.ndarray:
        """The least recently used slots whose files add up to ``excess`` bytes (none if it is
        not positive): what to evict at once when the capacity shrank between two runs."""
        if excess <= 0:
            return np.zeros(0, np.int64)
        slots = self.slots()
        slots = slots[np.argsort(self._tick[slots], kind="stable")]
        return slots[:int(np.searchsorted(np.cumsum(self._size[slots], dtype=np.int64), excess)) + 1]

    def candidates(self, rng: np.random.Generator, k: int) -> np.ndarray:
        """Up to ``k`` held slots drawn at random (all when ``k`` or fewer are held), least
        recently used first: what eviction ranks, instead of every block."""
        if self.count <= k or self.count * 8 < self._high:
            slots = self.slots()
            if len(slots) > k:
                slots = rng.choice(slots, k, replace=False)
        else:  # at least an eighth of the drawn slots are held: a few draws at most
            slots = np.zeros(0, np.int64)
            while len(slots) < k:
                drawn = rng.integers(0, self._high, 2 * k)
                slots = np.unique(np.concatenate([slots, drawn[self._live[drawn]]]))
            slots = slots[:k]
        return slots[np.argsort(self._tick[slots], kind="stable")]

    @property
    def nbytes(self) -> int:
        """Memory the catalogue holds for its blocks (arrays and the dict of recent keys)."""
        arrays = (self._key, self._size, self._place, self._tick, self._live, self._free, self._sorted_keys, self._sorted_slots)
        return sum(a.nbytes for a in arrays) + len(self._recent) * 100  # a dict entry and two ints

    # -- internals -----------------------------------------------------------------------
    def _record(self, key: int, place: int, size: int) -> None:
        # Rewritten before this record is written, as the table does not show it yet.
        if self._journal is not None and self._records > 2 * self.count + 4096:
            self.renew()
        if self._journal is None:
            return
        try:
            os.write(self._journal, _PACK(key >> 32, key & 0xFFFFFFFF, place, size))
        except OSError as err:
            self._stop(err)
            return
        self._records += 1

    def _stop(self, err: OSError) -> None:
        """Write no more records (until the next ``rewrite``): the catalogue on disk then lists
        blocks that may be gone, which reads verify, and lacks new ones, whose places the next open
        takes for free. Serving goes on."""
        log.warning("cannot write the block catalogue in %s (%s): blocks cached from now on are "
                    "not kept across a restart", self.directory, err.strerror)
        self.close()

    def _grow(self, n: int) -> None:
        if n <= len(self._key):
            return
        size = max(1024, n, len(self._key) * 3 // 2)
        self._key = np.resize(self._key, size)
        self._size = np.resize(self._size, size)
        self._place = np.resize(self._place, size)
        self._tick = np.resize(self._tick, size)
        live = np.zeros(size, bool)
        live[:len(self._live)] = self._live
        self._live = live

    def _sort(self) -> None:
        slots = self.slots().astype(np.int32)
        keys = self._key[slots]
        order = np.argsort(keys, kind="stable")
        self._sorted_keys, self._sorted_slots = keys[order], slots[order]
        self._recent.clear()


class Listed(NamedTuple):
    key: BlockKey
    block_size: int
    place: int


def listed(directory: Path) -> list[Listed]:
    """The blocks a cache directory's catalogue lists on disk, read without its lock (for tools
    and tests, while the cache's own process serves)."""
    catalog = Catalog(Path(directory), None)
    catalog.load()
    out = []
    for slot in catalog.slots().tolist():
        key = catalog.key(slot)
        dataset, shard, block_size = catalog.streams[key >> 32]
        out.append(Listed(BlockKey(dataset, shard, key & 0xFFFFFFFF), block_size, catalog.place(slot)))
    return out
