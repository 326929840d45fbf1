"""True hit ratios: every tier a block can come from without a store read of this node's
(RAM, disk, a sibling worker's files, the peer replica that owns its shard) is counted in
``/v1/stats`` and in the overall ratio, which the status page shows; and the datasets being
registered (``POST /v1/datasets``) are listed in ``/v1/stats`` and on the page meanwhile.

The blocks a batch needed are counted here from the dataset's own index (``tarfile``'s
offsets), and which replica owns a shard from the rendezvous hash the service documents;
the page is read back from headless chromium (as in test_status_page.py)."""

from __future__ import annotations

import asyncio
import fcntl
import random
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import httpx
import pyarrow.parquet as pq
import pytest

from shardfeed.process import free_port, start_all, start_service, stop_all
from shardfeed.service.cache.names import dataset_id
from shardfeed.service.cluster.peers import _score
from shardfeed.service.datasets.autoindex import _versions_digest
from shardfeed.service.stores import open_store

from common.datasets import dir_put, make_dataset
from common.reliability import expected_members
from common.service import fetch_batch, metrics, wait_for_reading_after, wait_peers_up
from common.wait import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]  # several services, or a browser

BLOCK = 64 * 1024
ARGS = ["--block-size", "64KiB"]
TIERS = ("ram", "disk", "sibling", "replica")


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    """16 small shards: both of two replicas own some, whatever the temporary path hashes to."""
    root = tmp_path_factory.mktemp("hit-ratio-data")
    source = make_dataset(dir_put(root), samples=160, per_shard=10, sizes=(100, 4000))
    return root, source




def stats(url: str) -> dict:
    resp = httpx.get(f"{url}/v1/stats", timeout=10)
    assert resp.status_code == 200, resp.text
    return resp.json()


def index_rows(root) -> list[dict]:
    return pq.read_table(root / "index.parquet", columns=["sample", "shard", "offset", "size"]).to_pylist()


def blocks_needed(root, samples) -> int:
    """Distinct ``(shard, block)`` pairs that every member of ``samples`` spans."""
    wanted = set(samples)
    pairs = set()
    for row in index_rows(root):
        if row["sample"] in wanted:
            first, last = row["offset"] // BLOCK, (row["offset"] + max(row["size"], 1) - 1) // BLOCK
            pairs.update((row["shard"], block) for block in range(first, last + 1))
    return len(pairs)


def prom_ratio(url: str) -> float:
    """The overall hit ratio since start, from the service's own ``/metrics``."""
    prom = metrics(url)
    hits = (prom["shardfeed_memory_cache_hits_total"] + prom["shardfeed_cache_hits_total"]
            + prom.get('shardfeed_sibling_blocks_total{result="read"}', 0) + prom["shardfeed_replica_blocks_total"])
    whole = hits + prom["shardfeed_cache_misses_total"]
    return hits / whole if whole else 0.0


# --- the replica tier, with two replicas ---------------------------------------------------------


def test_blocks_read_through_the_owner_replica_are_hits_of_the_asking_node(dataset, tmp_path):
    root, source = dataset
    ports = [free_port() for _ in range(2)]
    peers = ",".join(f"{n}=http://127.0.0.1:{p}" for n, p in zip("ab", ports))
    a, b = services = start_all([partial(start_service, {"train": root.as_uri()}, cache_dir=tmp_path / f"cache-{i}",
                                         port=ports[i], args=[*ARGS, "--node-id", "ab"[i], "--peers", peers])
                                 for i in range(2)])
    try:
        wait_peers_up([s.url for s in services], 2)
        doc = wait_for_reading_after(a.url, time.time())
        assert doc["cache"]["hits"] == {**dict.fromkeys(TIERS, 0), "store": 0}
        url = doc["datasets"][0]["url"]
        by_shard: dict[str, set[int]] = {}
        for row in index_rows(root):
            by_shard.setdefault(row["shard"], set()).add(row["sample"])
        shards = sorted(by_shard)
        owner = {s: max("ab", key=lambda peer: _score(peer, url, s)) for s in shards}
        owned = {r["id"]: r["shards"]["train"] for r in doc["replicas"]}
        assert owned == {p: sum(o == p for o in owner.values()) for p in "ab"}, "not the service's ownership"
        theirs = [i for s in shards if owner[s] == "b" for i in sorted(by_shard[s])[:3]]
        mine = [i for s in shards if owner[s] == "a" for i in sorted(by_shard[s])[:3]]
        assert theirs and mine

        # Every member is b's: a reads none of their blocks itself, and counts each one b served.
        assert fetch_batch(a.url, theirs) == expected_members(source, "train", theirs)
        doc = wait_for_reading_after(a.url, time.time())
        want = blocks_needed(root, theirs)
        assert doc["cache"]["hits"] == {"ram": 0, "disk": 0, "sibling": 0, "replica": want, "store": 0}
        assert doc["cache"]["hits_recent"]["replica"] == want  # younger than the window: all of it
        assert doc["cache"]["hit_ratio"] == 1.0 and doc["totals"]["replica_hits"] == want
        assert metrics(a.url)["shardfeed_replica_blocks_total"] == want
        served = stats(b.url)["cache"]["hits"]  # b counts its own reads of them, and no replica hit
        assert served["replica"] == 0 and served["store"] >= want

        # a's own shards, cold: read from the store here; the ratio counts the replica's blocks.
        assert fetch_batch(a.url, mine) == expected_members(source, "train", mine)
        doc = wait_for_reading_after(a.url, time.time())
        hits = doc["cache"]["hits"]
        assert hits["replica"] == want and hits["store"] >= blocks_needed(root, mine)
        assert doc["cache"]["hit_ratio"] == pytest.approx(
            sum(hits[t] for t in TIERS) / (sum(hits[t] for t in TIERS) + hits["store"]), abs=1e-4)
        assert doc["cache"]["hit_ratio"] >= round(want / (want + hits["store"]), 4) > 0
    finally:
        stop_all(services)


# --- a warm epoch from RAM, on the page ------------------------------------------------------------


def test_a_warm_epoch_from_ram_shows_an_overall_hit_ratio_of_at_least_99_percent(browser, dataset, tmp_path):
    root, source = dataset
    indices = list(range(len({i for i, _ in source})))
    with start_service({"train": root.as_uri()}, cache_dir=tmp_path / "cache",
                       args=[*ARGS, "--memory-cache", "64MiB"]) as svc, httpx.Client(timeout=30) as client:
        def epoch(seed: int) -> None:
            order = indices[:]
            random.Random(seed).shuffle(order)
            for start in range(0, len(order), 16):
                body = {"dataset": "train", "indices": order[start:start + 16]}
                assert client.post(f"{svc.url}/v1/batch", json=body).status_code == 200

        epoch(0)  # cold: every block from the store
        assert prom_ratio(svc.url) < 0.99
        seed = 1
        while prom_ratio(svc.url) < 0.99:
            assert seed < 500, "the warm epochs do not lift the ratio"
            epoch(seed)
            seed += 1
        moment = time.time()
        doc = wait_for_reading_after(svc.url, moment)
        assert doc["cache"]["hit_ratio"] >= 0.99 and doc["cache"]["hits"]["ram"] > 0
        assert doc["cache"]["hits"]["replica"] == doc["cache"]["hits"]["sibling"] == 0

        page = browser.new_page(viewport={"width": 1366, "height": 900})
        errors: list[str] = []
        page.on("pageerror", lambda err: errors.append(str(err)))
        page.goto(svc.url + "/")
        page.wait_for_function(f"() => Number(document.body.dataset.time) > {moment}", timeout=30_000)
        shown = page.evaluate("""() => Object.fromEntries([...document.querySelectorAll("[data-stat]")]
            .map((el) => [el.dataset.stat, el.textContent]))""")
        ratio = shown["cache.hit_ratio"]
        assert ratio.endswith(" %") and float(ratio[:-2]) >= 99, ratio
        assert float(shown["cache.hit_ratio_recent"][:-2]) >= 99  # the card: the last minute, all of it here
        ram = shown["cache.hits.ram"]
        assert int(ram.replace(",", "")) >= doc["cache"]["hits"]["ram"] > 0, ram  # a later reading: no fewer
        assert shown["cache.hits.replica"] == "0" and shown["cache.hits.sibling"] == "0"
        label = page.locator(".card .label", has_text="hit ratio").first.text_content()
        assert "replicas" in label, label
        assert page.locator("#registering-section").is_hidden()
        assert errors == []
        page.close()


# --- registrations in progress -------------------------------------------------------------------


def index_lock(cache_dir, url: str):
    """The lock the service takes to index the tar shards at ``url`` (``autoindex.IndexKeeper``)."""
    async def listing():
        store = open_store(url)
        try:
            return await store.list()
        finally:
            await store.close()
    with ThreadPoolExecutor(1) as thread:  # Playwright's loop runs in this one
        listed = thread.submit(asyncio.run, listing()).result()
    shards = sorted((i for i in listed if i.path.endswith(".tar")), key=lambda i: i.path)
    path = cache_dir / "indexes" / f"{dataset_id(url)}-{_versions_digest(shards)}.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    return open(path, "a")


def test_a_registration_is_listed_while_under_way_and_on_the_page(browser, dataset, tmp_path):
    """On the public port of ``--workers 2``: whichever worker answers, the host's list has it."""
    raw = tmp_path / "raw"
    make_dataset(dir_put(raw), samples=40, per_shard=10, seed=2, sizes=(100, 2000))
    (raw / "index.parquet").unlink()
    cache = tmp_path / "cache"
    with start_service({"train": dataset[0].as_uri()}, cache_dir=cache, args=ARGS, workers=2) as svc:
        assert stats(svc.url)["registering"] is None
        page = browser.new_page()
        errors: list[str] = []
        page.on("pageerror", lambda err: errors.append(str(err)))
        page.goto(svc.url + "/")
        page.wait_for_function("() => document.body.dataset.connected === 'yes'", timeout=30_000)
        # Holding the indexer's lock holds the registration where it waits for it: "opening".
        with index_lock(cache, str(raw)) as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            answer = httpx.post(f"{svc.url}/v1/datasets", json={"name": "raw", "url": str(raw)},
                                params={"wait": 0}, timeout=30)
            assert answer.status_code == 202, answer.text
            listed = [{"name": "raw", "url": str(raw), "indexing": None}]
            wait_until(lambda: stats(svc.url)["registering"] == listed, 10, "the registration listed")
            for _ in range(4):  # the answering worker, or its sibling
                doc = stats(svc.url)
                assert doc["workers_reporting"] == 2
                assert doc["registering"] == listed
            page.wait_for_function("() => !document.getElementById('registering-section').hidden", timeout=30_000)
            row = page.locator("#registering tr[data-name='raw']")
            assert row.locator("td").all_text_contents() == ["raw", "opening", str(raw)]
            fcntl.flock(lock, fcntl.LOCK_UN)
        wait_until(lambda: stats(svc.url)["registering"] is None, 30, "the registration done")
        # The client asks again for the outcome (which relays it to the other worker).
        again = httpx.post(f"{svc.url}/v1/datasets", json={"name": "raw", "url": str(raw)}, timeout=60)
        assert again.status_code == 200, again.text
        assert [d["name"] for d in stats(svc.url)["datasets"]] == ["train", "raw"]
        page.wait_for_function("() => document.getElementById('registering-section').hidden", timeout=30_000)

        # Indexing under way, as a worker reports it (the page's answers amended on the way).
        indexing = {"shards": 12, "bytes": 3 << 20, "done": 1321206, "fraction": 0.42, "seconds": 3.2}

        def amended(route):
            doc = route.fetch().json()
            route.fulfill(json={**doc, "registering": [{"name": "big", "url": "s3://b/big", "indexing": indexing}]})
        page.route("**/v1/stats*", amended)
        page.wait_for_function("() => !document.getElementById('registering-section').hidden", timeout=30_000)
        cells = page.locator("#registering tr[data-name='big'] td").all_text_contents()
        assert cells == ["big", "indexing 42 % of 12 shards' headers (3 MiB), 3.2 s", "s3://b/big"]
        page.screenshot(path=tmp_path / "registering.png", full_page=True)
        assert errors == []
        page.close()


def test_the_host_view_lists_each_registration_once_farthest_indexed():
    from shardfeed.service.api.status import host_registering

    opening = {"name": "raw", "url": "/d", "indexing": None}
    far = {"name": "raw", "url": "/d", "indexing": {"shards": 4, "bytes": 10, "done": 5, "fraction": 0.5,
                                                    "seconds": 1.0}}
    other = {"name": "more", "url": "/e", "indexing": None}
    parts = [{"registering": [opening]}, {"registering": [far, other]}, {"registering": []}, {}]
    assert host_registering(parts) == [far, other]
    assert host_registering([{"registering": []}]) == []
