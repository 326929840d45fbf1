"""Fetches of missing blocks from the store, into the RAM tier and the block cache.

Every missing block a read needs is fetched here (``Coalescer`` asks, and so does reading
ahead along plans): one ranged read per run of nearby blocks (``planner.merge_blocks``:
merged across gaps up to ``merge_gap``, at most ``max_fetch`` bytes; a whole aligned window
around a miss when the dataset fits in the cache). Each block has at most one read in
flight (singleflight): a second request for it waits on the first's future. Store reads
in flight are bounded by the slots every request shares (``slots.py``): a read started ahead of a
plan's reader waits behind the reads batches wait on, until a batch comes to wait on one of
its blocks (``arrivals`` promotes it). A fetched block enters the
RAM tier at once and is written to disk on threads of its own, its future kept until it
is there, so a request that comes meanwhile shares its bytes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor

from shardfeed.service.cache.disk import BlockCache
from shardfeed.service.cache.memtier import MemoryTier
from shardfeed.service.cache.names import BlockKey
from shardfeed.service.cluster.peers import Cluster
from shardfeed.service.config import ServiceConfig
from shardfeed.service.datasets.dataset import Dataset
from shardfeed.service.observe.metrics import Metrics
from shardfeed.service.read.planner import merge_blocks
from shardfeed.service.read.slots import StoreSlots, Ticket
from shardfeed.service.stores import Arrived, ObjectChanged, StoreError

log = logging.getLogger("shardfeed.coalescer")

WRITE_THREADS = 2
"""Threads writing fetched blocks to the cache: one disk, a write each while the next is copied."""
WRITE_QUEUE = 256 << 20
"""Bytes of fetched blocks waiting for the writer threads at most; past it, a fetch's blocks are
not cached (the RAM tier lets them go too), so a slow disk never holds up a batch or memory."""


class BlockFetcher:
    """``on_changed`` is called when a read finds a shard replaced in the store (``ObjectChanged``):
    the dataset is out of date and should be opened again (``datasets/served.py``)."""

    def __init__(self, cache: BlockCache, memory: MemoryTier | None, metrics: Metrics, config: ServiceConfig,
                 cluster: Cluster | None = None, *, on_changed: Callable[[Dataset], None] | None = None):
        self.cache = cache
        self.memory = memory
        self.metrics = metrics
        self.cluster = cluster
        self.block_size = config.block_size
        self.gap_blocks = config.merge_gap // config.block_size
        self.max_blocks = max(1, config.max_fetch // config.block_size)
        self.window_blocks = max(1, min(config.fetch_window // config.block_size, self.max_blocks))
        self.slots = StoreSlots(config.max_store_requests)
        """The store reads in flight (``slots.py``: by need, then by tenants' turns)."""
        self._inflight: dict[BlockKey, asyncio.Future] = {}
        """Per block being read, the future of its bytes (or the ``StoreError`` that ended the read)."""
        self._tickets: dict[BlockKey, Ticket] = {}
        """Per block being read, its read's place in line for a store slot."""
        self._tasks: set[asyncio.Task] = set()
        self.on_changed = on_changed or (lambda dataset: None)
        # Cache writes wait on the disk (``O_DIRECT``, ``slabs.py``): on threads of their
        # own, so a slow disk never queues the cache reads on the default executor behind them.
        self._writer = ThreadPoolExecutor(WRITE_THREADS, thread_name_prefix="cache-write")
        self._queued = 0  # bytes handed to the writer threads and not written yet

    def reading(self, key: BlockKey) -> bool:
        """Whether a store read of block ``key`` is under way (or its bytes are being written)."""
        return key in self._inflight

    def arrivals(self, keys: list[BlockKey]) -> dict[BlockKey, Awaitable[memoryview | StoreError | None]]:
        """For each of ``keys`` being read, what its read gives: its bytes, or the ``StoreError``
        that ended it (shielded: a waiter that is cancelled cancels no one else's wait). A read
        ahead among them that still waits for a store slot is needed now: it is promoted."""
        for key in keys:
            if key in self._tickets:
                self.slots.promote(self._tickets[key])
        return {key: asyncio.shield(self._inflight[key]) for key in keys if key in self._inflight}

    def idle(self) -> bool:
        """Whether no store read is under way."""
        return not self._inflight

    def start(self, dataset: Dataset, wanted, *, skip_cached: bool, ahead: bool = False) -> None:
        """Start one store read per run of nearby wanted blocks (``(shard code, block)`` pairs)
        that nobody is reading yet; ``arrivals`` has them on return. ``ahead``: for a plan's
        reader that comes later, so behind the reads batches wait on (``slots.py``)."""
        by_shard: dict[int, set[int]] = defaultdict(set)
        for shard, block in wanted:
            by_shard[shard].add(block)
        loop = asyncio.get_running_loop()
        window = self._window(dataset)
        for shard, numbers in by_shard.items():
            shard_key = BlockKey(dataset.id, dataset.shard_ids[shard], 0)

            def idle(block: int, skip_cached: bool = True) -> bool:
                key = shard_key._replace(block=block)
                return key not in self._inflight and not (skip_cached and key in self.cache)

            todo = sorted(b for b in numbers if idle(b, skip_cached))
            if window > 1 and todo:
                last = (int(dataset.extents[shard]) - 1) // self.block_size
                around = {b for first in {n - n % window for n in todo}
                          for b in range(first, min(first + window - 1, last) + 1) if idle(b)}
                todo = sorted(around.union(todo))
            for first, last in merge_blocks(todo, self.gap_blocks, self.max_blocks, idle):
                ticket = self.slots.ticket(ahead=ahead)
                for block in range(first, last + 1):
                    self._inflight[shard_key._replace(block=block)] = loop.create_future()
                    self._tickets[shard_key._replace(block=block)] = ticket
                self.metrics.cache_misses.inc(last - first + 1)
                task = asyncio.create_task(self._fetch(dataset, shard, first, last, ticket))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)

    def _window(self, dataset: Dataset) -> int:
        """Blocks per window fetched around a miss: ``window_blocks`` when this node's share of
        a served dataset fits in its cache, else 1. A GetBatch request's objects (not
        ``owned``) are read block by block: no epoch will come for the rest of them."""
        if self.window_blocks == 1 or not self.cache.writable or not dataset.owned:
            return 1
        nodes = len(self.cluster.peers) if self.cluster is not None else 1
        return self.window_blocks if dataset.stored_bytes <= self.cache.capacity * nodes else 1

    async def _fetch(self, dataset: Dataset, shard: int, first: int, last: int, ticket: Ticket) -> None:
        """One ranged read for blocks ``first..last`` of a shard. Each block's future is
        resolved the moment its bytes are in (cut-through: a batch waiting for the first
        block of an 8 MiB read does not wait for the other seven), and the block enters the
        RAM tier then, so the batches that come while it is written take the warm path
        (``warm.py``). Once the read is done, its blocks are written to disk."""
        path = dataset.index.shards[shard]
        start = first * self.block_size
        end = min((last + 1) * self.block_size, int(dataset.extents[shard]))
        keys = [BlockKey(dataset.id, dataset.shard_ids[shard], b) for b in range(first, last + 1)]
        held = self.memory is not None and self.cache.writable
        futures = {key: self._inflight[key] for key in keys}  # ours: a key may get another once we let go
        got: dict[BlockKey, memoryview] = {}

        def arrived(number: int, block) -> None:
            key = keys[number]
            if key in got:  # a retried or hedged read's copy of the same bytes
                return
            got[key] = memoryview(block)
            if held:
                self.memory.put(key, block)
            if not futures[key].done():
                futures[key].set_result(got[key])

        try:
            await self._pieces(dataset, shard, start, end, ticket, arrived=arrived)
        except StoreError as err:
            self._settle({key: f for key, f in futures.items() if key not in got}, err)
        except BaseException as err:  # cancelled at shutdown, or a bug: waiters must not hang
            self._settle(futures, StoreError(f"read of {path} aborted: {err!r}"))
            raise
        # Keep the futures registered until the blocks are on disk, so a request that
        # arrives meanwhile shares these bytes instead of reading them again.
        try:
            await self._write(list(got.items()), held)
        finally:
            self._settle({key: futures[key] for key in got}, None)

    async def _write(self, blocks: list[tuple[BlockKey, memoryview]], held: bool) -> None:
        """Write fetched blocks to the cache on the writer threads, unless ``WRITE_QUEUE`` bytes
        wait there already: a disk that cannot keep up goes without these blocks, and no
        batch waits for it. What the disk does not take leaves the RAM tier (it mirrors the disk)."""
        size = sum(len(block) for _, block in blocks)
        if self._queued + size > WRITE_QUEUE and self._queued:
            self.metrics.cache_writes_skipped.inc(len(blocks))
            refused = [key for key, _ in blocks]
        else:
            self._queued += size
            try:
                refused = await asyncio.get_running_loop().run_in_executor(self._writer, self._write_blocks, blocks)
            finally:
                self._queued -= size
        if held:
            for key in refused:
                self.memory.discard(key)

    async def store_read(self, dataset: Dataset, shard: int, start: int, end: int, ticket: Ticket) -> bytes:
        """Bytes ``[start, end)`` of a shard (``RangeReader``'s reads, each with its ticket)."""
        return (await self._pieces(dataset, shard, start, end, ticket, whole=True))[0]

    async def _pieces(self, dataset: Dataset, shard: int, start: int, end: int, ticket: Ticket, *,
                      whole: bool = False, arrived: Arrived | None = None) -> list[bytes]:
        """Bytes ``[start, end)`` of a shard, block by block (from a block boundary; each block
        its own object, so the RAM tier can keep any of them alone, handed to ``arrived``
        as it comes), or ``whole`` as one piece; within a store-read slot taken with ``ticket``, counted."""
        path = dataset.index.shards[shard]
        piece = max(end - start, 1) if whole else self.block_size
        try:
            async with self.slots.hold(ticket):
                self.metrics.inflight_store.inc()
                began = time.perf_counter()
                try:
                    pieces = await dataset.store.read_pieces(path, start, end - start, piece,
                                                             dataset.shard_version(shard), arrived=arrived,
                                                             buffers=None if whole else self.cache.buffers)
                finally:
                    self.metrics.inflight_store.dec()
        except ObjectChanged as err:
            self.metrics.store_errors.inc()
            log.warning("store read %s [%d, %d): %s", path, start, end, err)
            self.on_changed(dataset)
            raise
        except StoreError as err:
            self.metrics.store_errors.inc()
            log.warning("store read %s [%d, %d) failed: %s", path, start, end, err)
            raise
        self.metrics.store_requests.inc()
        self.metrics.store_bytes.inc(end - start)
        log.debug("store read %s [%d, %d) in %.1f ms", path, start, end, 1e3 * (time.perf_counter() - began))
        return pieces

    def _settle(self, futures: dict[BlockKey, asyncio.Future], error: StoreError | None) -> None:
        """Unregister our ``futures`` (not a later read's of the same block), ending those not
        done with ``error``."""
        for key, future in futures.items():
            if self._inflight.get(key) is future:
                del self._inflight[key]
                del self._tickets[key]
            if not future.done():
                future.set_result(error)

    def _write_blocks(self, blocks: list[tuple[BlockKey, memoryview]]) -> list[BlockKey]:
        """Cache the blocks not cached yet; the keys of those the disk refused."""
        return [key for key, block in blocks if key not in self.cache and not self.cache.write(key, block)]

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._writer.shutdown(wait=False)
