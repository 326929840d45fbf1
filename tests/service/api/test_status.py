"""``GET /v1/stats`` and the metrics history behind it (the page itself: test_status_page.py).

The recorder is checked in-process against a real metrics registry; the endpoint against a
real service over a socket, whose every figure must agree with its own ``/metrics``."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time
import zipfile
from functools import partial

import httpx
import numpy as np
import pytest

from shardfeed.client import Client
from shardfeed.process import free_port, start_all, start_service, stop_all
from shardfeed.service.observe.metrics import Metrics
from shardfeed.service.observe.stats import COLUMNS, RATES, StatsRecorder, quantile

from common import REPO
from common.datasets import dir_put, make_dataset
from common.service import metrics, wait_for_reading_after, wait_peers_up
from common.wait import wait_until

pytestmark = pytest.mark.slow  # starts several services, S3 servers or a browser; not in `make check`

SAMPLES = 200


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    root = tmp_path_factory.mktemp("status-data")
    make_dataset(dir_put(root), samples=SAMPLES, per_shard=25)  # 8 shards
    return root.as_uri()


@pytest.fixture
def service(dataset, tmp_path):
    with start_service({"train": dataset}, cache_dir=tmp_path / "cache", args=["--block-size", "64KiB"]) as svc:
        yield svc


def stats(url: str, **kw) -> dict:
    resp = httpx.get(f"{url}/v1/stats", timeout=10, **kw)
    assert resp.status_code == 200, resp.text
    assert resp.headers["content-type"] == "application/json"
    return resp.json()


def columns(series: dict) -> dict[str, list]:
    """The series' points as columns: ``{"t": [...], "samples": [...], ...}``."""
    assert series["columns"] == list(COLUMNS)
    return {name: [point[i] for point in series["points"]] for i, name in enumerate(series["columns"])}


def batches(url: str, count: int, size: int = 32, seed: int = 0) -> None:
    rng = random.Random(seed)
    with httpx.Client(timeout=30) as client:
        for _ in range(count):
            body = {"dataset": "train", "indices": [rng.randrange(SAMPLES) for _ in range(size)]}
            assert client.post(f"{url}/v1/batch", json=body).status_code == 200


# --- the recorder, in-process ----------------------------------------------------------------


def test_rates_are_counter_growth_over_the_measured_time_between_readings():
    registry = Metrics()
    recorder = StatsRecorder(registry.registry)
    first = recorder.record()
    registry.samples.inc(300)
    registry.store_bytes.inc(4096)
    second = recorder.record()
    series = columns(json.loads(recorder.series_json()))
    elapsed = second.monotonic - first.monotonic
    assert series["samples"] == [pytest.approx(300 / elapsed, rel=1e-3)]
    assert series["store_bytes"] == [pytest.approx(4096 / elapsed, rel=1e-3)]
    assert series["rejected"] == [0]
    assert series["t"] == [round(second.time, 3)]
    assert json.loads(recorder.series_json(since=series["t"][0]))["points"] == []
    change, seconds = recorder.change(10)
    assert (change[RATES["samples"]], seconds) == (300, elapsed)


def test_the_history_is_bounded():
    recorder = StatsRecorder(Metrics().registry, history=5)
    for _ in range(20):
        recorder.record()
    assert len(json.loads(recorder.series_json())["points"]) == 5 and len(recorder.readings) == 6


@pytest.mark.parametrize("seed", range(3))
def test_percentiles_lie_in_the_bucket_of_the_true_percentile(seed):
    registry = Metrics()
    recorder = StatsRecorder(registry.registry)
    recorder.record()
    rng = np.random.default_rng(seed)
    observed = rng.lognormal(mean=-4, sigma=1.5, size=2000)  # ~18 ms median, a long tail
    for value in observed:
        registry.batch_latency.observe(value)
    recorder.record()
    latency = recorder.latencies()
    bounds = recorder.bounds["shardfeed_batch_seconds"]
    assert latency["batch"]["count"] == 2000
    assert latency["sample"] == {"count": 0, "p50": None, "p95": None, "p99": None}  # unknown, not 0
    for q in (50, 95, 99):
        true = np.percentile(observed, q)
        upper = next(b for b in bounds if true <= b)
        lower = max([0.0] + [b for b in bounds if b < upper])
        assert lower <= latency["batch"][f"p{q}"] <= upper, (q, true)


def test_percentiles_cover_only_the_recent_window():
    registry = Metrics()
    recorder = StatsRecorder(registry.registry, window=0)  # every reading is older than the window
    recorder.record()
    registry.batch_latency.observe(20.0)  # slow, but before the last reading
    recorder.record()
    registry.batch_latency.observe(0.002)
    recorder.record()
    assert recorder.latencies()["batch"]["count"] == 1
    assert recorder.latencies()["batch"]["p99"] <= 0.0025


def test_quantile_of_the_open_top_bucket_is_the_highest_finite_bound():
    assert quantile(0.5, (0.1, 1.0, float("inf")), (0, 0, 10)) == 1.0
    assert quantile(0.5, (0.1, 1.0, float("inf")), (0, 0, 0)) is None


# --- the endpoint, on a real service -----------------------------------------------------------


def test_stats_say_unknown_before_anything_happened(service):
    doc = wait_for_reading_after(service.url, 0)
    assert doc["latency"]["batch"]["p50"] is None and doc["latency"]["sample"]["p99"] is None
    assert doc["cache"]["hit_ratio"] is None and doc["coalescing"]["factor"] is None
    assert doc["totals"]["samples"] == 0
    described = httpx.get(f"{service.url}/v1/datasets/train").json()
    described.pop("cache")  # the dataset's own description adds the cache it is read through
    assert doc["datasets"] == [described]
    assert doc["replicas"] == [{"id": None, "url": None, "up": True, "self": True, "shards": {"train": 8}}]
    assert doc["plans"] is None and doc["workers"] is None and doc["registering"] is None
    assert doc["cache"]["hits"] == {"ram": 0, "disk": 0, "sibling": 0, "replica": 0, "store": 0}
    assert doc["inflight"]["batch"] == {"now": 0, "limit": 128}


def test_stats_agree_with_the_service_metrics_after_load(service):
    batches(service.url, 40)
    moment = time.time()
    doc = wait_for_reading_after(service.url, moment)
    prom = metrics(service.url)
    for name, sample in RATES.items():
        assert doc["totals"][name] == prom.get(sample), name  # a labelled one: not read yet, in neither
    assert doc["totals"]["samples"] == 40 * 32
    assert doc["cache"]["bytes"] == prom["shardfeed_cache_bytes"] > 0
    ram, disk = prom["shardfeed_memory_cache_hits_total"], prom["shardfeed_cache_hits_total"]
    misses = prom["shardfeed_cache_misses_total"]
    assert doc["cache"]["hits"] == {"ram": ram, "disk": disk, "sibling": 0, "replica": 0, "store": misses}
    assert ram > 0  # the repeated batches came from the RAM tier, and count as hits
    assert doc["cache"]["hit_ratio"] == pytest.approx((ram + disk) / (ram + disk + misses), abs=1e-4)
    assert doc["cache"]["fill"] == pytest.approx(prom["shardfeed_cache_bytes"] / doc["cache"]["capacity"], abs=1e-4)
    assert doc["coalescing"]["factor"] == pytest.approx(1280 / prom["shardfeed_store_requests_total"], abs=1e-3)
    # The service is younger than the window: the percentiles cover every batch so far.
    assert doc["latency"]["batch"]["count"] == prom["shardfeed_batch_seconds_count"] == 40
    assert 0 < doc["latency"]["batch"]["p50"] <= doc["latency"]["batch"]["p95"] <= doc["latency"]["batch"]["p99"]
    assert doc["rates"]["span_s"] > 0 and doc["rates"]["samples"] > 0
    series = columns(doc["series"])
    assert len(series["t"]) >= 1 and series["t"] == sorted(series["t"])
    assert all(len(column) == len(series["t"]) for column in series.values())
    assert max(series["samples"]) > 0 and min(series["samples"]) >= 0


def test_stats_list_the_plans_the_service_holds(service):
    with Client(service.url) as client:
        plan = client.register_plan("train", {"kind": "indices", "indices": list(range(40)), "complete": True})
        batches(service.url, 1)
        doc = stats(service.url)
        assert [(p["id"], p["dataset"], p["samples"]) for p in doc["plans"]] == [(plan["id"], "train", 40)]
        client.delete_plan("train", plan["id"])
    assert stats(service.url)["plans"] is None


def test_since_returns_only_newer_points(service):
    first = wait_for_reading_after(service.url, time.time() + 1.5)
    last = columns(first["series"])["t"][-1]
    later = columns(wait_for_reading_after(service.url, first["time"], params={"since": last})["series"])
    assert later["t"] and all(t > last for t in later["t"])
    assert stats(service.url, params={"since": 1e12})["series"]["points"] == []


def test_a_bad_since_is_a_400_with_the_error_body(service):
    resp = httpx.get(f"{service.url}/v1/stats", params={"since": "yesterday"})
    assert resp.status_code == 400
    assert resp.json()["error"]["code"] == "invalid_request"


def test_the_page_is_served_at_root_and_ui_with_a_strict_content_policy(service):
    for path in ("/", "/ui"):
        resp = httpx.get(service.url + path)
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/html")
        assert "default-src 'none'" in resp.headers["content-security-policy"]
        assert "/v1/stats" in resp.text and "<script src" not in resp.text and "http" not in resp.text.split(
            "<script>")[1].replace("http://www.w3.org/2000/svg", "")  # nothing loaded from elsewhere


def test_with_tokens_the_page_loads_but_its_data_needs_the_token(dataset, tmp_path):
    with start_service({"train": dataset}, cache_dir=tmp_path / "cache", env={"SHARDFEED_TOKENS": "s3cret"}) as svc:
        page = httpx.get(f"{svc.url}/")
        assert page.status_code == 200 and "train" not in page.text  # the HTML holds no data
        refused = httpx.get(f"{svc.url}/v1/stats")
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "unauthorized"
        assert stats(svc.url, headers={"Authorization": "Bearer s3cret"})["datasets"][0]["name"] == "train"


def test_replicas_show_health_and_the_shards_each_owns(dataset, tmp_path):
    ports = [free_port() for _ in range(2)]
    peers = ",".join(f"{n}=http://127.0.0.1:{p}" for n, p in zip("ab", ports))
    services = start_all([partial(start_service, {"train": dataset}, cache_dir=tmp_path / f"cache-{i}", port=ports[i],
                                  args=["--node-id", "ab"[i], "--peers", peers]) for i in range(2)])
    try:
        wait_peers_up([s.url for s in services], 2)
        views = [wait_for_reading_after(s.url, time.time())["replicas"] for s in services]
        for view, me in zip(views, "ab"):
            assert [(r["id"], r["self"]) for r in view] == [("a", me == "a"), ("b", me == "b")]
            assert sum(r["shards"]["train"] for r in view) == 8
        assert [r["shards"] for r in views[0]] == [r["shards"] for r in views[1]]  # one map, seen alike
        services[1].stop()

        def shown_down() -> list | None:
            view = stats(services[0].url)["replicas"]
            return None if view[1]["up"] else view

        view = wait_until(shown_down, 20, "the stopped replica shown down")
        assert view[0]["shards"] == {"train": 8} and view[1]["shards"] == {"train": 0}
    finally:
        stop_all(services)


def test_the_page_is_in_the_built_wheel(tmp_path):
    """An installed service (the Docker image installs the wheel) has its page: package-data."""
    root = REPO
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                            "-w", str(tmp_path), str(root)], capture_output=True, text=True, timeout=240)
    assert built.returncode == 0, built.stderr[-2000:]
    (wheel,) = tmp_path.glob("shardfeed-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        page = archive.read("shardfeed/service/api/static/status.html")
    assert page == (root / "service" / "api" / "static" / "status.html").read_bytes()
