"""``serve --workers N`` over one moto S3: shared load, one cache slice each, crash and restart."""

from __future__ import annotations

import os
import random
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from shardfeed.client import Client
from shardfeed.process import free_port, healthy, start_service

from common.datasets import bucket_dataset
from common.reliability import expected_members
from common.service import fetch_batch, hops, metrics, stream_counts, wait_for_reading_after, wait_peers_up
from common.workers import worker_blocks, each_workers_shards, worker_pids, worker_urls

pytestmark = pytest.mark.slow  # starts several services, S3 servers or a browser; not in `make check`

SAMPLES = 240


@pytest.fixture(scope="module")
def dataset(moto):
    return bucket_dataset(moto, "workers", samples=SAMPLES, per_shard=20)  # 12 shards


@pytest.fixture
def service(dataset, moto, tmp_path):
    with start_service({"train": dataset[0]}, cache_dir=tmp_path / "cache", env=moto.env(), workers=2,
                       args=["--block-size", "64KiB", "--peer-timeout", "2"]) as svc:
        yield svc


def expected(source, indices):
    return expected_members(source, "train", indices)


def test_workers_share_the_load_and_cache_no_block_twice(service, dataset):
    _, source = dataset
    order = list(range(SAMPLES))
    random.Random(3).shuffle(order)
    batches = [order[i:i + 24] for i in range(0, SAMPLES, 24)]
    with ThreadPoolExecutor(8) as pool:  # a fresh connection per batch: the kernel spreads them
        for _ in range(2):
            assert list(pool.map(lambda b: fetch_batch(service.url, b), batches)) == [expected(source, b) for b in batches]
    urls = worker_urls(service.url)
    per_worker = [metrics(url) for url in urls]
    assert all(m["shardfeed_samples_served_total"] > 0 for m in per_worker), "one worker served everything"
    for url in urls:  # plain HTTP to each worker's own port serves any batch too
        assert fetch_batch(url, order[:50]) == expected(source, order[:50])
    assert all(m["shardfeed_store_requests_total"] > 0 for m in per_worker), "one worker owns every shard"
    # Sibling shards came over a socket (blocks not cached yet) or from the sibling's files.
    assert all(m.get("shardfeed_peer_requests_total", 0) + m.get("shardfeed_sibling_blocks_total", 0) > 0
               for m in per_worker), "no sibling shard served"
    cache = service.log_path.parent / "cache"
    blocks = [worker_blocks(cache, i) for i in range(2)]
    assert blocks[0] and blocks[1] and not blocks[0] & blocks[1], "a block cached twice on one host"


def test_a_worker_killed_mid_epoch_loses_no_sample_and_is_restarted(service, dataset):
    _, source = dataset
    first = worker_pids(service)
    assert len(first) == 2
    order = list(range(SAMPLES))
    random.Random(4).shuffle(order)
    with Client(service.url) as client:
        for n, start in enumerate(range(0, SAMPLES, 16)):
            if n == 3:
                os.kill(first[1], signal.SIGKILL)
            batch = order[start:start + 16]
            got = client.get_batch("train", batch)
            assert [(s["__key__"], s["bin"]) for s in got] == [(f"sample{i:06d}", source[(i, "bin")]) for i in batch]
    deadline = time.monotonic() + 30
    while True:
        pids = worker_pids(service)
        if len(pids) == 2 and first[1] not in pids and all(map(healthy, worker_urls(service.url))):
            break
        assert time.monotonic() < deadline, f"the worker was not restarted:\n{service.log()[-2000:]}"
        time.sleep(0.2)
    assert first[0] in pids, "the surviving worker was restarted too"
    assert "restarting it" in service.log()
    indices = list(range(SAMPLES))
    assert fetch_batch(service.url, indices) == expected(source, indices)


def test_sigterm_drains_the_workers_and_exits_0(service):
    pids = worker_pids(service)
    assert service.stop() == 0
    for pid in pids:
        assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text().lower()


def test_client_routing_sends_each_worker_its_own_part_with_no_hop(service, dataset):
    _, source = dataset
    table = httpx.get(f"{service.url}/v1/datasets/train/routing", timeout=10).json()
    assert sorted(table["urls"]) == sorted(worker_urls(service.url))
    order = list(range(SAMPLES))
    random.Random(5).shuffle(order)
    with Client(service.url) as client:
        for start in range(0, SAMPLES, 40):
            batch = order[start:start + 40]
            got = client.get_batch("train", batch)
            assert [(s["__key__"], s["bin"]) for s in got] == [(f"sample{i:06d}", source[(i, "bin")]) for i in batch]
    per_worker = [metrics(url) for url in worker_urls(service.url)]
    assert all(m["shardfeed_samples_served_total"] > 0 for m in per_worker)
    assert sum(hops(url, "worker") for url in worker_urls(service.url)) == 0, "a part went to a non-owner"


def test_a_batch_naming_a_stream_is_counted_once_whether_routed_or_relayed(service, dataset):
    """Routed by the client (each owner its part) or relayed by the worker a plain request
    reached (the sibling's shards read from it, ``/v1/internal/read``): each sample is counted
    once, by the worker that served it to the client, and the public port sums the workers."""
    _, source = dataset
    urls = worker_urls(service.url)
    each_workers_shards(service.url, urls, SAMPLES)  # both workers up, each owning shards
    order = list(range(SAMPLES))
    random.Random(6).shuffle(order)
    relayed, routed = order[:100], order[100:]
    assert fetch_batch(urls[0], relayed, stream="plain") == expected(source, relayed)  # its own port: w0 serves it
    first = metrics(urls[0])
    assert first.get("shardfeed_peer_requests_total", 0) + first.get("shardfeed_sibling_blocks_total", 0) > 0, \
        "no sibling shard was relayed"
    with Client(service.url) as client:
        client.load_routing("train")
        assert len({part.owner for part in client.router.split("train", routed)}) == 2
        got = client.get_batch("train", routed, stream="mix")
        assert [(s["__key__"], s["bin"]) for s in got] == [(f"sample{i:06d}", source[(i, "bin")]) for i in routed]
    own = [stream_counts(url) for url in urls]
    assert own[0]["plain"]["samples"] == 100 and "plain" not in own[1]
    assert own[0]["mix"]["samples"] > 0 and own[1]["mix"]["samples"] > 0  # each owner its own part
    host = stream_counts(service.url)
    assert {name: c["samples"] for name, c in host.items()} == {"plain": 100, "mix": len(routed)}
    for name in host:
        assert host[name]["bytes"] == sum(c.get(name, {}).get("bytes", 0) for c in own) > 0
    doc = wait_for_reading_after(service.url, httpx.get(f"{service.url}/v1/stats", timeout=10).json()["time"])
    assert doc["workers_reporting"] == 2
    assert {name: (s["samples"], s["bytes"]) for name, s in doc["streams"].items()} == \
        {name: (c["samples"], c["bytes"]) for name, c in host.items()}


def test_the_public_port_metrics_sum_every_worker_and_each_own_port_keeps_its_own(service, dataset):
    _, source = dataset
    urls = worker_urls(service.url)
    asked = [list(range(0, 60)), list(range(100, 140))]
    for url, batch in zip(urls, asked):  # through each worker's own port: known counts per worker
        assert fetch_batch(url, batch) == expected(source, batch)
    own = [metrics(url) for url in urls]
    assert [m["shardfeed_samples_served_total"] for m in own] == [60, 40]
    host = metrics(service.url)
    assert host["shardfeed_samples_served_total"] == 100
    assert (host["shardfeed_workers"], host["shardfeed_workers_reporting"]) == (2, 2)
    for name in ("shardfeed_store_requests_total", "shardfeed_peer_requests_total", "shardfeed_batch_seconds_count"):
        assert host[name] == sum(m[name] for m in own), name
    assert host["shardfeed_peers_up"] == 1  # a host's view (min over workers), not a sum
    assert host["shardfeed_coalescing_factor"] == pytest.approx(100 / host["shardfeed_store_requests_total"])
    text = httpx.get(f"{service.url}/metrics", timeout=10).text  # still the Prometheus text format
    assert "# TYPE shardfeed_batch_seconds histogram" in text and 'shardfeed_batch_seconds_bucket{le="+Inf"} 2.0' in text

    # A sibling that does not answer is not waited for: the public port answers without its
    # gauges, its counters read from the files it keeps them in (service/cluster/keptcounters.py).
    stopped = worker_pids(service)[1]
    os.kill(stopped, signal.SIGSTOP)
    try:
        for _ in range(20):  # the kernel may hand a connection to the stopped worker: try another
            try:
                resp = httpx.get(f"{service.url}/metrics", timeout=3)  # the live worker answers within SIBLING_TIMEOUT (1 s)
            except httpx.TimeoutException:
                continue
            if 'shardfeed_workers_reporting 1.0' in resp.text:
                break
        else:
            pytest.fail("no scrape of the public port was answered without the stopped worker")
        assert resp.status_code == 200 and "shardfeed_samples_served_total 100.0" in resp.text
    finally:
        os.kill(stopped, signal.SIGCONT)


def test_the_public_port_status_figures_sum_every_worker(service, dataset):
    _, source = dataset
    urls = worker_urls(service.url)
    plan = httpx.post(f"{service.url}/v1/datasets/train/plans", json={"kind": "indices", "indices": list(range(60))},
                      timeout=10).json()
    for url, batch in zip(urls, [list(range(0, 60)), list(range(100, 140))]):
        assert fetch_batch(url, batch) == expected(source, batch)

    def stats(url):
        resp = httpx.get(f"{url}/v1/stats", timeout=10)
        assert resp.status_code == 200, resp.text
        return resp.json()

    def settled(doc):  # what block writes finishing after the answers still move
        return doc["totals"]["samples"], doc["totals"]["store_requests"], doc["cache"]["bytes"]

    # Until every recorder has read its registry since (once a second), and the figures stay
    # put across the host's reading: cache writes may land after the answers.
    deadline = time.monotonic() + 30
    while True:
        own = [stats(url) for url in urls]
        host = stats(service.url)
        if [doc["totals"]["samples"] for doc in own] == [60, 40] and \
                [settled(stats(url)) for url in urls] == [settled(doc) for doc in own]:
            break
        assert time.monotonic() < deadline, "the workers' own figures never showed their batches and settled"
        time.sleep(0.2)
    assert all("workers_reporting" not in doc for doc in own)  # each worker's own URL: its own figures
    assert host["workers_reporting"] == 2
    assert host["totals"]["samples"] == 100
    assert host["totals"]["store_requests"] == sum(doc["totals"]["store_requests"] for doc in own)
    assert host["cache"]["capacity"] == sum(doc["cache"]["capacity"] for doc in own)
    assert host["cache"]["bytes"] == sum(doc["cache"]["bytes"] for doc in own)
    assert host["inflight"]["batch"]["limit"] == sum(doc["inflight"]["batch"]["limit"] for doc in own)
    assert host["latency"]["batch"]["count"] == 2  # from both workers' histogram buckets, one batch each
    samples = host["series"]["columns"].index("samples")
    assert sum(point[samples] for point in host["series"]["points"]) > 0
    def opened(doc):  # each worker lists the store when it opens: the same version, its own time
        return [{k: v for k, v in d.items() if k != "checked"} for d in doc["datasets"]]

    assert opened(host) == opened(own[0]) == opened(own[1]) and len(host["workers"]) == 2
    # Every worker holds the plan: the host lists it once, where its reader was last seen.
    assert [len(doc["plans"]) for doc in own] == [1, 1]
    assert [(p["id"], p["samples"]) for p in host["plans"]] == [(plan["id"], 60)]
    assert host["plans"][0]["position"] == max(doc["plans"][0]["position"] for doc in own)
    for bad in ("span=0", "span=nan", "span=10&span=20&span=30&span=40&span=50", ""):
        resp = httpx.get(f"{urls[0]}/v1/internal/stats?{bad}", timeout=10)
        assert resp.status_code == 400 and resp.json()["error"]["code"] == "invalid_request", (bad, resp.text)


def test_replicas_compose_with_workers(dataset, moto, tmp_path):
    _, source = dataset
    ports = [free_port(), free_port()]
    peers = f"a=http://127.0.0.1:{ports[0]},b=http://127.0.0.1:{ports[1]}"
    with start_service({"train": dataset[0]}, cache_dir=tmp_path / "a", port=ports[0], env=moto.env(), workers=2,
                       args=["--node-id", "a", "--peers", peers, "--block-size", "64KiB"]) as a, \
            start_service({"train": dataset[0]}, cache_dir=tmp_path / "b", port=ports[1], env=moto.env(),
                          args=["--node-id", "b", "--peers", peers, "--block-size", "64KiB"]) as b:
        wait_peers_up([b.url, *worker_urls(a.url)], 2, 10)  # every process
        order = list(range(SAMPLES))
        random.Random(9).shuffle(order)
        for service in (a, b):  # plain HTTP: any replica, any worker
            assert fetch_batch(service.url, order) == expected(source, order)
        table = httpx.get(f"{b.url}/v1/datasets/train/routing", timeout=10).json()
        assert sorted(table["urls"]) == sorted([a.url, b.url])  # a's workers sort out a's shards
        table = httpx.get(f"{a.url}/v1/datasets/train/routing", timeout=10).json()
        assert sorted(table["urls"]) == sorted([*worker_urls(a.url), b.url])
        before = hops(b.url, "replica") + sum(hops(u, "replica") for u in worker_urls(a.url))
        with Client(a.url) as client:
            for start in range(0, SAMPLES, 48):
                batch = order[start:start + 48]
                assert [(s["__key__"], s["bin"]) for s in client.get_batch("train", batch)] == [
                    (f"sample{i:06d}", source[(i, "bin")]) for i in batch]
        after = hops(b.url, "replica") + sum(hops(u, "replica") for u in worker_urls(a.url))
        assert after == before, "a routed part went to a replica that does not own it"
        # A plan told to one process reaches every process of both replicas, and so does its end.
        plan = httpx.post(f"{b.url}/v1/datasets/train/plans", json={"kind": "indices", "indices": order},
                          timeout=10).json()
        everyone = [b.url, *worker_urls(a.url)]
        for url in everyone:
            assert httpx.get(f"{url}/v1/datasets/train/plans/{plan['id']}", timeout=10).status_code == 200, url
        assert httpx.delete(f"{worker_urls(a.url)[1]}/v1/datasets/train/plans/{plan['id']}").status_code == 204
        for url in everyone:
            assert httpx.get(f"{url}/v1/datasets/train/plans/{plan['id']}", timeout=10).status_code == 404, url
