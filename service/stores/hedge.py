"""Hedged store reads: cut the tail latency of a store that is usually fast.

Object stores answer most reads quickly and a few very slowly (a busy disk, a GC pause,
a dropped packet waiting for a retransmit). When a ranged read is still running after
a deadline taken from recent reads (by default their 95th percentile), a second,
identical read is sent; whichever succeeds first is used and the other is cancelled.
Reads are idempotent, so this is safe; it costs extra requests, which a budget bounds
(by default one hedge per ten reads, so a store that is slow across the board is not
hit twice as hard). "The Tail at Scale" (Dean and Barroso, 2013) reports that hedging
at the 95th percentile cuts the 99.9th-percentile latency several-fold for a few
percent more requests.

``Hedger.wrap(store)`` returns a ``Store`` whose ranged reads (``read_range``,
``read_pieces``) are hedged; every other call goes straight through. Only completed reads
feed the latency window: a read that lost a race is cancelled and says nothing about the
store.

Hedges are for small reads (``HEDGED_BYTES`` at most: a block or two). A larger read (a run
of blocks, a fetch window) is not hedged: its copy would read every byte again, and a loser's
bytes are read from the store until it is cancelled, so a budget of one hedge in ten reads
read 1.1-1.3x the dataset where reads were whole windows (``python -m
shardfeed.benchmarks.loaders --latency-ms 20``); its stalls are the progress deadline's
(``s3.py``).

Hedges are for reads that are late, not for reads that fail: a read the store is retrying
(a reset, a 5xx, a silence past its first-byte or progress deadline: ``s3.py``) is failing
already, and a second copy would only double the requests while the store is down, spending
the budget the reads that are merely late need once it is back. So a read that has been
retried by its deadline is not hedged, and its time does not enter the latency window (an
outage would otherwise push the deadline to its maximum).
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

from prometheus_client import CollectorRegistry, Counter

from shardfeed.buffers import BufferPool
from shardfeed.service.config import HedgePolicy
from shardfeed.service.stores import Arrived, ObjectInfo, Store
from shardfeed.service.stores.base import RETRIED, Tries

log = logging.getLogger("shardfeed.hedge")

T = TypeVar("T")

HEDGED_BYTES = 2 << 20
"""The largest read that is hedged."""


class Hedger:
    """One service's hedging: the policy, the hedge budget and the counters.

    Args:
        policy: when to hedge.
        registry: where ``shardfeed_store_hedges_total`` (hedges sent) and
            ``shardfeed_store_hedge_wins_total`` (hedges that finished first) are exported.
    """

    def __init__(self, policy: HedgePolicy, registry: CollectorRegistry | None = None):
        self.policy = policy
        self.hedges = Counter("shardfeed_store_hedges", "Second reads sent for a slow store read",
                              registry=registry)
        self.wins = Counter("shardfeed_store_hedge_wins", "Hedged reads answered by the second read first",
                            registry=registry)
        self._tokens = float(policy.burst)

    def wrap(self, store: Store) -> Store:
        """``store`` with hedged range reads (each store keeps its own latency history)."""
        return HedgedStore(store, self)

    def _spend(self) -> bool:
        if self._tokens >= 1:
            self._tokens -= 1
            return True
        return False

    def _earn(self) -> None:
        self._tokens = min(float(self.policy.burst), self._tokens + self.policy.budget)


class _Latencies:
    """Recent successful read times and the hedging deadline derived from them."""

    def __init__(self, policy: HedgePolicy):
        self.policy = policy
        self._times: deque[float] = deque(maxlen=policy.window)
        self._recorded = 0
        self._deadline = policy.max_delay

    def record(self, seconds: float) -> None:
        self._times.append(seconds)
        self._recorded += 1
        # Sorting a few hundred floats is cheap, but not needed on every read.
        if self._recorded >= self.policy.warmup and self._recorded % 8 == 0:
            ranked = sorted(self._times)
            value = ranked[int(self.policy.quantile * (len(ranked) - 1))]
            self._deadline = min(max(value, self.policy.min_delay), self.policy.max_delay)

    @property
    def deadline(self) -> float:
        return self._deadline


class HedgedStore(Store):
    """A store whose ranged reads are hedged by a ``Hedger``; everything else is passed through."""

    def __init__(self, store: Store, hedger: Hedger):
        self.store = store
        self.url = store.url
        self.hedger = hedger
        self.latencies = _Latencies(hedger.policy)

    async def read_range(self, path: str, offset: int, size: int, version: str | None = None) -> bytes:
        return await self._hedged(lambda: self.store.read_range(path, offset, size, version), path, offset, size)

    async def read_pieces(self, path: str, offset: int, size: int, piece: int,
                          version: str | None = None, *, arrived: Arrived | None = None,
                          buffers: BufferPool | None = None) -> list[bytes]:
        # Both racers hand their pieces on: the same bytes, whichever comes first.
        return await self._hedged(lambda: self.store.read_pieces(path, offset, size, piece, version, arrived=arrived,
                                                                 buffers=buffers),
                                  path, offset, size)

    async def _timed(self, read: Callable[[], Awaitable[T]], tries: Tries) -> T:
        loop = asyncio.get_running_loop()
        began = loop.time()
        data = await read()
        if not tries.failed:  # a retried read's time is the store's failures', not its latency
            self.latencies.record(loop.time() - began)
        return data

    def _racer(self, read: Callable[[], Awaitable[T]]) -> tuple[asyncio.Task, Tries]:
        """``read()`` in a task of its own, and the count of its tries that failed (``RETRIED``)."""
        tries = Tries()
        context = contextvars.copy_context()
        context.run(RETRIED.set, tries)
        return asyncio.get_running_loop().create_task(self._timed(read, tries), context=context), tries

    async def _hedged(self, read: Callable[[], Awaitable[T]], path: str, offset: int, size: int) -> T:
        """``read()``, and the same again if it is still running at the deadline, unless the
        store is retrying it or it is larger than ``HEDGED_BYTES``; the first to succeed."""
        if size > HEDGED_BYTES:
            return await read()
        self.hedger._earn()
        primary, tries = self._racer(read)
        racers = [primary]
        try:
            done, _ = await asyncio.wait(racers, timeout=self.latencies.deadline)
            if done or tries.failed or not self.hedger._spend():
                return await primary
            self.hedger.hedges.inc()
            log.debug("hedging read of %s [%d, +%d) after %.0f ms", path, offset, size,
                      1e3 * self.latencies.deadline)
            racers.append(self._racer(read)[0])
            pending = set(racers)
            failures: dict[asyncio.Future, BaseException] = {}
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    if task.exception() is None:
                        if task is not primary:
                            self.hedger.wins.inc()
                        return task.result()
                    failures[task] = task.exception()
            raise failures[primary]  # both failed: report the original read's error
        finally:
            for task in racers:  # the loser, or both if our caller went away
                if not task.done():
                    task.cancel()
                    task.add_done_callback(_silence)

    async def read(self, path: str, version: str | None = None) -> bytes:
        return await self.store.read(path, version)

    async def write(self, path: str, data: bytes) -> None:
        await self.store.write(path, data)

    async def list(self, prefix: str = "") -> list[ObjectInfo]:
        return await self.store.list(prefix)

    async def list_pages(self, prefix: str = "") -> AsyncIterator[list[ObjectInfo]]:
        async for page in self.store.list_pages(prefix):
            yield page

    async def head(self, path: str) -> ObjectInfo:
        return await self.store.head(path)

    async def close(self) -> None:
        await self.store.close()


def _silence(task: asyncio.Future) -> None:
    """Retrieve a cancelled racer's outcome so asyncio does not log it as never retrieved."""
    if not task.cancelled():
        task.exception()
