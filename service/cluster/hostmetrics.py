"""The whole host's metrics on the public port of ``serve --workers N``.

Each worker keeps its own registry (``metrics.py``) and serves it at its own URL (listed
in ``/v1/cluster``) and on its Unix socket. A scrape of the public port lands on any one
worker; that worker asks every sibling for its own ``/metrics`` over the sibling's Unix
socket, all at once and within ``SIBLING_TIMEOUT``, and sums the families as Prometheus's
multiprocess mode does: counters and histograms (buckets, count, sum) are added sample by
sample; gauges are added too, except those in ``GAUGE_MODES`` (the replicas a worker sees
up is a host's view, not a quantity: the lowest is reported), and the coalescing factor is
recomputed from the summed counters.

A sibling that is down, restarting or slow is not waited for: its counters and histograms
are read from the files it keeps them in (``keptcounters.py``), its gauges are left out.
So no counter of the host goes down while a worker restarts (Prometheus would read that as
a reset), and the gauges describe the live workers. ``shardfeed_workers_reporting`` says
how many workers answered (their gauges are in the sums), next to ``shardfeed_workers``.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import aiohttp
from prometheus_client import generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from shardfeed.service.cluster.keptcounters import KeptCounters
from shardfeed.service.cluster.peers import Cluster
from shardfeed.service.observe.metrics import Metrics

log = logging.getLogger("shardfeed.hostmetrics")

SIBLING_TIMEOUT = 1.0
"""Seconds a sibling has to send its metrics before the sums go without them."""

SIBLING_LIMIT = 4 << 20
"""Bytes of metrics text read from a sibling at most (a few KiB is usual)."""

GAUGE_MODES = {"shardfeed_peers_up": min}
"""Gauges not summed over workers, with how they are combined instead."""


async def from_siblings(cluster: Cluster, path: str, params: list[tuple[str, str]] | None = None
                        ) -> list[bytes | None]:
    """Each sibling worker's answer to ``GET path`` over its Unix socket, all asked at once;
    ``None`` for one that did not answer 200 with at most ``SIBLING_LIMIT`` bytes within
    ``SIBLING_TIMEOUT``."""
    return list(await asyncio.gather(*(_from_sibling(cluster, node, path, params) for node in _siblings(cluster))))


def _siblings(cluster: Cluster) -> list[int]:
    return [node for node in range(len(cluster.workers)) if node != cluster.me]


def sibling_counters(cluster: Cluster) -> list[Path | None]:
    """Each sibling worker's kept-counter directory (``keptcounters.py``), in the order of
    ``from_siblings``: where its counters are read when it does not answer."""
    return [cluster.workers[node].counters for node in _siblings(cluster)]


async def _from_sibling(cluster: Cluster, node: int, path: str, params: list[tuple[str, str]] | None) -> bytes | None:
    reader = cluster.reader(node)
    try:
        async with reader.session().get(f"{reader.base}{path}", params=params, ssl=reader.ssl, headers=cluster.headers,
                                        timeout=aiohttp.ClientTimeout(total=SIBLING_TIMEOUT)) as resp:
            body = await resp.content.read(SIBLING_LIMIT + 1)
            if resp.status != 200 or len(body) > SIBLING_LIMIT:
                raise ValueError(f"answered {resp.status} with {len(body)} bytes")
            return body
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError) as err:
        log.debug("%s of worker %s left out: %r", path, reader.target.id, err)
        return None


async def sibling_texts(cluster: Cluster) -> list[str | None]:
    """Each sibling worker's own ``/metrics`` text, ``None`` for one that did not send it in time."""
    return [None if body is None else body.decode(errors="replace") for body in await from_siblings(cluster, "/metrics")]


def summed(metrics: Metrics, texts: list[str | None], kept: list[Path | None] | None = None) -> bytes:
    """This worker's metrics and its siblings' (``texts``, as ``sibling_texts`` returns them)
    summed into one Prometheus text exposition; a sibling whose text is missing or unreadable
    adds the counters kept in its directory in ``kept`` (``sibling_counters``). Reads those
    files: call it in a thread."""
    families: dict[str, Metric] = {}
    values: dict[str, dict[tuple, float]] = {}
    sources = [metrics.registry.collect()]
    silent = []
    for text, directory in zip(texts, kept or [None] * len(texts)):
        parsed = _parsed(text)
        if parsed is not None:
            sources.append(parsed)
        elif directory is not None:
            silent.append(directory)
    reporting = len(sources)
    if silent:
        sources.append(KeptCounters(silent).collect())
    for source in sources:
        for family in source:
            merged = families.setdefault(family.name, Metric(family.name, family.documentation, family.type))
            if merged.type != family.type:
                continue  # a sibling of another version: its family cannot be added to this one
            combine = GAUGE_MODES.get(family.name, sum) if family.type == "gauge" else sum
            held = values.setdefault(family.name, {})
            for sample in family.samples:
                key = (sample.name, tuple(sorted(sample.labels.items())))
                held[key] = combine((held[key], sample.value)) if key in held else sample.value
    for name, merged in families.items():
        for (sample, labels), value in values[name].items():
            merged.add_sample(sample, dict(labels), value)
    samples = values.get("shardfeed_samples_served", {}).get(("shardfeed_samples_served_total", ()), 0.0)
    reads = values.get("shardfeed_store_requests", {}).get(("shardfeed_store_requests_total", ()), 0.0)
    if "shardfeed_coalescing_factor" in families:
        families["shardfeed_coalescing_factor"].samples = []
        families["shardfeed_coalescing_factor"].add_sample("shardfeed_coalescing_factor", {},
                                                           samples / reads if reads else 0.0)
    workers = Metric("shardfeed_workers", "Worker processes of this host", "gauge")
    workers.add_sample("shardfeed_workers", {}, 1 + len(texts))
    answered = Metric("shardfeed_workers_reporting", "Workers that answered: their gauges are in these sums "
                      "(the others' counters come from their kept files)", "gauge")
    answered.add_sample("shardfeed_workers_reporting", {}, reporting)
    return generate_latest(_Families([*families.values(), workers, answered]))


def _parsed(text: str | None) -> list[Metric] | None:
    """A sibling's metric families; ``None`` when it sent none, or no Prometheus text."""
    if text is None:
        return None
    try:
        return list(text_string_to_metric_families(text))
    except ValueError as err:
        log.warning("metrics of a sibling worker left out, unreadable: %s", err)
        return None


class _Families:
    """Ready metric families, in the shape ``generate_latest`` reads (a registry's ``collect``)."""

    def __init__(self, families: list[Metric]):
        self.families = families

    def collect(self) -> list[Metric]:
        return self.families
