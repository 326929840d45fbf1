"""Where the answers of a batch's parts are read whole: one buffer, a stretch per part.

The tensor and Arrow outputs read a batch into one uint8 buffer rather than parsing it as it
streams: the service says how long its answer is (``Content-Length``, or its
``X-Shardfeed-Length`` estimate on a streamed answer), so the buffer is allocated once and
the transport reads into it (``recv_into``, :class:`~.transport.base.Sink`). Who allocates
decides where it lives (a plain array, a tensor, a pooled shared-memory segment: :mod:`.tensors`);
this module is NumPy only. Each part's stretch starts at a multiple of ``ALIGNMENT``, so the
64-byte alignment of an Arrow answer's buffers holds in the batch's buffer too.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from shardfeed.arrowipc import aligned

GUESS = 1 << 20
"""Bytes allocated for an answer that states no length; the buffer grows if it is longer."""
LENGTH_HEADER = "x-shardfeed-length"
"""A streamed batch answer's expected length (a batch's buffer is sized by it)."""

Allocate = Callable[[int], tuple[np.ndarray, Any]]
"""Makes an uninitialised uint8 array of a size, and what holds it (a pool's lease, or ``None``)."""


def plain(size: int) -> tuple[np.ndarray, None]:
    """An :data:`Allocate` of plain process memory."""
    return np.empty(size, np.uint8), None


class Region:
    """Where one answer is read: a stretch of the batch's buffer (a :class:`~.transport.base.Sink`). An
    answer longer than the stretch moves to an array of its own, grown by doubling."""

    def __init__(self, array: np.ndarray, allocate: Allocate):
        self.array = array
        self.allocate = allocate
        self.filled = 0
        self.moved = False
        self._memory = memoryview(array)

    def space(self, wanted: int) -> memoryview:
        if self.filled == len(self.array):
            self._grow(self.filled + wanted)
        return self._memory[self.filled:self.filled + wanted]

    def wrote(self, n: int) -> None:
        self.filled += n

    def write(self, data: bytes) -> None:
        at = 0
        while at < len(data):
            view = self.space(len(data) - at)
            view[:] = data[at:at + len(view)]
            self.wrote(len(view))
            at += len(view)

    def data(self) -> memoryview:
        return self._memory[:self.filled]

    def _grow(self, at_least: int) -> None:
        bigger = self.allocate(max(at_least, 2 * len(self.array), GUESS))[0]
        bigger[:self.filled] = self.array[:self.filled]
        self.array, self.moved = bigger, True
        self._memory = memoryview(bigger)


class Regions:
    """One buffer for the answers of a batch's parts, a stretch each, sized as announced (and
    rounded up to ``ALIGNMENT``)."""

    def __init__(self, sizes: Sequence[int], allocate: Allocate = plain):
        self.allocate = allocate
        self.starts = _starts(sizes)
        self.buffer, self.holder = allocate(int(self.starts[-1]))
        self.regions = [Region(self.buffer[int(a):int(a) + size], allocate) for a, size in zip(self.starts, sizes)]

    def joined(self) -> tuple[np.ndarray, Any, np.ndarray]:
        """The buffer holding every answer (and what holds it), and where each answer starts in it.
        The usual case is the buffer read into; an answer longer than announced costs one copy."""
        if not any(r.moved for r in self.regions):
            return self.buffer, self.holder, self.starts[:-1]
        starts = _starts([r.filled for r in self.regions])
        buffer, holder = self.allocate(int(starts[-1]))
        for region, start in zip(self.regions, starts.tolist()):
            buffer[start:start + region.filled] = region.array[:region.filled]
        return buffer, holder, starts[:-1]


def _starts(sizes: Sequence[int]) -> np.ndarray:
    """Where stretches of ``sizes`` start, each at a multiple of ``ALIGNMENT``, and where the last ends."""
    padded = [aligned(s) for s in sizes]
    return np.concatenate([[0], np.cumsum(padded)]).astype(np.int64) if padded else np.zeros(1, np.int64)


def announced_length(headers: Mapping[str, str], default: int) -> int:
    """A batch answer's length as its head states it (``Content-Length``, else the service's
    estimate, ``LENGTH_HEADER``); ``default`` when it states none a number."""
    for name in ("content-length", LENGTH_HEADER):
        value = headers.get(name, "")
        if value.isdigit():
            return int(value)
    return default


def regions_for(responses: Sequence[Any], allocate: Allocate = plain) -> Regions:
    """Where the answers of a batch's parts are read: one buffer, sized as their heads say."""
    return Regions([announced_length(r.headers, GUESS) for r in responses], allocate)

