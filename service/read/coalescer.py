"""The coalescer: every read of sample bytes, from a batch or from per-sample GETs, comes here.

For a set of requested members it finds their blocks: those held in RAM are taken (``memtier.py``:
no thread hop, no copy), other cached ones read from disk (a thread hop a call; whole blocks, which
enter the RAM tier), missing ones fetched from the store (``fetcher.py``: one ranged read per run
of nearby blocks, one read in flight per block). A batch plans its store reads up front
(``prefetch``), so they merge across the groups it is streamed in.

With replicas or workers, members of shards owned by another replica or sibling worker
are sent to that owner as one sub-batch, and read from the store here if the owner
fails (``peers.py``); the blocks of those a replica served count as hits here
(``replica_blocks``; it counts its own cache hits and store reads for them). A sibling
worker's blocks are first read from its cache directory (``siblings.py``): only the
members of blocks it has not cached cross its socket. While a sibling is down
(restarting), its directory is still read first; what is not there is read by the live
worker that stands in as the owner of its shards, and cached in that worker's own
directory: a worker's directory has no other writer.

With plans (``service/plans/``), a ``FetchPolicy`` says which missing blocks to fetch whole (others: ``ranges.py``).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections import defaultdict
from collections.abc import Callable
from typing import Protocol

import numpy as np

from shardfeed.service.cache.disk import BlockCache
from shardfeed.service.cache.memtier import MemoryTier
from shardfeed.service.cache.names import BlockKey
from shardfeed.service.cache.siblings import SiblingBlocks
from shardfeed.service.cluster.peerreader import PeerError
from shardfeed.service.cluster.peers import Cluster
from shardfeed.service.config import ServiceConfig
from shardfeed.service.datasets.dataset import Dataset
from shardfeed.service.datasets.index import Members
from shardfeed.service.observe.metrics import Metrics
from shardfeed.service.read.fetcher import BlockFetcher
from shardfeed.service.read.planner import Payload, assemble, distinct_blocks, plan_pieces, take
from shardfeed.service.read.ranges import RangeReader
from shardfeed.service.read.slots import StoreSlots
from shardfeed.service.stores import StoreError

log = logging.getLogger("shardfeed.coalescer")

DISK_READS = min(32, (os.cpu_count() or 1) + 4)
"""Cached blocks read from disk at once: the threads of asyncio's default executor (its own
formula), whose queue is first come across tenants; past them a read waits its tenant's turn
(``disk_turns``) instead."""

RANGES_FIRST_SHARE = 1 / 8
"""``ranges_first`` reads the ranges of a cold block of which a read needs this share at most
(one 100 KiB sample of a 1 MiB block): the ranges cost their bytes again when the block
follows, so at most an eighth more on a block's first touch."""


class FetchPolicy(Protocol):
    """Which missing blocks to fetch and cache whole (``plans.Plans``); the others' members are
    read as ranges (``ranges.py``)."""

    def whole_blocks(self, dataset: Dataset, shards: np.ndarray, blocks: np.ndarray) -> np.ndarray:
        """Per missing block (shard code, block number), whether to fetch it whole."""


class Coalescer:
    """Reads members through the tiers. ``memory``: the RAM tier in front of ``cache`` (the one
    the cache tells of blocks it lets go); ``fetch_policy``: ``None`` fetches every missing block
    whole; ``on_changed``: told of a dataset a read found replaced in the store."""

    def __init__(self, cache: BlockCache, metrics: Metrics, config: ServiceConfig, cluster: Cluster | None = None,
                 *, memory: MemoryTier | None = None, fetch_policy: FetchPolicy | None = None,
                 on_changed: Callable[[Dataset], None] | None = None):
        self.cache = cache
        self.cluster = cluster
        self.metrics = metrics
        self.block_size = config.block_size
        self.memory = memory
        self.fetcher = BlockFetcher(cache, memory, metrics, config, cluster, on_changed=on_changed)
        self.disk_turns = StoreSlots(DISK_READS)
        """Reads of cached blocks from disk, by tenants' turns (``slots.py``), as store reads are."""
        self._sibling_reads: dict[BlockKey, asyncio.Future] = {}  # whole sibling blocks being read
        self._holds_all: dict[str, tuple[tuple, bool]] = {}  # dataset id -> (what it was drawn from, answer)
        self._own_blocks: dict[str, tuple] = {}  # dataset id -> ((ownership, version), blocks in all, shard ids, blocks of each)
        self.ranges = RangeReader(self.fetcher.store_read, self.fetcher.slots, gap=config.range_gap,
                                  max_read=config.max_fetch, memory=config.plan_memory)
        self.siblings = None if cluster is None else SiblingBlocks(
            {node: p.cache_dir for node, p in enumerate(cluster.workers) if p.cache_dir is not None
             and node != cluster.me}, config.block_size, metrics, cache.buffers)
        self.ranges_first = config.ranges_first
        self.fetch_policy = fetch_policy

    async def read_members(self, dataset: Dataset, members: Members, *,
                           scope: str = "cluster") -> list[Payload | StoreError | None]:
        """The bytes of each member row, in order: one piece (bytes or a view), or, for a
        member over several blocks, its pieces unjoined (``planner.Parts``; ``planner.pieces``
        and ``size_of`` read either).

        ``None`` for a member the index says is absent, a ``StoreError`` for one whose
        bytes could not be read; never partial bytes. ``scope`` says who reads members
        owned elsewhere: their owner in the whole ``cluster``; their owner among this
        ``host``'s workers (a replica sent them here, taking this host for their owner);
        or this ``node`` itself (a sibling worker sent them).
        """
        if self.cluster is None or scope == "node" or not dataset.owned:
            return await self._read_local(dataset, members)
        rows = np.flatnonzero(members.found)
        owner = np.full(len(members), self.cluster.me)
        home = np.full(len(members), -1)
        shards = dataset.index.shards
        owner[rows] = self.cluster.owners(dataset.url, shards, members.shard[rows], within_host=scope == "host")
        home[rows] = self.cluster.down_homes(dataset.url, shards, members.shard[rows], owner[rows])
        out: list = [None] * len(members)
        nodes = len(self.cluster.peers) + 1
        pair = owner * nodes + home + 1  # one number per (owner, home) pair
        keys = np.unique(pair).tolist()
        groups = [np.flatnonzero(pair == key) for key in keys]
        results = await asyncio.gather(*(self._read_at(key // nodes, dataset, take(members, g), home=key % nodes - 1)
                                         for key, g in zip(keys, groups)))
        for group, result in zip(groups, results):
            for row, payload in zip(group.tolist(), result):
                out[row] = payload
        return out

    async def _read_at(self, node: int, dataset: Dataset, members: Members, *, home: int = -1) -> list:
        """The members from their owner ``node``; those of shards whose ``home`` worker is down
        first from its slabs, which stay there while it restarts (nothing is written
        there but by it: what they lack is read and cached by ``node``)."""
        if home in self.siblings:
            return await self._files_first(home, dataset, members, lambda rest: self._read_at(node, dataset, rest))
        if node == self.cluster.me:
            return await self._read_local(dataset, members)
        if node in self.siblings:
            return await self._files_first(node, dataset, members, lambda rest: self._ask(node, dataset, rest))
        return await self._ask(node, dataset, members)

    async def _files_first(self, sibling: int, dataset: Dataset, members: Members, rest) -> list:
        """The members from a sibling's slabs where they are, the others from ``rest(members)``."""
        out = await self._read_sibling_files(sibling, dataset, members)
        rows = np.flatnonzero([payload is _ASK_OWNER for payload in out])
        if len(rows):
            for row, payload in zip(rows.tolist(), await rest(take(members, rows))):
                out[row] = payload
        return out

    async def _ask(self, node: int, dataset: Dataset, members: Members) -> list:
        """The members from another node; from the store here if it fails."""
        try:
            reader = self.cluster.reader(node)
            out = await reader.read(dataset, members)
        except PeerError as err:
            log.warning("reading %d members from the store instead: %s", len(members), err)
            self.metrics.peer_fallbacks.inc(len(members))
            return await self._read_local(dataset, members)
        if reader.kind == "replica":  # a sibling's blocks count where it read them
            self.metrics.replica_blocks.inc(distinct_blocks(members, self.block_size))
        return out

    async def _read_sibling_files(self, node: int, dataset: Dataset, members: Members) -> list:
        """The members of a sibling's shards, from RAM or its cache directory (``siblings.py``);
        ``_ASK_OWNER`` for those in blocks it has not cached."""
        pieces = _Pieces(dataset, members, self.block_size)
        remaining = self._take_held(pieces)
        if remaining:
            wanted = self._wanted(pieces, remaining)
            found = await self._read_sibling_blocks(node, wanted)
            # A sibling's blocks enter the RAM tier though no eviction there is told of them
            # here: a verified block's bytes never change.
            self._take_read(pieces, found, wanted, keep=lambda key: True)
            for key in remaining:
                if key not in found:
                    pieces.bytes.update((i, _ASK_OWNER) for i in pieces.blocks[key])
        return assemble(members, pieces.plan.member, pieces.bytes)

    async def _read_sibling_blocks(self, node: int, wanted: dict) -> dict[BlockKey, list[bytes]]:
        """``SiblingBlocks.read`` in a thread; a whole block wanted by several groups at once
        (the groups of one batch, concurrent batches) is read and checked once."""
        if self.memory is None:  # ranges: each caller its own
            return await asyncio.to_thread(self.siblings.read, node, wanted)
        waiting = {key: self._sibling_reads[key] for key in wanted if key in self._sibling_reads}
        mine = [key for key in wanted if key not in waiting]
        found: dict[BlockKey, list[bytes]] = {}
        if mine:
            future = asyncio.get_running_loop().create_future()
            for key in mine:
                self._sibling_reads[key] = future
            try:
                found = await asyncio.to_thread(self.siblings.read, node, dict.fromkeys(mine))
            finally:  # cancelled or not, the others stop waiting (what is not found, they ask the owner)
                for key in mine:
                    self._sibling_reads.pop(key, None)
                future.set_result(found)
        for future in set(waiting.values()):
            theirs = await asyncio.shield(future)
            found.update((key, parts) for key, parts in theirs.items() if key in waiting)
        return found

    def _take_held(self, pieces: _Pieces) -> list[BlockKey]:
        """Take the pieces of RAM-held blocks; the other blocks."""
        if self.memory is None:
            return list(pieces.blocks)
        held = self.held_blocks(pieces.blocks)
        for key, block in held.items():
            pieces.take(key, block)
        return [k for k in pieces.blocks if k not in held]

    def _wanted(self, pieces: _Pieces, keys: list[BlockKey], admits=None) -> dict[BlockKey, list | None]:
        """What to read of each block from disk: the whole block (``None``) where it is to enter
        the RAM tier (where ``admits(key)``, by default every block), else the pieces' ranges."""
        starts, ends = pieces.starts, pieces.ends
        whole = (lambda key: False) if self.memory is None else admits or (lambda key: True)
        return {k: None if whole(k) else [(starts[i], ends[i]) for i in pieces.blocks[k]] for k in keys}

    def _take_read(self, pieces: _Pieces, found: dict[BlockKey, list[bytes]], wanted: dict, keep) -> None:
        """Take the pieces of blocks read from disk as ``wanted`` (``_wanted``) said; whole
        blocks enter the RAM tier where ``keep(key)``."""
        for key, parts in found.items():
            if wanted[key] is not None:
                pieces.bytes.update(zip(pieces.blocks[key], parts))
                continue
            if keep(key):
                self.memory.put(key, parts[0])
            pieces.take(key, memoryview(parts[0]))

    async def _read_local(self, dataset: Dataset, members: Members) -> list[Payload | StoreError | None]:
        pieces = _Pieces(dataset, members, self.block_size)
        blocks, starts, ends, piece_bytes = pieces.blocks, pieces.starts, pieces.ends, pieces.bytes
        remaining = self._take_held(pieces)
        for attempt in range(3):
            # Cached blocks first, all in one thread hop.
            cached = [k for k in remaining if not self.fetcher.reading(k) and k in self.cache]
            if cached:
                # Scan resistance: a block enters RAM on its second read from disk (``memtier.py``).
                wanted = self._wanted(pieces, cached, self.memory and self.memory.admits)
                async with self.disk_turns.hold(self.disk_turns.ticket()):
                    found = await asyncio.to_thread(self._read_cached, wanted)
                self.metrics.cache_hits.inc(len(found))
                # A block evicted meanwhile stays out of RAM: the tier mirrors the disk.
                self._take_read(pieces, found, wanted, keep=lambda key: key in self.cache)
                remaining = [k for k in remaining if k not in found]
            if not remaining:
                break
            if attempt == 0:
                remaining = await self._read_ranges(dataset, pieces.plan, blocks, remaining, piece_bytes)
                if not remaining:
                    break
            # The rest is being read, or is read now. A block that reached the cache while
            # we were reading others is left for the next round (the last round reads all).
            self.fetcher.start(dataset, [(int(pieces.plan.shard[blocks[k][0]]), k.block) for k in remaining],
                                skip_cached=attempt < 2)
            arrivals = self.fetcher.arrivals(remaining)
            waiting = list(arrivals)
            results = await asyncio.gather(*arrivals.values())
            for key, block in zip(waiting, results):
                for i in blocks[key]:
                    piece_bytes[i] = block if isinstance(block, StoreError) else block[starts[i]:ends[i]]
            done = set(waiting)
            remaining = [k for k in remaining if k not in done]

        return assemble(members, pieces.plan.member, piece_bytes)

    async def _read_ranges(self, dataset: Dataset, pieces, blocks: dict[BlockKey, list[int]],
                           keys: list[BlockKey], piece_bytes: dict) -> list[BlockKey]:
        """Read as ranges the pieces of the blocks not worth fetching whole, and (``ranges_first``)
        of those worth it that nobody reads yet and of which this read needs a little: those
        are fetched whole behind it. The other keys."""
        idle = [k for k in keys if not self.fetcher.reading(k)]  # a block being read is cheaper to wait for
        if not idle or (self.fetch_policy is None and not self.ranges_first):
            return keys
        shards = pieces.shard[[blocks[k][0] for k in idle]]
        whole = (self.fetch_policy.whole_blocks(dataset, shards, np.array([k.block for k in idle]))
                 if self.fetch_policy is not None else np.ones(len(idle), dtype=bool))
        spans = {k: pieces.spans(blocks[k], self.block_size) for k in idle}
        cold = self.cold_pairs(dataset, pieces)
        first = {k for k, shard in zip(idle, shards.tolist()) if (shard, k.block) in cold}
        # Ranges read ahead are used whatever the policy says now.
        partial = [k for k, w in zip(idle, whole.tolist())
                   if not w or k in first or self.ranges.holds(dataset, spans[k])]
        if not partial:
            return keys
        rows = [i for k in partial for i in blocks[k]]
        read = await self.ranges.read(dataset, [span for k in partial for span in spans[k]])
        piece_bytes.update(zip(rows, read))
        behind = [(shard, k.block) for k, shard, w in zip(idle, shards.tolist(), whole.tolist()) if w and k in first]
        if behind:
            self.fetch_ahead(dataset, behind)
        done = set(partial)
        return [k for k in keys if k not in done]

    def whole_blocks_wanted(self, dataset: Dataset, pieces) -> set[tuple[int, int]]:
        """The ``(shard code, block)`` pairs of ``pieces`` worth fetching whole."""
        pairs = sorted(set(zip(pieces.shard.tolist(), pieces.block.tolist())))
        if self.fetch_policy is None or not pairs:
            return set(pairs)
        shards, numbers = (np.array(column) for column in zip(*pairs))
        return {pair for pair, whole in zip(pairs, self.fetch_policy.whole_blocks(dataset, shards, numbers)) if whole}

    def fetch_ahead(self, dataset: Dataset, pairs) -> None:
        """Start reading the given ``(shard code, block)`` pairs into the cache, if missing, for a
        reader that comes later (behind the reads batches wait on)."""
        if self.cache.writable:
            self.fetcher.start(dataset, pairs, skip_cached=True, ahead=True)

    def prefetch(self, dataset: Dataset, members: Members) -> None:
        """Start reading every missing block of a whole batch now, merged per shard.

        The batch is then served group by group, but its store reads are planned at
        once, so a shard's blocks come in one or two reads instead of one per group.
        Skipped when the cache could not keep the blocks until they are served. Blocks
        read ranges first are left to the groups, which fetch them behind their ranges.
        """
        if not self.cache.writable:
            return
        if self.cluster is not None and dataset.owned:
            members = take(members, self.own_rows(dataset, members))
        pieces = plan_pieces(members, self.block_size)
        pairs = self.whole_blocks_wanted(dataset, pieces)
        if len(pairs) * self.block_size <= self.cache.capacity // 4:
            cold = self.cold_pairs(dataset, pieces)
            if cold:  # the batch's ranges first, at once: its groups take them
                rows = [i for i, pair in enumerate(zip(pieces.shard.tolist(), pieces.block.tolist())) if pair in cold]
                spans = pieces.spans(rows, self.block_size)
                if sum(end - start for _, start, end in spans) <= self.ranges.room():
                    self.ranges.read_ahead(dataset, spans, needed=True)
            self.fetcher.start(dataset, pairs - cold, skip_cached=True)

    def cold_pairs(self, dataset: Dataset, pieces) -> set[tuple[int, int]]:
        """With ``ranges_first``, the ``(shard, block)`` pairs of ``pieces`` that are neither
        cached nor being read and of which the pieces need ``RANGES_FIRST_SHARE`` at most."""
        if not self.ranges_first:
            return set()
        ids = dataset.shard_ids
        return {pair for pair, size in pieces.needs().items() if size <= RANGES_FIRST_SHARE * self.block_size
                and not self.fetcher.reading(key := BlockKey(dataset.id, ids[pair[0]], pair[1]))
                and key not in self.cache}

    def own_rows(self, dataset: Dataset, members: Members) -> np.ndarray:
        """The found rows of ``members`` that this node owns and reads from the store: not
        those of a down sibling's shards, which its slabs may still hold."""
        rows = np.flatnonzero(members.found)
        return rows[self._own(dataset, members.shard[rows])]

    def _own(self, dataset: Dataset, codes: np.ndarray) -> np.ndarray:
        """Per shard code, whether this node owns that shard and reads it from the store."""
        owners = self.cluster.owners(dataset.url, dataset.index.shards, codes)
        return (owners == self.cluster.me) & (self.cluster.down_homes(dataset.url, dataset.index.shards, codes,
                                                                      owners) < 0)

    def holds_all(self, dataset: Dataset) -> bool:
        """Whether the cache holds every block of ``dataset`` that this node reads from the
        store: then reading ahead has nothing to do. Kept until the cache's blocks of the
        dataset or the cluster's ownership change; while the cache holds fewer blocks of the
        dataset than this node reads, one comparison."""
        held = self.cache.held(dataset.id)
        ownership = self.cluster.version() if self.cluster is not None else None
        known = self._holds_all.get(dataset.id)
        if known is not None and known[0] == (held.changes, ownership, dataset.version):
            return known[1]
        own = self._own_blocks.get(dataset.id)
        if own is None or own[0] != (ownership, dataset.version):
            blocks = -(-dataset.extents.astype(np.int64) // self.block_size)  # per shard code
            codes = np.arange(len(blocks))
            if self.cluster is not None:
                codes = codes[self._own(dataset, codes)]
            need = blocks[codes]
            own = self._own_blocks[dataset.id] = ((ownership, dataset.version), int(need.sum()),
                                                  [dataset.shard_ids[c] for c in codes.tolist()], need.tolist())
        _, total, shard_ids, need = own
        answer = held.total >= total and all(held.per_shard.get(shard, 0) >= n for shard, n in zip(shard_ids, need))
        self._holds_all[dataset.id] = ((held.changes, ownership, dataset.version), answer)
        return answer

    def held_blocks(self, keys, *, all_or_none: bool = False) -> dict[BlockKey, memoryview]:
        """The blocks among ``keys`` that the RAM tier holds, as views (no copy, no thread), in
        the order of ``keys``; with ``all_or_none``, nothing unless it holds them all."""
        keys = list(keys)
        payloads = self.memory.get_many(keys)
        if all_or_none and None in payloads:
            return {}
        held = {key: memoryview(block) for key, block in zip(keys, payloads) if block is not None}
        if held:
            self.metrics.memory_cache_hits.inc(len(held))
        return held

    def _read_cached(self, ranges: dict[BlockKey, list[tuple[int, int]] | None]) -> dict[BlockKey, list[bytes]]:
        out = {}
        for key, spans in ranges.items():
            parts = self.cache.read(key, spans)
            if parts is not None:  # absent or corrupt: the caller fetches it
                out[key] = parts
        return out

    async def close(self) -> None:
        await self.fetcher.close()
        await self.ranges.close()
        if self.siblings is not None:
            self.siblings.close()


class _Pieces:
    """One read of members: their pieces (``planner.plan_pieces``), the pieces in each block,
    and the bytes of each piece found so far."""

    def __init__(self, dataset: Dataset, members: Members, block_size: int):
        self.plan = plan_pieces(members, block_size)
        ids = dataset.shard_ids
        self.blocks: dict[BlockKey, list[int]] = defaultdict(list)  # block -> its pieces
        for i, (shard, block) in enumerate(zip(self.plan.shard.tolist(), self.plan.block.tolist())):
            self.blocks[BlockKey(dataset.id, ids[shard], block)].append(i)
        self.starts, self.ends = self.plan.start.tolist(), self.plan.end.tolist()
        self.bytes: dict[int, bytes | memoryview | StoreError] = {}

    def take(self, key: BlockKey, block: memoryview) -> None:
        """The pieces in ``key``, sliced from its whole payload."""
        starts, ends = self.starts, self.ends
        for i in self.blocks[key]:
            self.bytes[i] = block[starts[i]:ends[i]]


_ASK_OWNER = StoreError("not in the sibling's cache directory")
"""Marks the pieces, then the members, that a sibling's files did not give: its owner is asked."""
