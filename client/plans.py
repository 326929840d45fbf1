"""Keeping a plan registered: the service reads ahead along it and evicts by next use.

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

from .base import plain_plan
from .errors import ShardfeedError, ShardfeedHTTPError
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
        if self.id is None or time.monotonic() - self._checked < CHECK_EVERY:
            return
        self._checked = time.monotonic()
        try:
            self.client.plan(self.dataset, self.id)
        except ShardfeedHTTPError as err:
            if err.status == 404:
                self.id = None
                self.register(plan())
        except ShardfeedError:
            pass  # the service is unreachable: the next batch will say so

    def drop(self) -> None:
        if self.id is not None:
            try:
                self.client.delete_plan(self.dataset, self.id)
            except ShardfeedError:
                pass  # gone already; it expires anyway
            self.id = self.held = None


def _order(plan: dict[str, Any]) -> dict[str, Any]:
    """What names a plan's order: everything but how far its reader got (indices as plain ints,
    so that a numpy array compares as its values)."""
    return {key: value for key, value in plain_plan(plan).items() if key != "consumed"}
