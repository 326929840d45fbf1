"""The whole host's status figures (``/v1/stats``) on the public port of ``serve --workers N``.

Like ``hostmetrics.py`` for ``/metrics``: the worker a page's poll lands on asks each
sibling, over its Unix socket and within ``SIBLING_TIMEOUT``, for its recorder's figures
(``GET /v1/internal/stats``: ``api/status.py``'s ``worker_figures``), and sums them with its own into a
``HostRecorder``, which the status document (``api/status.py``) reads as it reads one
worker's ``StatsRecorder``. What is summed stays exact: counters and levels are added,
rates are added (each is a worker's counter growth over its own span), the latency
percentiles come from the workers' histogram buckets added over the window (not from
their percentiles), and the per-second series are added point by point (the workers'
recorders tick on the same boundaries of the host's monotonic clock). Requests in flight
and their limits and the cache's capacity are the workers' together. Every worker holds
every plan (``api/plans.py``): each is listed once, at the farthest position any worker has
seen its reader at (``host_plans``). The datasets, replicas and workers are the answering
worker's view, the same on every worker.
A sibling that does not answer in time is not waited for: its counter totals are read
from the files it keeps them in (``keptcounters.py``), so no total goes down while a worker
restarts; its rates, levels and series are left out; ``workers_reporting`` says how many
answered.
"""

from __future__ import annotations

import json

from shardfeed.service.cluster.hostmetrics import from_siblings, sibling_counters
from shardfeed.service.cluster.keptcounters import KeptCounters
from shardfeed.service.cluster.peers import Cluster
from shardfeed.service.observe.stats import COLUMNS, Reading, StatsRecorder, latency_summary, read_registry


def host_plans(parts: list[dict]) -> list[dict]:
    """The plans of the workers' figures, one entry per plan id: the farthest position and
    the latest expiry any worker holds it with."""
    plans: dict[str, dict] = {}
    for part in parts:
        for plan in part["plans"]:
            held = plans.get(plan["id"])
            if held is None:
                plans[plan["id"]] = dict(plan)
            else:
                held["position"] = max(held["position"], plan["position"])
                held["expires_in"] = max(held["expires_in"], plan["expires_in"])
    return list(plans.values())


async def sibling_figures(cluster: Cluster, spans: tuple[float, ...], since: float | None) -> list[dict | None]:
    """Each sibling worker's ``worker_figures``, ``None`` for one that did not send them in time."""
    params = [("span", f"{seconds:g}") for seconds in spans] + ([("since", repr(since))] if since is not None else [])
    out = []
    for body in await from_siblings(cluster, "/v1/internal/stats", params):
        try:
            out.append(None if body is None else json.loads(body))
        except ValueError:
            out.append(None)
    return out


def kept_values(cluster: Cluster, figures: list[dict | None]) -> dict[str, float]:
    """The counters kept by the siblings whose ``figures`` (``sibling_figures``) are missing,
    summed over labels and workers as ``Reading.values`` are. Reads files: call it in a thread."""
    silent = [directory for part, directory in zip(figures, sibling_counters(cluster))
              if part is None and directory is not None]
    return read_registry(KeptCounters(silent))[0] if silent else {}


class HostRecorder:
    """Workers' figures (``worker_figures``, this worker's first) summed, read through the
    methods of ``StatsRecorder`` that the status document uses."""

    def __init__(self, own: StatsRecorder, parts: list[dict], kept: dict[str, float] | None = None):
        self.interval = own.interval
        self.window = own.window
        self.started = min(part["started"] for part in parts)
        self.parts = parts
        values: dict[str, float] = {}
        for counted in [*(part["values"] for part in parts), kept or {}]:  # kept: the silent workers' counters
            for name, value in counted.items():
                values[name] = values.get(name, 0.0) + value
        times = [part["time"] for part in parts if part["time"] is not None]
        self.latest = Reading(max(times), 0.0, values, {}) if times else None
        self.bounds = own.bounds  # every worker's histograms have the same buckets

    def change(self, seconds: float) -> tuple[dict[str, float], float] | None:
        """Every counter's growth over about ``seconds`` (one of the spans asked for), summed
        over the workers that have that much history; None when this worker has none yet."""
        grown = [part["changes"].get(f"{seconds:g}") for part in self.parts]
        if grown[0] is None:
            return None
        total: dict[str, float] = {}
        for change, _ in filter(None, grown):
            for name, value in change.items():
                total[name] = total.get(name, 0.0) + value
        return total, grown[0][1]

    def latencies(self) -> dict[str, dict]:
        windows = [part["latency"] for part in self.parts]
        if windows[0] is None:
            return latency_summary(None, self.bounds)
        counts: dict[str, list[float]] = {}
        for buckets, _ in filter(None, windows):
            for family, grew in buckets.items():
                held = counts.setdefault(family, [0.0] * len(grew))
                if len(held) == len(grew):
                    counts[family] = [a + b for a, b in zip(held, grew)]
        return latency_summary(({family: tuple(c) for family, c in counts.items()}, windows[0][1]), self.bounds)

    def series_json(self, since: float | None = None) -> str:
        """The workers' series points added up per tick (rates and levels alike), oldest first."""
        ticks: dict[int, list] = {}
        for part in self.parts:
            for point in part["points"]:
                tick = round(point[0] / self.interval)
                held = ticks.get(tick)
                if held is None:
                    ticks[tick] = list(point)
                    continue
                held[0] = max(held[0], point[0])
                for i, value in enumerate(point[1:], 1):
                    if value is not None:
                        held[i] = value if held[i] is None else round(held[i] + value, 3)
        points = [ticks[tick] for tick in sorted(ticks)]
        return json.dumps({"columns": COLUMNS, "points": points}, separators=(",", ":"), allow_nan=False)
