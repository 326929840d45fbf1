"""When the service last had a data request: what ``--idle-exit`` waits on.

One slot per process serving (each worker of ``--workers N`` writes its own), in memory
the supervisor shares with the workers it forks, so the process that decides to exit
(the supervisor, or a lone service) sees every worker's requests without asking them.
Times are ``CLOCK_MONOTONIC``, one clock for every process of the machine.
"""

from __future__ import annotations

import multiprocessing
import time

QUIET_PATHS = frozenset({"/healthz", "/metrics", "/v1/stats", "/v1/cluster", "/", "/ui"})
"""Requests that do not keep a service alive: health checks (siblings and replicas send them
every second), scrapes, and the status page watching it."""


class Activity:
    def __init__(self, slots: int = 1):
        self._last = multiprocessing.RawArray("d", slots)  # shared with the processes forked later
        for slot in range(slots):
            self._last[slot] = time.monotonic()

    def touch(self, slot: int, path: str) -> None:
        """A request for ``path`` arrived at the process of ``slot``."""
        if path not in QUIET_PATHS:
            self._last[slot] = time.monotonic()

    def idle(self) -> float:
        """Seconds since the last data request of any slot."""
        return time.monotonic() - max(self._last)
