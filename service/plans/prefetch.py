"""Reading ahead of every plan's reader, so a cold read waits on the cache, not the store.

Each tick (and whenever a batch moves a plan) the prefetcher extends two frontiers per
plan, both at most ``plan_ahead`` payload bytes past the reader:

- sample ranges (blocks the fetch policy would not fetch whole) into memory, within the
  range reader's ``plan_memory``;
- whole blocks into the cache, no farther than half the cache's horizon, so what is read
  ahead is not evicted before it is read.

Reading ahead goes no faster than the store answers: a pass asks for no more once the reads
ahead still outstanding (waiting for a store slot or in flight) reach the number of store
slots, which keeps the store busy; it goes on at the next pass. Asked for all at once, the
budget's thousands of reads would stand in line for the slots and age there, and a read the
reader itself comes to need (a block no pass reads ahead) would wait at their back or, still
waiting, be promoted among many.

With replicas, only the shards this replica owns are read ahead. Once the cache holds
every block this node reads of a plan's dataset (``Coalescer.holds_all``), a pass over
that plan does nothing until a block leaves the cache or ownership moves.
"""

from __future__ import annotations

import asyncio
import logging
import math

import numpy as np

from shardfeed.service.config import ServiceConfig
from shardfeed.service.plans.registry import Plan, Plans
from shardfeed.service.read.coalescer import Coalescer
from shardfeed.service.read.planner import plan_pieces, take

log = logging.getLogger("shardfeed.plans")

TICK = 0.05
"""Seconds between passes when no batch arrives."""

STEP = 256
"""Plan positions whose blocks are asked for at once (at least a batch)."""


class Prefetcher:
    def __init__(self, plans: Plans, coalescer: Coalescer, config: ServiceConfig):
        self.plans = plans
        self.coalescer = coalescer
        self.config = config
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    def wake(self) -> None:
        self._wake.set()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self._wake.wait(), TICK)
            except asyncio.TimeoutError:
                pass
            self._wake.clear()
            try:
                await self.step()
            except Exception:  # a bug here must not stop reading ahead for good
                log.exception("read-ahead pass failed")

    async def step(self) -> None:
        self.plans.expire()
        if not self.plans.live():
            return
        if self.plans.horizon_due():
            await asyncio.to_thread(self.plans.refresh_horizon, self.coalescer.cache.room_blocks())
        for plan in self.plans.live():
            self._ahead(plan)

    def _ahead(self, plan: Plan) -> None:
        # A cached block is read from the cache, never as ranges: a dataset held whole
        # leaves nothing to read ahead, and looking every position up again on each warm
        # epoch cost about a third of the service's CPU per warm sample.
        if self.coalescer.holds_all(plan.dataset):
            return
        geometry = plan.geometry
        # A mixture's stream reads ahead its share of the budget: a reader's streams together, all of it.
        reach = plan.position + max(plan.batch, int(self.config.plan_ahead * plan.share / geometry.mean_bytes))
        stop = min(len(plan.order), reach)
        start = max(plan.ahead_ranges, plan.position)
        stop = self._within_memory(plan, start, stop) if stop > start else start
        # In plan order, a few batches at a time: store reads queue first come, first
        # served, so what is read first must be asked for first.
        step = max(plan.batch, STEP)
        for first in range(start, stop, step):
            if self._store_busy():
                return
            last = min(stop, first + step)
            pieces = self._pieces(plan, first, last)
            self._ranges_ahead(plan, pieces, self.coalescer.whole_blocks_wanted(plan.dataset, pieces))
            plan.ahead_ranges = last
        # Whole blocks only within half the horizon (in reads: ``share`` positions each), where
        # the decision is the reader's: ranges of the blocks now judged not worth it, if the
        # first pass left them.
        horizon = self.plans.horizon
        stop = min(len(plan.order), reach if horizon == math.inf
                   else plan.position + int(horizon * plan.share / 2) + plan.batch)
        start = max(plan.ahead_blocks, plan.position)
        for first in range(start, stop, step):
            if self._store_busy():
                return
            last = min(stop, first + step)
            pieces = self._pieces(plan, first, last)
            whole = self.coalescer.whole_blocks_wanted(plan.dataset, pieces)
            self.coalescer.fetch_ahead(plan.dataset, whole)
            if self._within_memory(plan, first, last) == last:
                self._ranges_ahead(plan, pieces, whole)
            plan.ahead_blocks = last

    def _store_busy(self) -> bool:
        """Whether the reads ahead still outstanding keep every store slot busy already."""
        slots = self.coalescer.fetcher.slots
        return slots.outstanding_ahead >= slots.slots

    def _within_memory(self, plan: Plan, start: int, stop: int) -> int:
        """How far from ``start`` the samples' bytes fit in the memory left for ranges."""
        sizes = np.cumsum(plan.geometry.sample_bytes[plan.order[start:stop]])
        return start + int(np.searchsorted(sizes, self.coalescer.ranges.room(), side="right"))

    def _ranges_ahead(self, plan: Plan, pieces, whole: set) -> None:
        """Read ahead the ranges of the pieces outside the ``whole`` blocks."""
        rows = [i for i, pair in enumerate(zip(pieces.shard.tolist(), pieces.block.tolist())) if pair not in whole]
        if rows:
            self.coalescer.ranges.read_ahead(plan.dataset, pieces.spans(rows, self.config.block_size))

    def _pieces(self, plan: Plan, start: int, stop: int):
        """The block pieces of plan positions ``[start, stop)`` this replica reads."""
        members = plan.dataset.index.lookup(plan.order[start:stop], plan.fields)
        if self.coalescer.cluster is not None:
            members = take(members, self.coalescer.own_rows(plan.dataset, members))
        return plan_pieces(members, self.config.block_size)
