"""One worker of ``serve --workers 2`` SIGKILLed and restarted: the host's counters never go
down on the public port (``service/cluster/keptcounters.py``), and while the worker is down its
siblings read its block files rather than the store, writing nothing there (``coalescer.py``)."""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from shardfeed.process import child_pids, free_port, healthy, start_service, stop_process

from common.reliability import expected_members
from common.service import fetch_batch, metrics
from common.workers import (worker_blocks, directory_dataset, each_workers_shards, sibling_blocks, worker_pids,
                            worker_urls)
from common.wait import wait_until

pytestmark = pytest.mark.slow  # starts several services, S3 servers or a browser; not in `make check`

SAMPLES = 240
ARGS = ["--block-size", "64KiB", "--peer-timeout", "5"]
STREAM = "restart"
"""The stream every batch of the counter test names: its counts must carry over too."""


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    # 24 shards: each worker owns at least two but once in 300,000 placements.
    return directory_dataset(tmp_path_factory.mktemp("restart-data"), SAMPLES, per_shard=10)


def expected(source, indices):
    return expected_members(source, "train", indices)


def wait_for(condition, what: str, service, timeout: float = 60):
    try:
        return wait_until(condition, timeout, what)
    except AssertionError as err:
        raise AssertionError(f"{err}:\n{service.log()[-3000:]}") from None


class CounterWatch:
    """Scrapes of the public port, checked as Prometheus would read them: no sample of a
    counter or histogram (a stream's included), and no total of ``/v1/stats`` (a stream's
    included), ever lower than before."""

    def __init__(self, url: str):
        self.url = url
        self.highest: dict[tuple, float] = {}
        self.streams: dict[str, dict] = {}  # the last /v1/stats' figures by stream

    def scrape(self) -> dict[str, float]:
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        totals: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
                if family.type in ("counter", "histogram"):
                    self._check(("metrics", sample.name, tuple(sorted(sample.labels.items()))), sample.value)
        stats = httpx.get(f"{self.url}/v1/stats", timeout=10).json()
        for name, value in stats["totals"].items():
            if value is not None:
                self._check(("stats", name), value)
        self.streams = stats["streams"]
        for stream, figures in self.streams.items():
            for name in ("samples", "bytes"):
                self._check(("stats", stream, name), figures[name])
        return totals

    def _check(self, key: tuple, value: float) -> None:
        assert value >= self.highest.get(key, 0.0), f"{key} went down from {self.highest[key]} to {value}"
        self.highest[key] = value

    def served(self) -> float | None:
        """Samples the host served, once its metrics and its status figures say the same of the
        stream every batch named (None otherwise)."""
        totals = self.scrape()
        served = totals["shardfeed_samples_served_total"]
        stream = (totals.get("shardfeed_stream_samples_served_total"), self.streams.get(STREAM, {}).get("samples"))
        return served if stream == (served, served) else None


def test_the_host_counters_never_go_down_while_a_worker_restarts_and_its_counts_carry_over(dataset, tmp_path):
    url, source = dataset
    rng = random.Random(11)
    with start_service({"train": url}, cache_dir=tmp_path / "cache", workers=2,
                       args=[*ARGS, "--restart-pause", "2"]) as svc:
        watch = CounterWatch(svc.url)
        urls = worker_urls(svc.url)
        served = 0

        def serve(via: str, n: int = 30) -> None:
            nonlocal served
            batch = rng.sample(range(SAMPLES), n)
            assert fetch_batch(via, batch, stream=STREAM) == expected(source, batch)
            served += n
            watch.scrape()

        for via in [*urls, svc.url, svc.url, svc.url]:  # each worker's own port: both count some
            serve(via)
        wait_for(lambda: watch.served() == served, "the host never counted what it served", svc)
        own = [metrics(u)["shardfeed_samples_served_total"] for u in urls]
        assert all(own) and sum(own) == served

        first = worker_pids(svc)
        os.kill(first[1], signal.SIGKILL)
        dead = wait_for(lambda: [i for i, u in enumerate(urls) if not healthy(u)], "no worker went down", svc)[0]
        while True:  # down for about 2 s: scrapes and batches land on the other
            serve(svc.url, 10)
            # Exact: the dead worker's count is read from its kept files.
            wait_for(lambda: watch.served() == served, "the host lost the dead worker's count", svc)
            if healthy(urls[dead]):
                break

        def restarted() -> list[int] | None:
            pids = worker_pids(svc)
            return pids if len(pids) == 2 and first[1] not in pids else None

        pids = wait_for(restarted, "the worker was not restarted", svc)
        assert first[0] in pids and "restarting it in 2.0 s" in svc.log()
        # The successor counts on from its predecessor's counts, on its own port too.
        assert metrics(urls[dead])["shardfeed_samples_served_total"] >= own[dead]
        for via in [*urls, svc.url]:
            serve(via)
        wait_for(lambda: watch.served() == served, "the host's total lost the dead worker's count", svc)
        # Counters, and gauges (the live processes': the successor's cache starts from what is
        # on disk), are the workers' own added up, once the last batches' counts have landed.
        names = ("shardfeed_samples_served_total", "shardfeed_bytes_served_total", "shardfeed_batch_seconds_count",
                 "shardfeed_store_requests_total", "shardfeed_cache_bytes", "shardfeed_stream_samples_served_total",
                 "shardfeed_stream_bytes_served_total")

        def consistent() -> bool:
            own = [metrics(u) for u in urls]
            host = watch.scrape()
            return host["shardfeed_workers_reporting"] == 2 and all(host[n] == sum(m[n] for m in own) for n in names)

        wait_for(consistent, "the host's sums never matched the workers' own figures", svc)


def store_reads(url: str) -> float:
    return metrics(url)["shardfeed_store_requests_total"]


def directory_state(directory: Path) -> dict[str, tuple]:
    """Every file under ``directory`` with what a write, a rename or an unlink would change."""
    return {str(p.relative_to(directory)): (p.stat().st_ino, p.stat().st_size, p.stat().st_mtime_ns)
            for p in directory.rglob("*") if p.is_file()}


def test_a_dead_workers_block_files_are_read_until_it_restarts_and_nothing_is_written_there(dataset, tmp_path):
    url, source = dataset
    cache = tmp_path / "cache"
    # A restart far away: the test reads while the worker is down.
    with start_service({"train": url}, cache_dir=cache, workers=2, args=[*ARGS, "--restart-pause", "600"]) as svc:
        urls = worker_urls(svc.url)
        shards = each_workers_shards(svc.url, urls, SAMPLES, at_least=2)
        warm = [[i for shard in s[:len(s) // 2] for i in shard] for s in shards]  # half of each worker's shards
        def settled(via: str, batch: list[int]) -> bool:
            """Whether a pass read nothing from the store and every block ``via`` fetched is on
            its disk (a fetched block is served from RAM while it is being written)."""
            before = store_reads(via)
            assert fetch_batch(via, batch) == expected(source, batch)
            figures = metrics(via)
            return (figures["shardfeed_store_requests_total"] == before
                    and figures["shardfeed_cache_blocks"] == figures["shardfeed_cache_misses_total"])

        for u, batch in zip(urls, warm):  # through its own port: each worker caches its own half
            wait_for(lambda: settled(u, batch), "the warm blocks never all reached the disk", svc)
        assert store_reads(urls[0]) and store_reads(urls[1])

        os.kill(worker_pids(svc)[1], signal.SIGKILL)
        dead = wait_for(lambda: [i for i, u in enumerate(urls) if not healthy(u)], "no worker went down", svc)[0]
        alive = urls[1 - dead]
        wait_for(lambda: not httpx.get(f"{alive}/v1/cluster", timeout=10).json()["workers"][dead]["up"],
                 "the survivor never saw its sibling down", svc)
        files = cache / f"worker-{dead}"
        left = directory_state(files)
        held = worker_blocks(cache, dead)
        assert held

        # Its warm half: every block from its files, none from the store.
        reads, read_files = store_reads(alive), sibling_blocks(alive, "read")
        batch = random.Random(12).sample(warm[dead], len(warm[dead]))
        assert fetch_batch(alive, batch) == expected(source, batch)
        assert store_reads(alive) == reads, "blocks in the dead worker's files were read from the store"
        assert sibling_blocks(alive, "read") > read_files

        # All of its shards: what its files lack comes from the store, cached by the survivor.
        everything = [i for shard in shards[dead] for i in shard]
        random.Random(13).shuffle(everything)
        assert fetch_batch(alive, everything) == expected(source, everything)
        assert store_reads(alive) > reads
        wait_for(lambda: settled(alive, everything), "the survivor never cached what the files lack", svc)
        assert directory_state(files) == left, "another worker wrote into the dead worker's directory"
        survivor = worker_blocks(cache, 1 - dead)
        assert survivor - held and not survivor & held, "a block the dead worker's files hold was cached again"
        assert "restarting it in 600.0 s" in svc.log() and not healthy(urls[dead])


def test_a_worker_killed_before_it_serves_is_restarted_and_one_that_fails_stops_the_service(tmp_path):
    """Only an exit with an error before serving (a bad dataset, an unreadable cache) is a
    failed start; a worker killed by a signal while it starts (the OOM killer during a long
    index build) is restarted like any crash."""
    silent = socket.create_server(("127.0.0.1", 0))  # an S3 endpoint that never answers: opening hangs
    env = {**os.environ, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{silent.getsockname()[1]}",
           "AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s"}
    command = [sys.executable, "-m", "shardfeed", "serve", "--workers", "2", "--port", str(free_port()),
               "--cache-dir", str(tmp_path / "cache"), "--restart-pause", "0.1", "--dataset", "train=s3://b/d"]
    with open(tmp_path / "serve.log", "wb") as log:
        serve = subprocess.Popen(command, env=env, stdout=log, stderr=log)
    try:
        deadline = time.monotonic() + 30
        while len(child_pids(serve.pid)) < 2:
            assert time.monotonic() < deadline and serve.poll() is None, (tmp_path / "serve.log").read_text()
            time.sleep(0.1)
        first = child_pids(serve.pid)
        os.kill(first[0], signal.SIGKILL)
        while "restarting it" not in (tmp_path / "serve.log").read_text():
            assert time.monotonic() < deadline and serve.poll() is None, (tmp_path / "serve.log").read_text()
            time.sleep(0.1)
        while len(child_pids(serve.pid)) < 2:  # its successor is starting
            assert time.monotonic() < deadline and serve.poll() is None, (tmp_path / "serve.log").read_text()
            time.sleep(0.1)
        assert first[0] not in child_pids(serve.pid) and serve.poll() is None
    finally:
        stop_process(serve)
        silent.close()
    bad = subprocess.run([sys.executable, "-m", "shardfeed", "serve", "--workers", "2", "--port", str(free_port()),
                          "--cache-dir", str(tmp_path / "cache2"), "--dataset", f"train={(tmp_path / 'none').as_uri()}"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1
    assert "exited before serving" in bad.stderr and "none: no such directory" in bad.stderr, bad.stderr
    assert "Traceback" not in bad.stderr
