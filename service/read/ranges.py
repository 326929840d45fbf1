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
the reader takes them, within ``plan_memory`` bytes; one never taken is dropped ``STALE``
seconds after its bytes arrived (not after it was asked for: a read that waited long for a
store slot must still be there for its reader). Such reads take the store's slots ``ahead``
of the reads a batch waits on (``slots.py``); a batch that comes to wait on one still
waiting for a slot promotes it.
"""

from __future__ import annotations

import asyncio
import functools
import time
from bisect import bisect_right, insort
from collections import OrderedDict, defaultdict
from collections.abc import Awaitable, Callable

from shardfeed.service.datasets.dataset import Dataset
from shardfeed.service.read.slots import StoreSlots, Ticket
from shardfeed.service.stores import StoreError

STALE = 30.0
"""Seconds a range read ahead waits for its reader, once its bytes are in, before it is dropped."""

TAKEN_KEPT = 1 << 16
"""Ranges a reader took lately that are remembered, so that reading ahead, which may lag
behind a reader whose DataLoader workers run a few batches ahead of the position the plan
saw last, does not read them again (the same sample is not wanted twice in an epoch)."""

Span = tuple[int, int, int]
"""``(shard code, start, end)``: absolute byte range of a member piece in a shard."""

StoreRead = Callable[[Dataset, int, int, int, Ticket], Awaitable[bytes]]
"""``(dataset, shard code, start, end, ticket)`` -> the bytes, read within a store slot taken with ``ticket``."""


class RangeReader:
    """Reads member ranges from the store, merged when near; shares reads in flight. A range
    read ahead also serves the ranges inside it (an MDS or LitData record read ahead serves its
    header and each of its fields: ``read/fields.py``), and is let go once as many of its
    bytes were taken as it holds."""

    def __init__(self, store_read: StoreRead, slots: StoreSlots, *, gap: int, max_read: int, memory: int):
        self.store_read = store_read  # raises StoreError
        self.slots = slots  # what ``store_read``'s tickets are for
        self.gap = gap
        self.max_read = max_read
        self.memory = memory
        self._pending: dict[tuple, tuple[asyncio.Future, Ticket, bool]] = {}  # key -> (bytes, its read's ticket, held)
        self._arrived: OrderedDict[tuple, float] = OrderedDict()
        """Ranges read ahead whose bytes are in, oldest arrival first, with its time: what goes stale."""
        self._held = 0  # bytes of ranges read ahead, in flight or waiting for their reader
        self._taken: OrderedDict[tuple, None] = OrderedDict()  # the latest TAKEN_KEPT a reader took
        self._ahead: dict[tuple[str, str], list[tuple[int, int]]] = defaultdict(list)
        """Per shard version, the ranges read ahead and not let go, sorted: what serves a range inside one."""
        self._covered: dict[tuple, int] = defaultdict(int)  # key -> bytes of it taken so far
        self._tasks: set[asyncio.Task] = set()

    def room(self) -> int:
        """Bytes of ranges that may still be read ahead."""
        self._drop_stale()
        return max(0, self.memory - self._held)

    def holds(self, dataset: Dataset, spans: list[Span]) -> bool:
        """Whether every span is being read or waits for its reader already."""
        return all(self._source(_key(dataset, *span)) is not None for span in spans)

    async def read(self, dataset: Dataset, spans: list[Span]) -> list[bytes | StoreError]:
        """The bytes of each span (or the error that prevented reading it), in order."""
        keys = [_key(dataset, *span) for span in spans]
        sources = [self._source(key) for key in keys]
        self._start(dataset, [span for span, source in zip(spans, sources) if source is None], held=False, ahead=False)
        sources = [source or key for key, source in zip(keys, sources)]
        futures = [self._pending[source][0] for source in sources]  # before any wait: a sharer may pop them
        for source in set(sources):  # read ahead and still waiting for a slot: needed now
            self.slots.promote(self._pending[source][1])
        out = []
        for key, source, future in zip(keys, sources, futures):
            data = await asyncio.shield(future)
            out.append(data if source == key or isinstance(data, StoreError)
                       else data[key[2] - source[2]:key[3] - source[2]])
        for key, source, future in zip(keys, sources, futures):
            entry = self._pending.get(source)
            if entry is not None and entry[0] is future:  # not a later read's of the same range
                self._covered[source] += key[3] - key[2]
                if self._covered[source] >= source[3] - source[2]:
                    self._forget(source)
            self._taken[key] = None
            self._taken.move_to_end(key)
        while len(self._taken) > TAKEN_KEPT:
            self._taken.popitem(last=False)
        return out

    def read_ahead(self, dataset: Dataset, spans: list[Span], *, needed: bool = False) -> None:
        """Start reading spans for a reader that comes later (callers stay within ``room()``):
        a plan's reader (the reads wait ``ahead`` of it for the store), or, ``needed``, the
        groups of the batch being served now."""
        self._start(dataset, [s for s in spans if (key := _key(dataset, *s)) not in self._taken
                              and self._source(key) is None], held=True, ahead=not needed)

    def _source(self, key: tuple) -> tuple | None:
        """The range being read, or waiting for its reader, that holds ``key``'s bytes: ``key``
        itself, or a range read ahead around it; None if none."""
        if key in self._pending:
            return key
        ahead = self._ahead.get(key[:2])
        if not ahead:
            return None
        at = bisect_right(ahead, (key[2], float("inf"))) - 1
        if at >= 0 and ahead[at][0] <= key[2] and key[3] <= ahead[at][1]:
            return (*key[:2], *ahead[at])
        return None

    def _forget(self, key: tuple) -> None:
        """Let go of a range: taken whole, or stale."""
        _, _, held = self._pending.pop(key)
        self._covered.pop(key, None)
        self._arrived.pop(key, None)
        if held:  # read ahead: its memory is free now
            self._held -= key[3] - key[2]
            ahead = self._ahead[key[:2]]
            ahead.remove((key[2], key[3]))
            if not ahead:
                del self._ahead[key[:2]]

    def _start(self, dataset: Dataset, spans: list[Span], *, held: bool, ahead: bool) -> None:
        """Start reading ``spans``: ``held`` in memory until their reader takes them (read ahead),
        with tickets ``ahead`` of the reads batches wait on, or not."""
        by_shard: dict[int, list[tuple[int, int]]] = defaultdict(list)
        for shard, start, end in set(spans):
            by_shard[shard].append((start, end))
        loop = asyncio.get_running_loop()
        for shard, ranges in by_shard.items():
            for run in _merge(sorted(ranges), self.gap, self.max_read):
                ticket = self.slots.ticket(ahead=ahead)
                futures = [loop.create_future() for _ in run]
                for (start, end), future in zip(run, futures):
                    key = _key(dataset, shard, start, end)
                    self._pending[key] = (future, ticket, held)
                    if held:
                        self._held += end - start
                        insort(self._ahead[key[:2]], (start, end))
                        future.add_done_callback(functools.partial(self._arrival, key))
                task = asyncio.create_task(self._fetch(dataset, shard, run, futures, ticket))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)

    async def _fetch(self, dataset: Dataset, shard: int, run: list[tuple[int, int]],
                     futures: list[asyncio.Future], ticket: Ticket) -> None:
        """Read ``run`` and resolve its ``futures``: its own, whatever ``_pending`` holds by then
        (a reader that shared a range may have let go of it, and another read it again)."""
        first, last = run[0][0], max(end for _, end in run)
        try:
            payload: bytes | StoreError = await self.store_read(dataset, shard, first, last, ticket)
        except StoreError as err:
            payload = err
        except BaseException as err:  # cancelled at shutdown: waiters must not hang
            payload = StoreError(f"read of {dataset.index.shards[shard]} aborted: {err!r}")
        for (start, end), future in zip(run, futures):
            if not future.done():
                future.set_result(payload if isinstance(payload, StoreError) else payload[start - first:end - first])

    def _arrival(self, key: tuple, future: asyncio.Future) -> None:
        """A range read ahead is in: its age counts from now (if it is still the one ``key`` names)."""
        entry = self._pending.get(key)
        if entry is not None and entry[0] is future:
            self._arrived[key] = time.monotonic()

    def _drop_stale(self) -> None:
        cutoff = time.monotonic() - STALE
        stale = []
        for key, when in self._arrived.items():  # oldest arrival first
            if when >= cutoff:
                break
            stale.append(key)
        for key in stale:
            self._forget(key)

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
