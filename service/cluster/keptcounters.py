"""A worker's counters kept in files that outlive it, so that the host's sums never go down.

With ``serve --workers N``, ``/metrics`` and ``/v1/stats`` on the public port add up every
worker's counters (``hostmetrics.py``, ``hoststats.py``). A counter that a dead worker took
with it, or that its successor started again from 0, would make the host's sum go down,
which Prometheus reads as a counter reset (``rate()`` then spikes). So each worker keeps
its counters and histograms in memory-mapped files (prometheus_client's multiprocess
values), in a directory per worker slot that the supervisor makes in its run directory:

- every increment is a store into a shared mapping of the file, so the file holds each
  value as of the instant the worker died, SIGKILL included: nothing is lost between
  scrapes, and the host's totals stay exact across a restart;
- the worker's successor opens the same files and counts on from there (its own port's
  ``/metrics`` continues too, rather than starting again from 0);
- a sibling that does not answer the worker summing the host (down, restarting, or too
  slow) is read from its files instead: its counters stay in the sums whichever worker
  answers the scrape, the successor of one that just died included.

Why files, and these: the scrape of the shared port lands on any worker, and that worker
may be the one that died, so no worker's memory can hold the host's past; the supervisor
could (it outlives them) only by polling the workers, and would lose what they counted
since its last poll. The run directory goes with the supervisor: a new ``serve`` starts
every counter from 0, as any restarted service does.

Gauges (requests in flight, cache bytes) stay in each process's memory: they describe the
live processes, so a dead worker's leave the sums and its successor's start afresh.
"""

from __future__ import annotations

import logging
import os
import struct
from collections.abc import Iterable
from pathlib import Path

from prometheus_client import values
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.metrics_core import Metric
from prometheus_client.multiprocess import MultiProcessCollector

log = logging.getLogger("shardfeed.keptcounters")

KEPT_TYPES = ("counter", "histogram")
"""Metric types whose values are kept in the files: the ones that only grow."""


def keep_counters(directory: Path) -> None:
    """Keep this process's counters and histograms in ``directory`` (made if missing), going
    on from the values found there. Called in a worker before it makes its metrics: it sets
    how every metric of the process stores its values from then on."""
    directory.mkdir(parents=True, exist_ok=True)
    # prometheus_client reads the directory from the environment each time it makes a value.
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(directory)
    # One name for every run of the worker, not its pid: a successor opens its predecessor's files.
    kept = values.MultiProcessValue(process_identifier=lambda: "worker")

    def value_class(typ: str, *args, **kwargs):
        return (kept if typ in KEPT_TYPES else values.MutexValue)(typ, *args, **kwargs)

    values.ValueClass = value_class


def restore_series(metrics: object, directory: Path) -> None:
    """Make every labeled series kept in ``directory`` now, on the metrics that are attributes
    of ``metrics``. A labeled series is made, and its kept value read, only when first used:
    until then a successor would not show it, and the host's sum of it would drop."""
    kept = {family.name: family for family in KeptCounters([directory]).collect()}
    for metric in vars(metrics).values():
        if not isinstance(metric, MetricWrapperBase):
            continue
        for family in metric.describe():
            for sample in kept[family.name].samples if family.name in kept else ():
                labels = {name: value for name, value in sample.labels.items() if name != "le"}
                if labels:
                    metric.labels(**labels)


class KeptCounters:
    """The counters and histograms kept in ``directories`` (one per worker), added up, as a
    collector (``collect()``, as a registry offers it); a directory without files adds nothing."""

    def __init__(self, directories: Iterable[Path]):
        self.directories = list(directories)

    def collect(self) -> list[Metric]:
        files = [str(path) for directory in self.directories for path in sorted(directory.glob("*.db"))]
        try:
            return list(MultiProcessCollector.merge(files, accumulate=True))
        except (OSError, ValueError, TypeError, RuntimeError, struct.error) as err:  # a damaged file: left out
            log.warning("kept counters in %s left out, unreadable: %s", ", ".join(map(str, self.directories)), err)
            return []
