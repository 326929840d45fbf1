"""Sample ranges read without their block: the fetch for a block the plans say would be
evicted before enough of its samples are read (``service/plans/``).

Caching a whole 1 MiB block pays only if the cache keeps it while many of its samples
are read. With a cache smaller than the dataset and a random order, most blocks are
evicted after one or two of their samples are read, so a block fetch costs a whole
block for a sample or two (LRU over 1 MiB blocks reads the dataset many times over per
epoch: docs/benchmarks.md). For such blocks the coalescer asks for just the members' byte ranges instead;
ranges of one shard closer than ``range_gap`` are merged into one read. The bytes are
not cached.

Ranges can also be read ahead of a plan's reader (``read_ahead``), held in memory until
the reader takes them, within ``plan_memory`` bytes; one never taken is dropped after
``STALE`` seconds.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict, defaultdict
from collections.abc import Awaitable, Callable

from shardfeed.service.datasets.dataset import Dataset
from shardfeed.service.stores import StoreError

STALE = 30.0
"""Seconds a range read ahead waits for its reader before it is dropped."""

TAKEN_KEPT = 1 << 16
"""Ranges a reader took lately that are remembered, so that reading ahead, which may lag
behind a reader whose DataLoader workers run a few batches ahead of the position the plan
saw last, does not read them again (the same sample is not wanted twice in an epoch)."""

Span = tuple[int, int, int]
"""``(shard code, start, end)``: absolute byte range of a member piece in a shard."""

StoreRead = Callable[[Dataset, int, int, int], Awaitable[bytes]]


class RangeReader:
    """Reads member ranges from the store, merged when near; shares reads in flight."""

    def __init__(self, store_read: StoreRead, *, gap: int, max_read: int, memory: int):
        self.store_read = store_read  # raises StoreError
        self.gap = gap
        self.max_read = max_read
        self.memory = memory
        self._pending: OrderedDict[tuple, tuple[asyncio.Future, float]] = OrderedDict()  # key -> (bytes, when)
        self._held = 0  # bytes of ranges read ahead, in flight or waiting for their reader
        self._taken: OrderedDict[tuple, None] = OrderedDict()  # the latest TAKEN_KEPT a reader took
        self._tasks: set[asyncio.Task] = set()

    def room(self) -> int:
        """Bytes of ranges that may still be read ahead."""
        self._drop_stale()
        return max(0, self.memory - self._held)

    def holds(self, dataset: Dataset, spans: list[Span]) -> bool:
        """Whether every span is being read or waits for its reader already."""
        return all(_key(dataset, *span) in self._pending for span in spans)

    async def read(self, dataset: Dataset, spans: list[Span]) -> list[bytes | StoreError]:
        """The bytes of each span (or the error that prevented reading it), in order."""
        keys = [_key(dataset, *span) for span in spans]
        missing = [span for span, key in zip(spans, keys) if key not in self._pending]
        self._start(dataset, missing, ahead=False)
        futures = [self._pending[key][0] for key in keys]  # before any wait: a sharer may pop them
        out = [await asyncio.shield(future) for future in futures]
        for key, future in zip(keys, futures):
            entry = self._pending.get(key)
            if entry is not None and entry[0] is future:  # not a later read's of the same range
                del self._pending[key]
                if entry[1] > 0:  # read ahead: its memory is free now
                    self._held -= key[3] - key[2]
            self._taken[key] = None
            self._taken.move_to_end(key)
        while len(self._taken) > TAKEN_KEPT:
            self._taken.popitem(last=False)
        return out

    def read_ahead(self, dataset: Dataset, spans: list[Span]) -> None:
        """Start reading spans for a reader that comes later (callers stay within ``room()``)."""
        self._start(dataset, [s for s in spans if (key := _key(dataset, *s)) not in self._pending
                              and key not in self._taken], ahead=True)

    def _start(self, dataset: Dataset, spans: list[Span], *, ahead: bool) -> None:
        by_shard: dict[int, list[tuple[int, int]]] = defaultdict(list)
        for shard, start, end in set(spans):
            by_shard[shard].append((start, end))
        loop = asyncio.get_running_loop()
        now = time.monotonic() if ahead else 0.0
        for shard, ranges in by_shard.items():
            for run in _merge(sorted(ranges), self.gap, self.max_read):
                futures = [loop.create_future() for _ in run]
                for (start, end), future in zip(run, futures):
                    self._pending[_key(dataset, shard, start, end)] = (future, now)
                    if ahead:
                        self._held += end - start
                task = asyncio.create_task(self._fetch(dataset, shard, run, futures))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)

    async def _fetch(self, dataset: Dataset, shard: int, run: list[tuple[int, int]],
                     futures: list[asyncio.Future]) -> None:
        """Read ``run`` and resolve its ``futures``: its own, whatever ``_pending`` holds by then
        (a reader that shared a range may have let go of it, and another read it again)."""
        first, last = run[0][0], max(end for _, end in run)
        try:
            payload: bytes | StoreError = await self.store_read(dataset, shard, first, last)
        except StoreError as err:
            payload = err
        except BaseException as err:  # cancelled at shutdown: waiters must not hang
            payload = StoreError(f"read of {dataset.index.shards[shard]} aborted: {err!r}")
        for (start, end), future in zip(run, futures):
            if not future.done():
                future.set_result(payload if isinstance(payload, StoreError) else payload[start - first:end - first])

    def _drop_stale(self) -> None:
        cutoff = time.monotonic() - STALE
        stale = []
        for key, (future, when) in self._pending.items():  # oldest first
            if when >= cutoff:
                break
            if when > 0 and future.done():
                stale.append(key)
        for key in stale:
            del self._pending[key]
            self._held -= key[3] - key[2]

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


def _key(dataset: Dataset, shard: int, start: int, end: int) -> tuple[str, str, int, int]:
    """What a range read is shared by: the shard's version (``Dataset.shard_ids``), not its
    code, which another version of the dataset may give another shard."""
    return dataset.id, dataset.shard_ids[shard], start, end


def _merge(ranges: list[tuple[int, int]], gap: int, max_read: int) -> list[list[tuple[int, int]]]:
    """Sorted ranges grouped into runs read at once: neighbours at most ``gap`` apart,
    no run longer than ``max_read`` (a single longer range is its own run)."""
    runs: list[list[tuple[int, int]]] = []
    end_of_run = start_of_run = 0
    for start, end in ranges:
        if runs and start - end_of_run <= gap and max(end, end_of_run) - start_of_run <= max_read:
            runs[-1].append((start, end))
            end_of_run = max(end_of_run, end)
        else:
            runs.append([(start, end)])
            start_of_run, end_of_run = start, end
    return runs
