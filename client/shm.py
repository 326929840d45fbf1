"""Shared-memory buffers for tensor batches, kept and reused by the process that fills them.

A DataLoader worker hands each batch to the training process. A fresh shared-memory tensor
per batch (``torch.UntypedStorage._new_shared``) cost here, for 64 x 100 KiB, about 6 ms of
the worker's CPU on top of reading the batch (making the segment, faulting in its pages,
freeing them) and the training process ~1 ms to receive its file descriptor: more than the
pickling it replaces. So a process keeps a few segments and reuses them:

- A segment is a file in ``/dev/shm`` (``shardfeed-<pid namespace>-<pid>-<n>``), mapped once, a 64-byte
  header then the buffer. :func:`lease` returns a tensor over the start of a free segment
  that fits (``POOL_SEGMENTS`` and ``POOL_BYTES`` bound what a process keeps; beyond, for a
  batch larger than ``POOL_BYTES``, or with ``/dev/shm`` full, a plain shared tensor). A
  segment's pages are allocated when it is made, so a full ``/dev/shm`` is an error then,
  never a ``SIGBUS`` while a batch is written.
- Pickled to another process (the DataLoader's queue), a leased buffer travels as the
  segment's name and length (:func:`reduce`); the receiver maps the segment once, unlinks
  its name (the mappings hold it from then on) and gives out tensors over it.
- A segment is free again when every tensor over it, views included, is gone in both
  processes: each side clears its own byte of the header when its last tensor dies (the
  NumPy array under the tensors is finalized), so no byte has two writers.
- A process unlinks, at exit, the segments no other process attached (batches never
  delivered: an epoch cut short). Segments left by a killed process are removed by the
  next pool started on the host. A receiver drops its mapping of a segment whose owner has
  exited once its own tensors over it are gone.
"""

from __future__ import annotations

import itertools
import mmap
import os
import threading
import weakref
from multiprocessing import util

import numpy as np
import torch

HEADER = 64
"""Bytes before the buffer: the flags below, one writer each."""
_OWNER_HOLDS, _RECEIVER_HOLDS, _ATTACHED, _CLOSED = range(4)
POOL_SEGMENTS = 8
"""Segments a process keeps at most (a DataLoader worker has ``prefetch_factor`` batches in
flight, plus those the training loop still holds)."""
POOL_BYTES = 512 << 20
"""Bytes of segments a process keeps at most; a larger batch gets a buffer of its own."""
ROOM = 1 << 20
"""Segments are sized in steps of this, so batches of about one size share them."""
DIRECTORY = "/dev/shm"


def _namespace() -> str:
    """This process's pid namespace: pids are only compared within one (containers sharing
    ``/dev/shm`` may not share it)."""
    try:
        return str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        return "0"


PREFIX = f"shardfeed-{_namespace()}-"


class Segment:
    """One mapped file (``map``): its header as the NumPy view ``flags``, then ``capacity``
    bytes of buffer."""

    def __init__(self, path: str, size: int | None = None):
        fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if size is not None else 0), 0o600)
        try:
            if size is not None:
                try:  # the pages now: a full /dev/shm is an error here, not a SIGBUS when a batch is written
                    os.posix_fallocate(fd, 0, HEADER + size)
                except OSError:
                    os.unlink(path)
                    raise
            self.map = mmap.mmap(fd, 0)
        finally:
            os.close(fd)
        self.path = path
        self.flags = np.frombuffer(self.map, np.uint8, HEADER)
        self.capacity = len(self.map) - HEADER

    def tensor(self, size: int, holder: int) -> torch.Tensor:
        """A tensor over the first ``size`` bytes; ``holder``'s flag is set until it and every
        view of it are gone."""
        array = np.frombuffer(self.map, np.uint8, size, HEADER)
        self.flags[holder] = 1
        weakref.finalize(array, self.flags.__setitem__, holder, 0)
        return torch.from_numpy(array)

    @property
    def free(self) -> bool:
        return not (self.flags[_OWNER_HOLDS] or self.flags[_RECEIVER_HOLDS])


class Lease:
    """A buffer on loan from a pool: which segment, how many bytes of it, and whether it was
    sent to another process (once at most: the receiver's flag has one writer)."""

    def __init__(self, segment: Segment, size: int):
        self.segment = segment
        self.size = size
        self.sent = False


class Pool:
    """This process's segments (see the module's docstring)."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.segments: list[Segment] = []
        self._names = itertools.count()
        self._lock = threading.Lock()
        _sweep()
        util.Finalize(self, _close, args=(self.segments,), exitpriority=10)

    def lease(self, size: int) -> tuple[torch.Tensor, Lease] | None:
        """A tensor of ``size`` bytes over a free segment, or ``None`` if none can be had."""
        if size > POOL_BYTES:
            return None
        with self._lock:
            fits = [s for s in self.segments if s.free and size <= s.capacity <= 2 * size + ROOM]
            if fits:
                segment = min(fits, key=lambda s: s.capacity)
            else:
                segment = self._new(-(-size // ROOM) * ROOM)
                if segment is None:
                    return None
            return segment.tensor(size, _OWNER_HOLDS), Lease(segment, size)

    def _new(self, capacity: int) -> Segment | None:
        """A new segment, making room by dropping free ones; ``None`` if the others are all held."""
        while len(self.segments) >= POOL_SEGMENTS or sum(s.capacity for s in self.segments) + capacity > POOL_BYTES:
            free = [s for s in self.segments if s.free]
            if not free:
                return None
            self.segments.remove(free[0])
            _drop(free[0])
        while True:
            try:
                segment = Segment(os.path.join(DIRECTORY, f"{PREFIX}{self.pid}-{next(self._names)}"), capacity)
                break
            except FileExistsError:  # not ours: never write into a file another made
                continue
            except OSError:  # /dev/shm is full (a container's is often 64 MiB): no pooling
                return None
        self.segments.append(segment)
        return segment


_pool: Pool | None = None
_pool_lock = threading.Lock()
_attached: dict[str, Segment] = {}
"""Segments of other processes this one received buffers in, by path."""
_attached_lock = threading.Lock()


def lease(size: int) -> tuple[torch.Tensor, Lease | None]:
    """A shared-memory uint8 tensor of ``size`` bytes: over a segment of this process's pool
    when one can be had (its :class:`Lease`), else a fresh shared tensor (``None``)."""
    global _pool
    with _pool_lock:
        if _pool is None or _pool.pid != os.getpid():  # a child after fork makes its own
            _pool = Pool()
        pool = _pool
    leased = pool.lease(size) if os.path.isdir(DIRECTORY) else None
    if leased is not None:
        return leased
    storage = torch.UntypedStorage._new_shared(max(size, 1))
    return torch.empty(0, dtype=torch.uint8).set_(storage, 0, (size,), (1,)), None


def reduce(held: Lease) -> tuple[str, int] | None:
    """A leased buffer about to be pickled: what the receiver needs to find it, its segment
    marked as held by the receiver until the receiver says otherwise; ``None`` if it was
    sent before (send the tensor itself then)."""
    if held.sent:
        return None
    held.sent = True
    held.segment.flags[_RECEIVER_HOLDS] = 1
    return held.segment.path, held.size


def attach(path: str, size: int) -> torch.Tensor:
    """In the receiving process: a tensor over the first ``size`` bytes of the segment at
    ``path`` (mapped on first use, then unlinked)."""
    with _attached_lock:
        segment = _attached.get(path)
        if segment is None:
            for stale in [p for p, s in _attached.items() if s.flags[_CLOSED]]:
                del _attached[stale]  # its owner let it go: the mapping goes with our last tensor over it
            segment = _attached[path] = Segment(path)
            segment.flags[_ATTACHED] = 1
            os.unlink(path)
        return segment.tensor(size, _RECEIVER_HOLDS)


def _drop(segment: Segment) -> None:
    """Stop using ``segment``: its file goes if no other process has it (the mapping goes
    with this process's last tensor over it)."""
    segment.flags[_CLOSED] = 1
    if not segment.flags[_ATTACHED]:
        try:
            os.unlink(segment.path)
        except FileNotFoundError:
            pass


def _close(segments: list[Segment]) -> None:
    for segment in segments:
        _drop(segment)


def _sweep() -> None:
    """Remove segments whose owner is gone (killed before it could clean up)."""
    try:
        names = [n for n in os.listdir(DIRECTORY) if n.startswith(PREFIX)]
    except OSError:
        return
    for name in names:
        try:
            pid = int(name[len(PREFIX):].split("-", 1)[0])
            os.kill(pid, 0)
        except ProcessLookupError:
            try:
                os.unlink(os.path.join(DIRECTORY, name))
            except OSError:
                pass
        except (ValueError, PermissionError):
            pass
