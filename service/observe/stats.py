"""Recent history of the metrics, for the status page: rates per second and latency percentiles.

``/metrics`` says how much since the process started; a person watching a training job
wants how much per second now. ``StatsRecorder`` reads the metrics registry through
its public ``collect()`` once per ``interval`` (a background task), and keeps the last
``history`` readings in a bounded ring (five minutes at one per second). From it come:

- rates: the difference of a counter between two consecutive readings divided by the
  measured time between them (never an assumed second);
- latency percentiles over the last ``window`` seconds, estimated from the histogram
  buckets as Prometheus's ``histogram_quantile`` does (linear inside the bucket that holds
  the quantile; a quantile in the open top bucket is reported as the highest finite
  bound), and ``None`` when nothing was observed in the window.

Everything is as of the latest reading, at most ``interval`` old; reading the registry
costs about a hundred microseconds, once a second, whoever is watching.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import math
import time
from collections import deque
from dataclasses import dataclass

from prometheus_client import CollectorRegistry

log = logging.getLogger("shardfeed.stats")

RATES = {
    "samples": "shardfeed_samples_served_total",
    "bytes": "shardfeed_bytes_served_total",
    "store_requests": "shardfeed_store_requests_total",
    "store_bytes": "shardfeed_store_bytes_total",
    "store_errors": "shardfeed_store_errors_total",
    "cache_hits": "shardfeed_cache_hits_total",
    "memory_hits": "shardfeed_memory_cache_hits_total",
    "sibling_hits": 'shardfeed_sibling_blocks_total{result="read"}',
    "replica_hits": "shardfeed_replica_blocks_total",
    "cache_misses": "shardfeed_cache_misses_total",
    "cache_evictions": "shardfeed_cache_evictions_total",
    "rejected": "shardfeed_rejected_total",
}
"""Series of per-second rates: series name -> counter sample (summed over its labels, or of
the labels given)."""

STREAMS = {"samples": "shardfeed_stream_samples_served_total", "bytes": "shardfeed_stream_bytes_served_total"}
"""Counters labelled by ``stream`` (the name a batch request gave): per stream, its totals and rates."""

TRANSFORMS = ("shardfeed_transform_samples_total", "shardfeed_transform_seconds_total",
              "shardfeed_transform_prepared_total", "shardfeed_transform_failures_total")
"""The counters of served transforms, by transform (the status page's table of them)."""
_LABELLED = frozenset({*(sample.partition("{")[0] for sample in RATES.values() if "{" in sample), *STREAMS.values(),
                       *TRANSFORMS})
"""Counters whose samples ``read_registry`` also keeps label by label (those ``RATES`` name so,
the ``STREAMS`` and the ``TRANSFORMS``)."""

HIT_TIERS = {"ram": "memory_hits", "disk": "cache_hits", "sibling": "sibling_hits", "replica": "replica_hits"}
"""Where a block a read needed came from without a store read of this node's, by tier: the
RAM tier, the block cache on disk, a sibling worker's cache directory, a peer replica that
owns its shard (the store's reads are ``cache_misses``). The blocks a replica served another
node are its own hits or store reads too: summed over the cluster, a block read through a
peer counts twice, once on each side; each node's ratio counts it once."""

LEVELS = {
    "cache_bytes": "shardfeed_cache_bytes",
    "inflight_requests": "shardfeed_inflight_requests",
    "inflight_store": "shardfeed_inflight_store_requests",
}
"""Series of gauge readings: series name -> gauge sample."""

LATENCIES = {"batch": "shardfeed_batch_seconds", "sample": "shardfeed_sample_seconds"}
"""Histograms whose recent percentiles are reported."""

QUANTILES = (0.5, 0.95, 0.99)

COLUMNS = ("t", *RATES, *LEVELS)
"""The fields of a point of the series: its time (seconds since the epoch), then the rates and levels."""


@dataclass(frozen=True)
class Reading:
    """One look at the registry: counters and gauges summed over labels, and histogram buckets."""

    time: float  # seconds since the epoch, for the page's time axis
    monotonic: float  # for the time between readings
    values: dict[str, float]
    buckets: dict[str, tuple[float, ...]]  # cumulative counts, in the order of ``bounds``


def read_registry(registry: CollectorRegistry) -> tuple[dict[str, float], dict[str, tuple[float, ...]],
                                                         dict[str, tuple[float, ...]]]:
    """``(values, buckets, bounds)``: every sample summed over labels, and the samples of
    ``_LABELLED`` also under ``name{label="value",...}``; each histogram's cumulative bucket
    counts and their upper bounds (``inf`` last)."""
    values: dict[str, float] = {}
    buckets: dict[str, list[float]] = {}
    bounds: dict[str, list[float]] = {}
    for family in registry.collect():
        for sample in family.samples:
            if sample.name.endswith("_bucket"):
                buckets.setdefault(family.name, []).append(sample.value)
                bounds.setdefault(family.name, []).append(float(sample.labels["le"]))
            else:
                values[sample.name] = values.get(sample.name, 0.0) + sample.value
                if sample.name in _LABELLED:
                    labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
                    labelled = f"{sample.name}{{{labels}}}"
                    values[labelled] = values.get(labelled, 0.0) + sample.value
    return values, {k: tuple(v) for k, v in buckets.items()}, {k: tuple(v) for k, v in bounds.items()}


def per_stream(values: dict[str, float]) -> dict[str, dict[str, float]]:
    """The ``STREAMS`` counters in ``values`` (a reading's, or their growth), by stream:
    ``{stream: {"samples": n, "bytes": n}}``."""
    out: dict[str, dict[str, float]] = {}
    for what, counter in STREAMS.items():
        prefix = f'{counter}{{stream="'  # stream names need no escaping: none holds a quote or a backslash
        for key, value in values.items():
            if key.startswith(prefix):
                out.setdefault(key[len(prefix):-2], dict.fromkeys(STREAMS, 0.0))[what] = value
    return out


def quantile(q: float, bounds: tuple[float, ...], counts: tuple[float, ...]) -> float | None:
    """The ``q`` quantile of observations given as cumulative bucket ``counts`` under upper
    ``bounds`` (the last ``inf``), interpolated as ``histogram_quantile``; None if empty."""
    total = counts[-1] if counts else 0
    if total <= 0:
        return None
    rank = q * total
    lower, below = 0.0, 0.0
    for bound, count in zip(bounds, counts):
        if count >= rank:
            if math.isinf(bound):
                return lower  # the open top bucket: the highest finite bound is all that is known
            return lower + (bound - lower) * (rank - below) / (count - below) if count > below else bound
        lower, below = bound, count
    return lower


def latency_summary(grown: tuple[dict[str, tuple[float, ...]], float] | None,
                    bounds: dict[str, tuple[float, ...]]) -> dict[str, dict]:
    """Observations and P50/P95/P99 per histogram of ``LATENCIES`` from the growth of its
    buckets over a window (``StatsRecorder.window_buckets``; None: no window yet)."""
    out = {}
    for name, family in LATENCIES.items():
        counts = grown[0].get(family, ()) if grown is not None else ()
        out[name] = {"count": int(counts[-1]) if counts else None,
                     **{f"p{q * 100:g}": quantile(q, bounds.get(family, ()), counts) for q in QUANTILES}}
    out["window_s"] = None if grown is None else round(grown[1], 3)
    return out


class StatsRecorder:
    """Reads ``registry`` every ``interval`` seconds; keeps ``history`` readings.

    Args:
        window: seconds of recent history the latency percentiles cover.
    """

    def __init__(self, registry: CollectorRegistry, *, interval: float = 1.0, history: int = 300,
                 window: float = 60.0):
        self.registry = registry
        self.interval = interval
        self.window = window
        self.readings: deque[Reading] = deque(maxlen=history + 1)  # one more: rates need a predecessor
        self.points: deque[tuple[float, str]] = deque(maxlen=history)  # (time, the point as JSON)
        self.bounds: dict[str, tuple[float, ...]] = {}
        self.started = time.time()
        self._task: asyncio.Task | None = None

    def record(self) -> Reading:
        """Take one reading now (the background task calls this every ``interval``)."""
        values, buckets, self.bounds = read_registry(self.registry)
        reading = Reading(time.time(), time.monotonic(), values, buckets)
        if self.readings:
            before = self.readings[-1]
            elapsed = max(reading.monotonic - before.monotonic, 1e-6)
            point = [round(reading.time, 3)]
            point += [round((values.get(sample, 0.0) - before.values.get(sample, 0.0)) / elapsed, 3)
                      for sample in RATES.values()]
            point += [values.get(sample) for sample in LEVELS.values()]
            # Serialized once here, not on every call: a page's first load gets 300 of them.
            self.points.append((point[0], json.dumps(point, separators=(",", ":"), allow_nan=False)))
        self.readings.append(reading)
        return reading

    @property
    def latest(self) -> Reading | None:
        return self.readings[-1] if self.readings else None

    def series_json(self, since: float | None = None) -> str:
        """``{"columns": COLUMNS, "points": [[...], ...]}`` as JSON: the per-second points
        newer than ``since`` (all kept ones by default), oldest first."""
        points = ",".join(text for t, text in self.points if since is None or t > since)
        return f'{{"columns":{json.dumps(COLUMNS, separators=(",", ":"))},"points":[{points}]}}'

    def span(self, seconds: float) -> tuple[Reading, Reading] | None:
        """The newest reading at least ``seconds`` older than the latest (else the oldest kept:
        the service is younger than that, and its first reading was taken before it served
        anything), and the latest; None until there are two."""
        if len(self.readings) < 2:
            return None
        latest = self.readings[-1]
        first = self.readings[0]
        for reading in itertools.islice(self.readings, 1, len(self.readings) - 1):
            if reading.monotonic > latest.monotonic - seconds:
                break
            first = reading
        return first, latest

    def change(self, seconds: float) -> tuple[dict[str, float], float] | None:
        """How much every counter grew over about the last ``seconds``, and the exact seconds."""
        span = self.span(seconds)
        if span is None:
            return None
        first, latest = span
        return ({name: value - first.values.get(name, 0.0) for name, value in latest.values.items()},
                latest.monotonic - first.monotonic)

    def window_buckets(self) -> tuple[dict[str, tuple[float, ...]], float] | None:
        """Per histogram of ``LATENCIES``, how much each cumulative bucket grew over about the
        last ``window`` seconds, and the exact seconds; None until there are two readings."""
        span = self.span(self.window)
        if span is None:
            return None
        first, latest = span
        return ({family: tuple(a - b for a, b in zip(latest.buckets.get(family, ()), first.buckets.get(family, ())))
                 for family in LATENCIES.values()}, latest.monotonic - first.monotonic)

    def latencies(self) -> dict[str, dict]:
        """Per histogram: observations and P50/P95/P99 (seconds) over about the last ``window``
        seconds (``window_s``: the exact span); None where nothing was observed."""
        return latency_summary(self.window_buckets(), self.bounds)

    def _tick(self) -> None:
        try:
            self.record()
        except Exception:  # a bad reading must not end the history for good
            log.exception("stats: reading the metrics failed")

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval - (time.monotonic() % self.interval))
            self._tick()

    def start(self) -> None:
        # The first reading before any request: figures asked for at once hold the counters
        # (a restarted worker's carry on from its predecessor's, ``keptcounters.py``).
        self._tick()
        self._task = asyncio.create_task(self._loop())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

