"""Keeping a plan registered: the service reads ahead along it and evicts by next use.

A reader of one dataset holds a :class:`DatasetPlan`, a reader of a mixture :class:`StreamPlans`
(one plan per stream); both answer ``register``, ``ensure`` and ``refresh`` for the
reader's sampler.

A plan is only advice to the service: if registering fails (an older service, too many
plans) the data is read all the same, just without read-ahead, so failures here are
logged, never raised. Plans expire on the service after a while unused or when it
restarts; ``refresh`` registers the rest of the epoch again when that happened.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from .base import plain_plan
from .errors import ShardfeedError, ShardfeedHTTPError
from .mixing import MixtureSampler, locate
from .sampling import EpochSampler
from .sync import Client

log = logging.getLogger("shardfeed.client.plans")

CHECK_EVERY = 30.0
"""Seconds between checks that the service still holds the plan."""


class PlanHandle:
    """The plan one reader (a rank) holds on the service for one dataset."""

    def __init__(self, client: Client, dataset: str, fields: list[str] | None):
        self.client = client
        self.dataset = dataset
        self.fields = fields
        self.id: str | None = None
        self.held: dict[str, Any] | None = None
        """The order ``id`` stands for: the last plan registered, how far its reader got aside."""
        self._checked = 0.0

    def register(self, plan: dict[str, Any]) -> None:
        """Announce ``plan`` (a body of ``POST /v1/datasets/{name}/plans``; ``indices`` may be a
        numpy array, and a long plan goes in chunks: ``Client.register_plan``), replacing ours."""
        self.drop()
        try:
            self.id = self.client.register_plan(self.dataset, {**plan, "fields": self.fields})["id"]
            self.held = _order(plan)
        except ShardfeedError as err:
            log.warning("plan not registered, reading without read-ahead: %s", err)
        self._checked = time.monotonic()

    def ensure(self, plan: dict[str, Any]) -> None:
        """``register(plan)`` unless its order is the one held (by this handle, or by the copy
        it was made from: a DataLoader worker's copy of a dataset that announced in the
        training process)."""
        if self.held != _order(plan):
            self.register(plan)

    def refresh(self, plan: Callable[[], dict[str, Any]]) -> None:
        """Every ``CHECK_EVERY`` seconds: register ``plan()`` again if the service lost ours."""
        if self.lost():
            self.register(plan())

    def lost(self) -> bool:
        """Whether the service lost our plan (it expired, the service restarted); asked of the
        service every ``CHECK_EVERY`` seconds at most, ``False`` in between."""
        if self.id is None or time.monotonic() - self._checked < CHECK_EVERY:
            return False
        self._checked = time.monotonic()
        try:
            self.client.plan(self.dataset, self.id)
        except ShardfeedHTTPError as err:
            if err.status == 404:
                self.id = None
                return True
        except ShardfeedError:
            pass  # the service is unreachable: the next batch will say so
        return False

    def drop(self) -> None:
        if self.id is not None:
            try:
                self.client.delete_plan(self.dataset, self.id)
            except ShardfeedError:
                pass  # gone already; it expires anyway
            self.id = self.held = None


class DatasetPlan:
    """The plan of one reader (a rank) of one dataset: its sampler's parameters (kind ``sampler``),
    from which the service computes the order itself."""

    def __init__(self, client: Client, dataset: str, fields: list[str] | None):
        self.handle = PlanHandle(client, dataset, fields)

    @property
    def id(self) -> str | None:
        """The plan's id on the service (``None``: none held)."""
        return self.handle.id

    def register(self, sampler: EpochSampler) -> None:
        self.handle.register(sampler.plan())

    def ensure(self, sampler: EpochSampler) -> None:
        self.handle.ensure(sampler.plan())

    def refresh(self, sampler: EpochSampler) -> None:
        self.handle.refresh(sampler.plan)


class StreamPlans:
    """The plans of one reader (a rank) of a mixture: one per stream, of kind ``indices``, holding the
    stream's samples in the order the reader reads them, and the stream's ``share`` of the reads, so
    the service compares its distances with other plans' in the reader's reads (:mod:`.mixing`)."""

    def __init__(self, client: Client, datasets: list[str], fields: list[list[str] | None],
                 pools: list[np.ndarray | None]):
        self.handles = [PlanHandle(client, dataset, f) for dataset, f in zip(datasets, fields)]
        self.pools = pools
        self.held: tuple | None = None
        """The order the plans stand for (``MixtureSampler.revision`` and the reader's place in the job)."""

    def register(self, sampler: MixtureSampler) -> None:
        """Announce the rest of this reader's epoch, stream by stream."""
        order = sampler.rank_order()
        streams, positions = locate(sampler.offsets, order)
        shares = sampler.shares()
        for s, handle in enumerate(self.handles):
            mine = positions[streams == s]
            if not len(mine):
                handle.drop()
                continue
            indices = mine if self.pools[s] is None else self.pools[s][mine]
            handle.register({"kind": "indices", "indices": indices, "share": max(1e-6, float(shares[s]))})
        self.held = _reader(sampler)

    def ensure(self, sampler: MixtureSampler) -> None:
        """``register`` unless the plans held stand for this order (see ``PlanHandle.ensure``)."""
        if self.held != _reader(sampler):
            self.register(sampler)

    def refresh(self, sampler: MixtureSampler) -> None:
        """Every ``CHECK_EVERY`` seconds: announce the rest of the epoch again if the service lost
        a stream's plan."""
        if any(handle.lost() for handle in self.handles):
            self.register(sampler)


def _reader(sampler: MixtureSampler) -> tuple:
    return sampler.revision, sampler.rank, sampler.world_size, sampler.batch_size


def _order(plan: dict[str, Any]) -> dict[str, Any]:
    """What names a plan's order: everything but how far its reader got (indices as plain ints,
    so that a numpy array compares as its values)."""
    return {key: value for key, value in plain_plan(plan).items() if key != "consumed"}
