"""Small helpers for tests that talk to a running service."""

from __future__ import annotations

import io
import tarfile

import httpx
from prometheus_client.parser import text_string_to_metric_families

from shardfeed.process import hops  # noqa: F401  (re-exported for tests)
from shardfeed.process import scrape_metrics as metrics

from common.wait import wait_until


def tar_members(data: bytes) -> list[tuple[str, bytes]]:
    """Members of a tar response, read with Python's own tarfile (an independent parser)."""
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        return [(m.name, tar.extractfile(m).read()) for m in tar.getmembers()]


def wait_peers_up(urls, count: int, timeout: float = 20) -> None:
    """Until each of ``urls`` (replicas, or a replica's workers) sees ``count`` replicas up."""
    wait_until(lambda: all(metrics(url)["shardfeed_peers_up"] >= count for url in urls), timeout,
               f"{count} replicas up, as each sees it")


def wait_for_reading_after(url: str, moment: float, **kw) -> dict:
    """The ``/v1/stats`` document once the recorder has read the metrics after ``moment`` (wall
    time); ``kw`` goes to the request (a token, ``since``)."""
    def newer() -> dict | None:
        resp = httpx.get(f"{url}/v1/stats", timeout=10, **kw)
        assert resp.status_code == 200, resp.text
        doc = resp.json()
        return doc if doc["time"] is not None and doc["time"] > moment else None

    return wait_until(newer, 30, "a new reading")


def fetch_batch(url: str, indices, dataset: str = "train", stream: str | None = None) -> list[tuple[str, bytes]]:
    """``POST /v1/batch`` that must succeed (naming ``stream``, if given): its tar members, in order."""
    body = {"dataset": dataset, "indices": list(indices), **({"stream": stream} if stream is not None else {})}
    resp = httpx.post(f"{url}/v1/batch", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    return tar_members(resp.content)


def stream_counts(url: str) -> dict[str, dict[str, float]]:
    """``shardfeed_stream_{samples,bytes}_served_total`` by stream, as a service's ``/metrics``
    has them: ``{"a": {"samples": 30.0, "bytes": 61440.0}}``."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    out: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        what = {"shardfeed_stream_samples_served": "samples", "shardfeed_stream_bytes_served": "bytes"}.get(family.name)
        for sample in family.samples if what else ():
            out.setdefault(sample.labels["stream"], {"samples": 0.0, "bytes": 0.0})[what] = sample.value
    return out
