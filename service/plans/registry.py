"""The plans a service holds, and what they say about blocks: next use, and whether a
missing block is worth fetching whole.

Positions are plan positions (one per sample of the plan read); distances from different
plans are compared in their readers' reads, which assumes the readers move at about the
same speed (ranks of one job do): a plan that holds a ``share`` of its reader's reads (a
stream of a mixture, each dataset its own plan) moves ``share`` positions per read, so
its distances count ``1 / share`` reads a position. Every query is a binary search in
arrays built once per plan, so the eviction policy can rank all the cached blocks on
each eviction.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from shardfeed.service.cache.names import BlockKey
from shardfeed.service.config import ServiceConfig
from shardfeed.service.datasets.dataset import Dataset
from shardfeed.service.datasets.indexfile import narrow
from shardfeed.service.http.errors import ApiError, Overloaded
from shardfeed.service.observe.metrics import Metrics

log = logging.getLogger("shardfeed.plans")

WHOLE_SHARE = 1 / 2
"""A block is fetched whole when a cached copy would serve at least this share of its
bytes. Lower fetches more whole blocks (more bytes, fewer requests: a range read costs a
request per sample or two). At 1/2 a random order through a quarter cache reads almost
every sample alone and the dataset's bytes about once, a locality shuffle mostly whole
blocks; at 1/4 the random order reads more of the dataset again (docs/benchmarks.md)."""

HORIZON_EVERY = 0.1
"""Seconds between recomputations of the cache horizon (cheap, but not per request)."""

FINISHED_TTL = 30.0
"""Seconds a plan is kept once its reader got to its end (other DataLoader workers' last
batches may still come): a reader that registers a plan per pass, and never deletes the
last (the first worker of a plain DataLoader), does not fill ``--max-plans``."""


class Geometry:
    """Where each sample of a dataset lies in blocks, numbered densely over all shards."""

    def __init__(self, dataset: Dataset, block_size: int):
        shard, start, end = dataset.index.sample_extents()
        per_shard = -(-dataset.extents.astype(np.int64) // block_size)
        self.base = np.concatenate([[0], np.cumsum(per_shard)[:-1]]).astype(np.int64)
        self.blocks = int(per_shard.sum())
        # Narrow where the values fit: 12 bytes a sample rather than 24 (docs/benchmarks.md, scale).
        self.first = narrow(self.base[shard] + start // block_size)
        self.span = narrow(np.maximum(end - 1, start) // block_size - start // block_size + 1)
        self.sample_bytes = narrow(end - start)
        self.mean_bytes = max(1.0, float(self.sample_bytes.mean()))
        self.shard_code = {sid: code for code, sid in enumerate(dataset.shard_ids)}

    def gid(self, shards: np.ndarray, blocks: np.ndarray) -> np.ndarray:
        return self.base[np.asarray(shards, dtype=np.int64)] + np.asarray(blocks, dtype=np.int64)

    def blocks_of(self, order: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Per plan position, the blocks its sample touches: ``(gid, position)`` pairs."""
        span = self.span[order]
        position = np.repeat(np.arange(len(order), dtype=np.int64), span)
        rank = np.arange(int(span.sum())) - np.repeat(np.cumsum(span) - span, span)
        return np.repeat(self.first[order], span) + rank, position


def check_order(dataset: Dataset, order: np.ndarray) -> None:
    """``ApiError`` unless every index of ``order`` is a sample of ``dataset``."""
    n = len(dataset.index)
    if len(order) and (order.min() < 0 or order.max() >= n):
        bad = int(order[(order < 0) | (order >= n)][0])
        if bad < 0:
            raise ApiError(400, "invalid_index", f"sample index {bad} is negative")
        raise ApiError(404, "sample_out_of_range", f"sample {bad} is out of range: dataset "
                                                   f"{dataset.name!r} has {n} samples")


@dataclass(eq=False)
class Plan:
    id: str
    dataset: Dataset
    kind: str
    ttl: float
    order: np.ndarray
    complete: bool
    geometry: Geometry
    fields: list[str] | None = None
    """The fields the reader asks for (all by default): what is read ahead."""
    owner: str | None = None
    """The name of the tenant that registered it (``api/tenants.py``; ``full-access`` without tokens)."""
    share: float = 1.0
    """The share of its reader's reads this order holds (``PlanRequest.share``): a position is
    ``1 / share`` reads."""
    position: int = 0
    """The reader's place: the first position of the latest batch it was seen reading."""
    batch: int = 1
    """Length of the latest batch seen; reads this far behind ``position`` still count."""
    deadline: float = 0.0
    ahead_blocks: int = 0
    """Positions up to which whole blocks were read ahead."""
    ahead_ranges: int = 0
    """Positions up to which sample ranges were read ahead."""
    by_sample: np.ndarray = field(init=False, repr=False)
    by_block: np.ndarray = field(init=False, repr=False)
    blocks: np.ndarray = field(init=False, repr=False)
    _chains: tuple[float, np.ndarray] | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self.build()

    def build(self) -> None:
        """Sorted ``sample * L + position`` and ``block * L + position`` keys, for searches."""
        length = self.length
        positions = np.arange(length, dtype=np.int64)
        self.by_sample = np.sort(self.order * length + positions)
        gids, where = self.geometry.blocks_of(self.order)
        self.by_block = np.sort(gids * length + where)
        self.blocks = np.unique(gids)

    @property
    def length(self) -> int:
        return max(1, len(self.order))

    @property
    def finished(self) -> bool:
        """Whether its reader got to its end."""
        return self.complete and self.position + self.batch >= len(self.order)

    def touch(self) -> None:
        self.deadline = time.monotonic() + (min(self.ttl, FINISHED_TTL) if self.finished else self.ttl)

    def next_use(self, gids: np.ndarray, start: int) -> np.ndarray:
        """Per block, its first position at or after ``start`` (``inf`` if none)."""
        length = self.length
        at = np.searchsorted(self.by_block, gids * length + start)
        keys = self.by_block[np.minimum(at, len(self.by_block) - 1)] if len(self.by_block) else gids * 0
        hit = (at < len(self.by_block)) & (keys // length == gids)
        return np.where(hit, keys % length, np.inf)

    def chain(self, gids: np.ndarray, start: int, horizon: float) -> np.ndarray:
        """Per block, its next use from ``start`` on and the uses after it that come each
        within ``horizon`` positions of the previous one: the reads a copy cached for that
        next use serves before it would be evicted."""
        length = self.length
        if not len(self.by_block):
            return np.zeros(len(gids), dtype=np.int64)
        at = np.searchsorted(self.by_block, gids * length + start)
        keys = self.by_block[np.minimum(at, len(self.by_block) - 1)]
        hit = (at < len(self.by_block)) & (keys // length == gids)
        ends = self._chain_ends(horizon)
        return np.where(hit, ends[np.minimum(at, len(ends) - 1)] - at + 1, 0)

    def _chain_ends(self, horizon: float) -> np.ndarray:
        """Per entry of ``by_block``, the last entry of its run of uses of one block whose
        gaps are at most ``horizon`` (kept while the horizon moves less than 10%)."""
        if self._chains is not None and abs(self._chains[0] - horizon) <= 0.1 * max(horizon, 1.0):
            return self._chains[1]
        length = self.length
        gids, positions = self.by_block // length, self.by_block % length
        breaks = np.ones(len(gids), dtype=bool)  # the last entry, and where the next use is too late
        breaks[:-1] = (gids[1:] != gids[:-1]) | (positions[1:] - positions[:-1] > horizon)
        ends = np.where(breaks, np.arange(len(gids)), len(gids))
        ends = np.minimum.accumulate(ends[::-1])[::-1]
        self._chains = (horizon, ends)
        return ends

    def describe(self) -> dict:
        return {"id": self.id, "dataset": self.dataset.name, "owner": self.owner, "kind": self.kind,
                "samples": len(self.order), "share": self.share,
                "complete": self.complete, "position": self.position, "ttl": self.ttl,
                "expires_in": round(max(0.0, self.deadline - time.monotonic()), 3)}


class Plans:
    """Every plan held, bounded; the cache's eviction policy and the coalescer's fetch policy."""

    def __init__(self, config: ServiceConfig, metrics: Metrics, parts: Callable[[], int] = lambda: 1):
        self.config = config
        self.parts = parts
        """Parts a batch may come in now, one per node of the cluster (routed clients send each
        owner its own; the replica set may change): a part of ``n`` samples spans up to
        ``n * parts()`` plan positions."""
        self.metrics = metrics
        self.block_size = config.block_size
        self._plans: dict[str, Plan] = {}
        self._geometry: dict[tuple[str, str], Geometry] = {}  # by dataset id and version
        self._lock = threading.Lock()  # geometry is built in threads
        self.horizon = math.inf
        """Reads ahead (of each plan's reader) within which the cache can keep every block the
        plans read; ``horizon * plan.share`` positions of a plan."""
        self._horizon_at = 0.0

    # -- the registry --------------------------------------------------------------------
    def geometry(self, dataset: Dataset) -> Geometry:
        """The dataset's block geometry, built on first use (blocking: call in a thread)."""
        with self._lock:
            geometry = self._geometry.get((dataset.id, dataset.version))
            if geometry is None:
                geometry = self._geometry[dataset.id, dataset.version] = Geometry(dataset, self.block_size)
        return geometry

    def check_room(self, samples: int, *, new: bool = True) -> None:
        """413 when a plan of ``samples`` positions is too long; 429 when no ``new`` plan fits."""
        self.expire()
        if samples > self.config.max_plan_samples:
            raise ApiError(413, "plan_too_large", f"a plan of {samples} positions; the limit is "
                                                  f"{self.config.max_plan_samples}")
        if new and len(self._plans) >= self.config.max_plans:
            raise Overloaded(f"{len(self._plans)} plans held, the limit (--max-plans); delete finished "
                             "plans or retry when one expires")

    def build(self, dataset: Dataset, kind: str, order: np.ndarray, ttl: float | None, complete: bool,
              fields: list[str] | None, plan_id: str | None = None, owner: str | None = None,
              share: float = 1.0) -> Plan:
        """A new plan, not yet held (blocking: call in a thread, then ``insert``); ``plan_id``:
        the id another node gave it (a relayed copy), else a new one."""
        ttl = min(ttl or self.config.plan_ttl, self.config.plan_ttl)
        plan = Plan(plan_id or secrets.token_hex(8), dataset, kind, ttl, order, complete, self.geometry(dataset),
                    fields, owner, share)
        plan.touch()
        return plan

    def insert(self, plan: Plan) -> None:
        """Hold ``plan`` (429 if the limit was reached meanwhile)."""
        self.check_room(len(plan.order))
        self._plans[plan.id] = plan
        self._horizon_at = 0.0
        self.metrics.plans.set(len(self._plans))

    def replace(self, plan: Plan) -> None:
        """Hold ``plan`` in place of the plan with its id (a longer order of the same reader)."""
        self._plans[plan.id] = plan
        self._horizon_at = 0.0
        self.metrics.plans.set(len(self._plans))

    def rebind(self, old: Dataset, new: Dataset) -> None:
        """Move the plans of ``old`` to ``new``, the version that replaced it (blocking: the
        geometry is built here); a plan whose order no longer fits the dataset is dropped."""
        for plan in self.live(old):
            if len(plan.order) and int(plan.order.max()) >= len(new.index):
                log.warning("plan %s dropped: dataset %s now has %d samples", plan.id, new.name, len(new.index))
                self.remove(plan)
            else:
                self.replace(dataclasses.replace(plan, dataset=new, geometry=self.geometry(new)))
        with self._lock:
            self._geometry.pop((old.id, old.version), None)

    def get(self, dataset: Dataset, plan_id: str) -> Plan:
        self.expire()
        plan = self._plans.get(plan_id)
        if plan is None or plan.dataset is not dataset:
            raise ApiError(404, "unknown_plan", f"no plan {plan_id[:40]!r} for dataset {dataset.name!r} "
                                                "(expired or deleted: register it again)")
        return plan

    def remove(self, plan: Plan) -> None:
        self._plans.pop(plan.id, None)
        self._horizon_at = 0.0
        self.metrics.plans.set(len(self._plans))

    def expire(self) -> None:
        now = time.monotonic()
        for plan in [p for p in self._plans.values() if p.deadline < now]:
            self.remove(plan)

    def live(self, dataset: Dataset | None = None) -> list[Plan]:
        return [p for p in list(self._plans.values()) if dataset is None or p.dataset is dataset]

    # -- what readers tell us ------------------------------------------------------------------
    def observe(self, dataset: Dataset, indices: np.ndarray) -> None:
        """Move the plan that ``indices`` (a batch being served) belongs to, if any, to it.

        A batch belongs to the plan where most of its samples sit next to each other (a
        batch is a run of consecutive plan positions) not too far from where the plan's
        reader was last seen; in another reader's random order they are scattered. With
        ``parts``, ``indices`` may be one node's part of a batch: its samples lie among
        the batch's positions, up to ``parts`` times as many.
        """
        n = len(indices)
        if not n:
            return
        span = n * self.parts()  # the batch this may be one owner's part of
        best, best_score, best_start, best_end = None, n / 2, 0, 0
        for plan in reversed(self.live(dataset)):  # the newest wins a tie (the same order registered again)
            length = plan.length
            reach = 64 * span + 1024  # readers' workers run ahead of each other
            at = np.searchsorted(plan.by_sample, indices * length + max(0, plan.position - reach))
            keys = plan.by_sample[np.minimum(at, len(plan.by_sample) - 1)]
            where = np.where((at < len(plan.by_sample)) & (keys // length == indices), keys % length, -10 * span)
            middle = int(np.median(where))
            close = np.abs(where - middle) <= span
            if close.sum() > best_score and middle < plan.position + reach:
                best, best_score = plan, int(close.sum())
                best_start, best_end = int(where[close].min()), int(where[close].max())
        if best is not None:
            best.position = max(best.position, best_start)
            best.batch = max(n, best_end - best_start + 1)
            best.touch()

    # -- what the cache and the coalescer ask -------------------------------------------------------
    def horizon_due(self) -> bool:
        """Whether the horizon is ``HORIZON_EVERY`` seconds old: asked before ``refresh_horizon``
        (which runs in a thread), so a pass with nothing to recompute costs no thread hop."""
        return time.monotonic() - self._horizon_at >= HORIZON_EVERY

    def refresh_horizon(self, capacity: int) -> None:
        """How far ahead a cache of ``capacity`` blocks reaches: the next-use distance of the
        block that just fits."""
        self._horizon_at = time.monotonic()
        distances = [np.zeros(0)]
        for dataset_plans in self._by_dataset().values():
            best = np.full(dataset_plans[0].geometry.blocks, np.inf)
            for plan in dataset_plans:
                # A batch is read at once: its blocks are all needed now.
                until = np.maximum(0, plan.next_use(plan.blocks, plan.position) - plan.position - plan.batch)
                np.minimum.at(best, plan.blocks, until / plan.share)
            distances.append(best[best < np.inf])
        distances = np.concatenate(distances)
        if len(distances) <= capacity:
            self.horizon = math.inf
        else:
            self.horizon = float(np.partition(distances, capacity)[capacity])

    def whole_blocks(self, dataset: Dataset, shards: np.ndarray, blocks: np.ndarray) -> np.ndarray:
        """Per missing block, whether to fetch and cache it whole (else: its samples' ranges).

        Whole unless plans read the block and the samples a cached copy would serve
        before it is evicted (the chain of its uses each within the horizon of the
        previous one) add up to less than ``WHOLE_SHARE`` of a block: then the block would
        go before paying for itself.
        """
        plans = self.live(dataset)
        whole = np.ones(len(blocks), dtype=bool)
        if not plans or self.horizon == math.inf:
            return whole
        geometry = plans[0].geometry
        gids = geometry.gid(shards, blocks)
        covered = np.zeros(len(blocks), dtype=bool)
        uses = np.zeros(len(blocks), dtype=np.int64)
        for plan in plans:
            start = max(0, plan.position - plan.batch)  # reads of that batch may be in flight
            covered |= plan.next_use(gids, start) < math.inf
            uses += plan.chain(gids, start, self.horizon * plan.share + plan.batch)
        # A shard's last block is short: fetching it whole costs only what it holds.
        size = np.minimum(self.block_size, plan.dataset.extents[shards] - blocks * self.block_size)
        return ~covered | (uses * geometry.mean_bytes >= size * WHOLE_SHARE)

    def victim_order(self, keys: list[BlockKey]) -> list[BlockKey]:
        """Cached blocks (least recently used first) in the order to evict them: blocks no
        plan reads again (least recently used first), then the farthest next use first. The
        cache asks about a few blocks drawn at random, never all (``disk.py``)."""
        groups = self._by_dataset()
        if not groups:
            return keys
        never: list[BlockKey] = []
        planned: dict[str, tuple[list[BlockKey], list[int]]] = {}
        for key in keys:
            plans = groups.get(key.dataset)
            code = plans[0].geometry.shard_code.get(key.shard) if plans else None
            if code is None:
                never.append(key)
                continue
            entry = planned.setdefault(key.dataset, ([], []))
            entry[0].append(key)
            entry[1].append(int(plans[0].geometry.base[code]) + key.block)
        ranked: list[tuple[float, int, BlockKey]] = []
        for dataset_id, (dataset_keys, gids) in planned.items():
            gids_array = np.array(gids, dtype=np.int64)
            until = np.full(len(gids), np.inf)
            for plan in groups[dataset_id]:
                until = np.minimum(until, np.maximum(0, plan.next_use(gids_array, plan.position)
                                                     - plan.position - plan.batch) / plan.share)
            for i, (key, d) in enumerate(zip(dataset_keys, until.tolist())):
                if d == math.inf:
                    never.append(key)
                else:
                    ranked.append((-d, i, key))
        ranked.sort()
        return never + [key for _, _, key in ranked]

    def _by_dataset(self) -> dict[str, list[Plan]]:
        groups: dict[str, list[Plan]] = {}
        for plan in self.live():
            groups.setdefault(plan.dataset.id, []).append(plan)
        return groups
