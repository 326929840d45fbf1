"""Load: thousands of concurrent per-sample GETs and dozens of concurrent large batches on
one service, with every byte checked and the service's peak memory bounded; admission
control (429 + Retry-After) under limits set low, with shardfeed clients that back off
and succeed; and a graceful shutdown that finishes the responses in flight."""

from __future__ import annotations

import asyncio
import random
import signal
import socket
import threading
import time

import aiohttp
import httpx
import pytest

from shardfeed.client import AsyncClient
from shardfeed.process import start_service

from common.datasets import bucket_dataset
from common.reliability import expected_members, peak_rss_mib, received_members
from common.service import metrics

pytestmark = pytest.mark.slow  # starts several services, S3 servers or a browser; not in `make check`

SAMPLES = 1000  # 1 to 10 KB each, 4 shards
RSS_LIMIT_MIB = 1024


@pytest.fixture(scope="module")
def dataset(moto):
    return bucket_dataset(moto, "load", samples=SAMPLES, per_shard=250, sizes=(1000, 10_000))


@pytest.fixture(scope="module")
def service(dataset, moto, tmp_path_factory):
    with start_service({"train": dataset[0]}, cache_dir=tmp_path_factory.mktemp("load") / "cache",
                       env=moto.env(), args=["--max-batch", "4096"]) as svc:
        yield svc


async def gather_gets(url: str, wanted: list[tuple[int, str]], connections: int) -> list[tuple[int, bytes]]:
    connector = aiohttp.TCPConnector(limit=connections)
    async with aiohttp.ClientSession(url, connector=connector, timeout=aiohttp.ClientTimeout(total=120)) as http:
        async def get(i: int, field: str) -> tuple[int, bytes]:
            async with http.get(f"/v1/datasets/train/samples/{i}/{field}") as resp:
                return resp.status, await resp.read()
        return await asyncio.gather(*(get(i, f) for i, f in wanted))


async def gather_batches(url: str, batches: list[list[int]]) -> list[tuple[int, bytes, dict]]:
    connector = aiohttp.TCPConnector(limit=len(batches))
    async with aiohttp.ClientSession(url, connector=connector, timeout=aiohttp.ClientTimeout(total=300)) as http:
        async def post(indices: list[int]) -> tuple[int, bytes, dict]:
            async with http.post("/v1/batch", json={"dataset": "train", "indices": indices}) as resp:
                return resp.status, await resp.read(), dict(resp.headers)
        return await asyncio.gather(*(post(b) for b in batches))


def test_2000_concurrent_per_sample_gets(service, dataset):
    _, source = dataset
    rng = random.Random(1)
    wanted = [(rng.randrange(SAMPLES), rng.choice(["bin", "cls"])) for _ in range(2000)]
    began = time.perf_counter()
    answers = asyncio.run(gather_gets(service.url, wanted, connections=2000))
    seconds = time.perf_counter() - began
    assert [status for status, _ in answers] == [200] * 2000
    wrong = sum(body != source[w] for (_, body), w in zip(answers, wanted))
    assert wrong == 0
    m = metrics(service.url)
    print(f"2000 concurrent GETs: {seconds:.1f} s, {m['shardfeed_store_requests_total']:.0f} store reads, "
          f"peak RSS {peak_rss_mib(service.process.pid):.0f} MiB")
    assert m["shardfeed_store_requests_total"] < 100
    assert peak_rss_mib(service.process.pid) < RSS_LIMIT_MIB


def test_64_concurrent_large_batches(service, dataset):
    _, source = dataset
    rng = random.Random(2)
    batches = [[rng.randrange(SAMPLES) for _ in range(1000)] for _ in range(64)]
    began = time.perf_counter()
    answers = asyncio.run(gather_batches(service.url, batches))
    seconds = time.perf_counter() - began
    assert [status for status, _, _ in answers] == [200] * 64
    wrong = 0
    for (_, body, _), indices in zip(answers, batches):
        got, ended = received_members(body)
        assert ended
        want = expected_members(source, "train", indices)
        wrong += sum(g != w for g, w in zip(got, want)) + abs(len(got) - len(want))
    assert wrong == 0
    served = sum(len(body) for _, body, _ in answers)
    rss = peak_rss_mib(service.process.pid)
    print(f"64 concurrent batches of 1000: {served / 2**20:.0f} MiB in {seconds:.1f} s, peak RSS {rss:.0f} MiB")
    assert rss < RSS_LIMIT_MIB


def test_overload_is_refused_with_429_and_clients_that_back_off_succeed(dataset, moto, tmp_path):
    _, source = dataset
    rng = random.Random(3)
    batches = [[rng.randrange(SAMPLES) for _ in range(500)] for _ in range(12)]
    # Retry-After is a fixed 1 s and clients honour it exactly, so the refused ones come back
    # together: about 12 / 3 rounds, within the client's 6 tries.
    # No RAM tier: a per-sample GET answered from RAM holds its slot for no time at all, so
    # only reads that wait (on disk or the store) can pile up to be refused.
    with start_service({"train": dataset[0]}, cache_dir=tmp_path / "cache", env=moto.env(),
                       args=["--max-inflight-batches", "3", "--max-inflight-samples", "8",
                             "--memory-cache", "0"]) as svc:
        answers = asyncio.run(gather_batches(svc.url, batches))
        refused = [a for a in answers if a[0] == 429]
        assert refused and all(a[0] in (200, 429) for a in answers)
        assert all(headers["Retry-After"] == "1" and b'"overloaded"' in body for _, body, headers in refused)
        assert metrics(svc.url)["shardfeed_rejected_total"] >= len(refused)

        wanted = [(rng.randrange(SAMPLES), "bin") for _ in range(300)]
        gets = asyncio.run(gather_gets(svc.url, wanted, connections=300))
        assert {status for status, _ in gets} <= {200, 429} and any(s == 429 for s, _ in gets)

        async def politely():
            async with AsyncClient(svc.url, max_connections=32) as client:
                got_batches = await asyncio.gather(*(client.get_batch("train", b) for b in batches))
                got_fields = await asyncio.gather(*(client.get_field("train", i, f) for i, f in wanted))
            return got_batches, got_fields

        got_batches, got_fields = asyncio.run(politely())
        for samples, indices in zip(got_batches, batches):
            assert [s["bin"] for s in samples] == [source[(i, "bin")] for i in indices]
        assert got_fields == [source[w] for w in wanted]


def test_sigterm_finishes_inflight_batches_refuses_new_connections_and_exits_0(dataset, moto, tmp_path):
    _, source = dataset
    indices = [random.Random(4).randrange(SAMPLES) for _ in range(2000)]
    svc = start_service({"train": dataset[0]}, cache_dir=tmp_path / "cache", env=moto.env(),
                        args=["--max-batch", "4096"])
    host, port = svc.url.removeprefix("http://").split(":")
    started = threading.Barrier(5)
    bodies: list[bytes] = [b""] * 4

    def slow_reader(k: int) -> None:
        with httpx.stream("POST", f"{svc.url}/v1/batch", json={"dataset": "train", "indices": indices},
                          timeout=60) as resp:
            chunks = resp.iter_raw(65536)
            data = next(chunks)
            started.wait()
            for chunk in chunks:
                data += chunk
                time.sleep(0.002)  # a slow reader: the batch is still streaming after the SIGTERM
            bodies[k] = data

    readers = [threading.Thread(target=slow_reader, args=(k,)) for k in range(4)]
    for t in readers:
        t.start()
    try:
        started.wait(timeout=30)
        svc.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 5
        while True:  # the listening socket closes at once
            try:
                socket.create_connection((host, int(port)), timeout=1).close()
            except ConnectionRefusedError:
                break
            assert time.monotonic() < deadline, "still accepting connections after SIGTERM"
            time.sleep(0.05)
        for t in readers:
            t.join(60)
        assert svc.process.wait(30) == 0
    finally:
        svc.stop()
    want = expected_members(source, "train", indices)
    for body in bodies:
        got, ended = received_members(body)
        assert ended and got == want
    assert "Traceback" not in svc.log()
