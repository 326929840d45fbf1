"""Turns between lanes for the answers the HTTP protocol gives itself (``protocol.py``).

A warm batch is answered as soon as its request is read, in the order the event loop read
the requests: a tenant keeping 64 batches in flight had a request read before another
tenant's almost every time, and the other tenant's P99 went from 1.5 ms alone to 148 ms
(``python -m shardfeed.benchmarks.tenants``). Where an instant answerer names its requests'
lane (``answerer.lane(scope)``: the tenants' token), the answers wait here instead and are
given one at a time, a lane at a time in turn, each turn a callback of its own: requests read
meanwhile join their lanes before the next turn, so a lane waits for at most one answer of
each other lane, however many those have queued.
"""

from __future__ import annotations

import asyncio
import weakref
from collections import deque
from collections.abc import Callable, Hashable


class Turns:
    """Jobs queued per lane, run one per turn, lanes in turn; one per event loop (``of``)."""

    _of_loop: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Turns] = weakref.WeakKeyDictionary()

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self._lanes: dict[Hashable, deque[Callable[[], None]]] = {}  # in turn order
        self._scheduled = False

    @classmethod
    def of(cls, loop: asyncio.AbstractEventLoop) -> Turns:
        turns = cls._of_loop.get(loop)
        if turns is None:
            turns = cls._of_loop[loop] = cls(loop)
        return turns

    def add(self, lane: Hashable, job: Callable[[], None]) -> None:
        self._lanes.setdefault(lane, deque()).append(job)
        if not self._scheduled:
            self._scheduled = True
            self.loop.call_soon(self._turn)

    def _turn(self) -> None:
        lane = next(iter(self._lanes))
        queue = self._lanes.pop(lane)
        job = queue.popleft()
        if queue:
            self._lanes[lane] = queue  # to the back: the other lanes go first
        try:
            job()
        finally:
            if self._lanes:
                self.loop.call_soon(self._turn)
            else:
                self._scheduled = False
