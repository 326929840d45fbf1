"""The status page: ``GET /v1/stats`` (JSON, what the page shows) and ``GET /`` or ``/ui`` (the page).

The page is one static HTML file in the package (``static/status.html``, script and
styles inline, nothing fetched from elsewhere) that polls ``/v1/stats`` once a second.
Its HTML carries no data, so it is served without a token; ``/v1/stats`` is behind the
bearer-token middleware like every other route, and the page asks for the token on a
401 and sends it as ``Authorization: Bearer`` (kept in the tab's ``sessionStorage``).

Every figure comes from a public accessor (``Dataset.info()``, ``Cluster.describe()``
and ``owners()``, ``Admission``) or from the metrics history of ``StatsRecorder``; a figure
the service does not know is ``null`` (the page says "unknown"), never 0. A call costs
well under a millisecond: the series' points are serialized once, when recorded, and
after its first call the page asks only for points newer than the last it has
(``?since=``).
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import re
from dataclasses import replace
from importlib.resources import files

import numpy as np
from fastapi import APIRouter, Query, Request
from starlette.responses import HTMLResponse, Response

from shardfeed.service.api.common import Admission, AppState, State, on_public_port
from shardfeed.service.cluster.hoststats import HostRecorder, host_plans, kept_values, sibling_figures
from shardfeed.service.observe.stats import HIT_TIERS, RATES, per_stream

router = APIRouter(tags=["status"])

RATE_SPAN = 10.0
"""Seconds the headline rates are measured over (counter growth over that span)."""

_PAGE = files(__package__).joinpath("static/status.html").read_bytes()
_SCRIPT = re.search(rb"<script>(.*?)</script>", _PAGE, re.S).group(1)
# The page may run its own inline script and talk to this origin, nothing else.
_PAGE_HEADERS = {
    "Cache-Control": "no-cache",
    "Content-Security-Policy": (
        f"default-src 'none'; script-src 'sha256-{base64.b64encode(hashlib.sha256(_SCRIPT).digest()).decode()}'; "
        "style-src 'unsafe-inline'; connect-src 'self'; img-src data:; form-action 'none'; "
        "frame-ancestors 'none'; base-uri 'none'"),
    "X-Content-Type-Options": "nosniff",
}


@router.get("/", include_in_schema=False)
@router.get("/ui", include_in_schema=False)
async def page() -> HTMLResponse:
    return HTMLResponse(_PAGE, headers=_PAGE_HEADERS)


@router.get("/v1/stats")
async def stats(request: Request, state: AppState, since: float | None = Query(
        None, description="only series points newer than this time (seconds since the epoch)")) -> Response:
    """The status page's figures: recent rates and latencies, cache, admission, datasets (and
    those being registered), replicas.
    On the public port of ``--workers N``, the whole host's (every worker's summed, ``hoststats.py``)."""
    if on_public_port(request, state):
        spans = (RATE_SPAN, state.stats.window)
        siblings = await sibling_figures(state.cluster, spans, since)
        parts = [worker_figures(state, spans, since), *filter(None, siblings)]
        state = host_state(state, parts, await asyncio.to_thread(kept_values, state.cluster, siblings))
        figures = {**document(state), "plans": host_plans(parts) or None,
                   "registering": host_registering(parts) or None, "workers_reporting": len(parts)}
    else:
        figures = document(state)
    # The series is spliced in as the recorder serialized it (see ``StatsRecorder.series_json``).
    head = json.dumps(figures, separators=(",", ":"), allow_nan=False)
    body = f'{head[:-1]},"series":{state.stats.series_json(since)}}}'
    return Response(body, media_type="application/json", headers={"Cache-Control": "no-store"})


def worker_figures(state: State, spans: tuple[float, ...], since: float | None) -> dict:
    """This worker's part of the host's figures, as JSON-ready data: its latest counter and
    level values, its counters' growth over each of ``spans`` seconds, its latency buckets'
    growth over the window, its series points newer than ``since``, its in-flight requests,
    cache capacity, plans and datasets being registered."""
    recorder = state.stats
    latest = recorder.latest
    return {
        "started": recorder.started,
        "time": latest and latest.time,
        "values": latest.values if latest else {},
        "changes": {f"{seconds:g}": recorder.change(seconds) for seconds in spans},
        "latency": recorder.window_buckets(),
        "points": json.loads(recorder.series_json(since))["points"],
        "inflight": state.admission.inflight,
        "limits": state.admission.limits,
        "capacity": state.config.cache_size,
        "store_limit": state.config.max_store_requests,
        "plans": [plan.describe() for plan in state.plans.live()],
        "registering": _registering(state),
    }


def host_state(state: State, parts: list[dict], kept: dict[str, float]) -> State:
    """``state`` as ``document`` should read it for the whole host, from every worker's
    figures (``hoststats.worker_figures``) and the silent workers' ``kept`` counters: the
    summed recorder, every worker's requests in flight and limits, the whole cache's
    capacity and store read limit."""
    admission = Admission({kind: sum(p["limits"][kind] for p in parts) for kind in state.admission.limits},
                          state.metrics)
    admission.inflight = {kind: sum(p["inflight"].get(kind, 0) for p in parts) for kind in admission.limits}
    config = replace(state.config, cache_size=sum(p["capacity"] for p in parts),
                     max_store_requests=sum(p["store_limit"] for p in parts))
    return replace(state, stats=HostRecorder(state.stats, parts, kept), admission=admission, config=config)


def document(state: State) -> dict:
    """Every figure but the series."""
    recorder = state.stats
    latest = recorder.latest
    values = latest.values if latest else {}
    samples, store_requests = values.get(RATES["samples"]), values.get(RATES["store_requests"])
    recent = recorder.change(RATE_SPAN)
    window = recorder.change(recorder.window)
    return {
        "time": latest and latest.time,
        "started": recorder.started,
        "interval_s": recorder.interval,
        "rates": _rates(recent),
        "totals": {name: values.get(sample) for name, sample in RATES.items()},
        "streams": _streams(values, recent),
        "cache": {
            "bytes": values.get("shardfeed_cache_bytes"),
            "blocks": values.get("shardfeed_cache_blocks"),
            "capacity": state.config.cache_size,
            "fill": _ratio(values.get("shardfeed_cache_bytes"), state.config.cache_size),
            "hits": _block_reads(values),
            "hits_recent": window and _block_reads(window[0]),
            "hit_ratio": _hit_ratio(values),
            "hit_ratio_recent": window and _hit_ratio(window[0]),
        },
        "coalescing": {
            "factor": _ratio(samples, store_requests),
            "factor_recent": window and _ratio(window[0].get(RATES["samples"]), window[0].get(RATES["store_requests"])),
        },
        "latency": recorder.latencies(),
        "inflight": {
            **{kind: {"now": n, "limit": state.admission.limits[kind]} for kind, n in state.admission.inflight.items()},
            "store": {"now": values.get("shardfeed_inflight_store_requests"), "limit": state.config.max_store_requests},
        },
        "datasets": [dataset.info() for dataset in state.datasets.values()],
        "replicas": _replicas(state),
        "plans": [plan.describe() for plan in state.plans.live()] or None,  # None: the page hides it
        "registering": _registering(state) or None,  # likewise
        "workers": (state.cluster.describe()["workers"] or None) if state.cluster is not None else None,
        "transforms": _transforms(state, values) or None,  # None: none served, the page hides it
    }


def _transforms(state: State, values: dict[str, float]) -> dict:
    """Per served transform: samples transformed, CPU seconds per sample in the pool, the
    prepared cache's hits and misses and its hit ratio, failures (the host's sums on its public
    port); and this process's pool: processes, busy share, restarts."""
    if not state.transforms:
        return {}

    def count(metric: str, name: str, result: str | None = None) -> float:
        labels = (f'result="{result}",' if result else "") + f'transform="{name}"'  # sorted; names are [a-z0-9_]
        return values.get(f"{metric}_total{{{labels}}}", 0.0)

    served = {}
    for name in state.transforms.served:
        samples, seconds = count("shardfeed_transform_samples", name), count("shardfeed_transform_seconds", name)
        hits = count("shardfeed_transform_prepared", name, "hit")
        misses = count("shardfeed_transform_prepared", name, "miss")
        served[name] = {"samples": int(samples), "seconds_per_sample": _ratio(seconds, samples),
                        "prepared_hits": int(hits), "prepared_misses": int(misses),
                        "prepared_hit_ratio": _ratio(hits, hits + misses),
                        "failures": int(count("shardfeed_transform_failures", name))}
    pool = state.pool.stats() if state.pool is not None else {}
    return {"served": served, "pool": {key: pool.get(key) for key in ("processes", "busy_share", "restarts")}}


def _registering(state: State) -> list[dict]:
    """The datasets being added (``POST /v1/datasets``) and how far each one's indexing is."""
    return [registration.info(name) for name, registration in list(state.datasets.registering.items())]


def host_registering(parts: list[dict]) -> list[dict]:
    """The datasets the workers of ``parts`` (``worker_figures``) are adding, one entry per name:
    the one whose indexing is farthest (a host's workers share one indexer: the others wait
    for its index, showing no indexing of their own)."""
    out: dict[str, dict] = {}
    for part in parts:
        for entry in part.get("registering") or ():  # a worker of another version sends none
            held = out.get(entry["name"])
            if held is None or _indexed(entry) > _indexed(held):
                out[entry["name"]] = entry
    return list(out.values())


def _indexed(entry: dict) -> float:
    return -1.0 if entry["indexing"] is None else entry["indexing"]["fraction"]


def _rates(recent: tuple[dict[str, float], float] | None) -> dict:
    """Per second over the last ``RATE_SPAN`` seconds (``span_s``: exactly how long)."""
    if recent is None:
        return {"span_s": None, **dict.fromkeys(RATES)}
    change, seconds = recent
    return {"span_s": round(seconds, 3),
            **{name: round(change.get(sample, 0.0) / seconds, 3) for name, sample in RATES.items()}}


def _streams(values: dict[str, float], recent: tuple[dict[str, float], float] | None) -> dict[str, dict]:
    """Per stream that batch requests named: samples and bytes per second over the same span
    as ``_rates`` (None before there is one), and totals since start."""
    grown = per_stream(recent[0]) if recent is not None else {}
    out = {}
    for name, total in sorted(per_stream(values).items()):
        change = grown.get(name, {})
        out[name] = {**{f"{what}_per_s": None if recent is None else round(change.get(what, 0.0) / recent[1], 3)
                        for what in total},
                     **{what: int(count) for what, count in total.items()}}
    return out


def _block_reads(values: dict[str, float]) -> dict[str, float]:
    """Blocks that reads needed, by where they came from: each tier of ``HIT_TIERS``, and the store."""
    return {**{tier: values.get(RATES[rate], 0) for tier, rate in HIT_TIERS.items()},
            "store": values.get(RATES["cache_misses"], 0)}


def _hit_ratio(values: dict[str, float]) -> float | None:
    """The share of blocks that came from any tier rather than the store."""
    reads = _block_reads(values)
    store = reads.pop("store")
    return _ratio(sum(reads.values()), sum(reads.values()) + store)


def _ratio(part: float | None, whole: float | None) -> float | None:
    return None if part is None or not whole else round(part / whole, 4)


def _replicas(state: State) -> list[dict]:
    """Every replica with its health and how many shards of each dataset it owns now."""
    if state.cluster is None:  # a single service owns every shard
        return [{"id": None, "url": None, "up": True, "self": True,
                 "shards": {name: len(d.index.shards) for name, d in state.datasets.items()}}]
    described = state.cluster.describe()["peers"]
    for peer in described:
        peer["shards"] = {}
    for name, dataset in state.datasets.items():
        shards = dataset.index.shards
        owners = state.cluster.host_of(state.cluster.owners(dataset.url, shards, np.arange(len(shards))))
        for peer, count in zip(described, np.bincount(owners, minlength=len(described)).tolist()):
            peer["shards"][name] = count
    return described

