"""Where a worker's cached blocks are, for its sibling workers: a small table in a shared file.

With ``serve --workers N`` a worker reads the blocks its siblings cached straight from their
slabs (``siblings.py``), but which place holds a block is in the owner's catalogue, in the
owner's memory. So the owner also publishes each block's place here, in
``<cache dir>/hints``: a file every sibling maps read-only, of 8-byte entries in buckets of
four, one entry a block (the top half of its 64-bit name, ``slabs.block_name``, beside its
place). The owner writes an entry when it holds a block and clears it when it lets it go.

A hint is only a hint. A sibling checks every place it is given against the slot's header
(the full name) and checksums, as the owner does, so an entry being changed, one left by a
crash, or a place reused since are a miss, never a wrong byte; a block whose bucket is full
has no entry (its reader asks the owner over its socket, as for a block not cached). An
entry is one aligned 8-byte store, which no reader sees half done.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np

HINTS = "hints"
WAYS = 4


def hint_entries(capacity: int, block_size: int) -> int:
    """Entries for a cache of ``capacity`` bytes: two per full block it holds, in whole buckets."""
    buckets = max(256, 2 * capacity // max(block_size, 1) // WAYS)
    return buckets * WAYS


def _entry(name: int, place: int) -> int:
    return (name >> 32) << 32 | (place + 1)


class Hints:
    """The table of one cache directory, written by its owner (``publish``) or read by a sibling
    (``read_only``)."""

    def __init__(self, table: np.ndarray):
        self.table = table
        self.buckets = len(table) // WAYS

    @classmethod
    def publish(cls, directory: Path, entries: int) -> Hints:
        """The owner's table, empty (a new file, renamed into place: a sibling still mapping the
        previous one reads its stale hints, which its checks turn into misses)."""
        path = Path(directory) / HINTS
        temp = path.with_name(f".tmp-{HINTS}")
        with open(temp, "wb") as f:
            f.truncate(entries * 8)
        os.replace(temp, path)
        return cls(np.memmap(path, np.uint64, "r+"))

    def _bucket(self, name: int) -> np.ndarray:
        at = (name & 0xFFFFFFFF) % self.buckets * WAYS
        return self.table[at:at + WAYS]

    def put(self, name: int, place: int) -> None:
        """Say that block ``name`` is in ``place``; a full bucket loses the oldest way's entry."""
        bucket = self._bucket(name)
        tags = bucket >> np.uint64(32)
        same = np.flatnonzero(tags == np.uint64(name >> 32))
        empty = np.flatnonzero(bucket == 0)
        way = same[0] if len(same) else empty[0] if len(empty) else name % WAYS
        bucket[way] = _entry(name, place)

    def drop(self, name: int, place: int) -> None:
        """Block ``name`` is no longer in ``place``."""
        bucket = self._bucket(name)
        bucket[bucket == np.uint64(_entry(name, place))] = 0

    def places(self, name: int) -> list[int]:
        """The places that may hold block ``name`` (each to be checked)."""
        bucket = self._bucket(name)
        return [int(e & 0xFFFFFFFF) - 1 for e in bucket[bucket >> np.uint64(32) == np.uint64(name >> 32)].tolist()]


class SiblingHints:
    """A sibling's table, mapped read-only, mapped again when its owner publishes a new one
    (a restart): looked at no more than once a second."""

    def __init__(self, directory: Path):
        self.path = Path(directory) / HINTS
        self._hints: Hints | None = None
        self._inode = None
        self._checked = -1e9

    def places(self, name: int) -> list[int]:
        now = time.monotonic()
        if now - self._checked > 1:
            self._checked = now
            try:
                inode = os.stat(self.path).st_ino
                if inode != self._inode:
                    self._hints, self._inode = Hints(np.memmap(self.path, np.uint64, "r")), inode
            except (OSError, ValueError):  # not published yet, or empty
                self._hints, self._inode = None, None
        return [] if self._hints is None else self._hints.places(name)
