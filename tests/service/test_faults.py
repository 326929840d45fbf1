"""Store faults: the service reads S3 through a fault-injecting proxy (503 SlowDown, 500,
resets mid-body, truncated bodies with a correct Content-Length, stalls past the read
timeout, latency spikes). Whatever happens, every sample a client receives is
byte-exact, or the request fails with a clear error; never a short or wrong sample.
The cache is off (size 0), so every request reads the store."""

from __future__ import annotations

import io
import random
import statistics
import time

import httpx
import pytest

from shardfeed.benchmarks.s3proxy import start_proxy
from shardfeed.benchmarks.soak import run_soak
from shardfeed.process import start_service

from common.datasets import bucket_dataset, flipped, make_dataset, s3_put
from common.reliability import expected_members, received_members, wrong_members
from common.service import metrics

pytestmark = pytest.mark.slow  # starts several services, S3 servers or a browser; not in `make check`

SAMPLES = 200  # 4 shards of 50 samples, 100 B to 20 KB each
SHARD_READS = r"^GET /[^?]*/shards/"


@pytest.fixture(scope="module")
def dataset(moto):
    return bucket_dataset(moto, "faults", samples=SAMPLES, per_shard=50)


@pytest.fixture(scope="module")
def proxy(moto):
    proxy = start_proxy(moto.endpoint)
    yield proxy
    proxy.stop()


def serve(dataset, moto, proxy, cache_dir, *args):
    """A service that reads the dataset through the proxy, with no cache."""
    return start_service({"train": dataset[0]}, cache_dir=cache_dir, cache_size="0",
                         env={**moto.env(), "AWS_ENDPOINT_URL": proxy.url},
                         args=["--block-size", "64KiB", "--store-timeout", "1", *args])


@pytest.fixture(scope="module")
def service(dataset, moto, proxy, tmp_path_factory):
    """Retries enough to ride out a few faults in a row (4 tries per read)."""
    with serve(dataset, moto, proxy, tmp_path_factory.mktemp("faults"), "--store-retries", "3") as svc:
        yield svc


@pytest.fixture(scope="module")
def fragile(dataset, moto, proxy, tmp_path_factory):
    """Gives up quickly (2 tries of 0.5 s at most per read), for faults that do not go away."""
    with serve(dataset, moto, proxy, tmp_path_factory.mktemp("fragile"), "--store-retries", "1",
               "--store-timeout", "0.5") as svc:
        yield svc


@pytest.fixture(autouse=True)
def no_faults_left(proxy):
    proxy.clear()
    yield
    proxy.clear()


def fetch_batch(url: str, body: dict) -> tuple[int, bytes, dict]:
    """Status, whatever body arrived (a stream may be cut short) and headers of a batch request."""
    data = bytearray()
    with httpx.stream("POST", f"{url}/v1/batch", json=body, timeout=60) as resp:
        try:
            for chunk in resp.iter_bytes():
                data += chunk
        except httpx.HTTPError:
            pass  # the service ended the stream early: what did arrive must still be exact
        return resp.status_code, bytes(data), dict(resp.headers)


@pytest.mark.parametrize("kind", ["503", "500", "reset", "truncate", "stall", "latency"])
def test_transient_store_faults_are_retried_and_every_byte_is_exact(service, dataset, proxy, kind):
    _, source = dataset
    rng = random.Random(kind)
    before = metrics(service.url)
    proxy.inject(kind, count=3, match=SHARD_READS, ms=300 if kind == "latency" else None)
    indices = [rng.randrange(SAMPLES) for _ in range(120)]
    status, body, _ = fetch_batch(service.url, {"dataset": "train", "indices": indices})
    assert status == 200
    got, ended = received_members(body)
    assert ended and got == expected_members(source, "train", indices)
    for i in rng.sample(range(SAMPLES), 10):
        resp = httpx.get(f"{service.url}/v1/datasets/train/samples/{i}/bin", timeout=60)
        assert resp.status_code == 200 and resp.content == source[(i, "bin")]
    assert proxy.counts.get(f"fault:{kind}", 0) >= 3  # the faults did hit the service
    after = metrics(service.url)
    assert after["shardfeed_store_errors_total"] == before["shardfeed_store_errors_total"]


@pytest.mark.parametrize("kind", ["503", "500", "reset", "truncate", "stall"])
def test_a_store_that_keeps_failing_gives_a_clear_error_or_404_entries_never_wrong_bytes(
        fragile, dataset, proxy, kind):
    _, source = dataset
    proxy.inject(kind, count=None, match=SHARD_READS + "part-0001", ms=5_000 if kind == "stall" else None)
    # Samples 50..99 live in the broken shard.
    resp = httpx.get(f"{fragile.url}/v1/datasets/train/samples/60/bin", timeout=60)
    assert resp.status_code == 503
    assert resp.headers["retry-after"]
    error = resp.json()["error"]
    assert error["code"] == "store_unavailable"
    assert "part-0001" in error["message"] and "60" in error["message"]

    indices = [10, 60, 150, 99, 0]
    status, body, _ = fetch_batch(fragile.url, {"dataset": "train", "indices": indices,
                                                "continue_on_error": True})
    assert status == 200
    got, ended = received_members(body)
    assert ended
    # A cut read's blocks that arrived whole are served (cut-through) and cached: a broken
    # shard's sample is its exact bytes or a 404 entry, never anything else.
    rest, missing = list(got), 0
    for i in indices:
        if 50 <= i < 100 and rest[0] == (f"__404__/train/{i}", b""):
            rest, missing = rest[1:], missing + 1
            continue
        want = expected_members(source, "train", [i])
        assert rest[:len(want)] == want
        rest = rest[len(want):]
    assert not rest and (missing or kind in ("reset", "truncate"))

    status, body, _ = fetch_batch(fragile.url, {"dataset": "train", "indices": [60, 99, 10]})
    assert status == 503  # the first group fails before any byte is sent: a real error status


def test_a_batch_failing_after_its_first_bytes_is_cut_short_never_wrong(fragile, dataset, proxy):
    _, source = dataset
    proxy.inject("503", count=None, match=SHARD_READS + "part-0003")
    # About 6 MB from healthy shards first (more than a group), so the response starts before
    # shard 3 is needed.
    indices = list(range(50)) * 12 + list(range(150, 200))
    status, body, _ = fetch_batch(fragile.url, {"dataset": "train", "indices": indices})
    assert status == 200
    got, ended = received_members(body)
    want = expected_members(source, "train", indices)
    assert not ended and 0 < len(got) < len(want)
    assert wrong_members(got, want) == 0


def test_a_shard_replaced_while_served_is_read_at_its_new_version_never_mixed(moto, tmp_path):
    moto.create_bucket("replaced")
    client = moto.client()
    source = make_dataset(s3_put(client, "replaced", "train"), samples=100, per_shard=50)
    with start_service({"train": "s3://replaced/train"}, cache_dir=tmp_path / "cache", cache_size="0",
                       env=moto.env(), args=["--block-size", "64KiB"]) as svc:
        assert httpx.get(f"{svc.url}/v1/datasets/train/samples/1/bin").content == source[(1, "bin")]
        before = httpx.get(f"{svc.url}/v1/datasets/train").json()["version"]
        key = "train/shards/part-0000.tar"
        old = client.get_object(Bucket="replaced", Key=key)["Body"].read()
        client.put_object(Bucket="replaced", Key=key, Body=flipped(old))  # same layout
        # The read of the old version is refused (If-Match), the dataset reopened, the sample
        # read again: the bytes the store holds now at the index's place, not a mix.
        resp = httpx.get(f"{svc.url}/v1/datasets/train/samples/40/bin")
        assert resp.status_code == 200
        assert resp.content == bytes(b ^ 0x5A for b in source[(40, "bin")])
        assert httpx.get(f"{svc.url}/v1/datasets/train").json()["version"] != before
        assert httpx.get(f"{svc.url}/v1/datasets/train/samples/60/bin").content == source[(60, "bin")]


def test_hedging_cuts_the_p99_of_reads_with_latency_spikes(dataset, moto, proxy, tmp_path):
    _, source = dataset
    spike_ms, reads = 600, 100  # 5 spikes: the p99 (the 99th of 100) is one unless hedged
    p99 = {}
    for hedge in ("--no-hedge", "--hedge"):
        with serve(dataset, moto, proxy, tmp_path / hedge, hedge, "--hedge-min-ms", "5") as svc:
            with httpx.Client(base_url=svc.url, timeout=30) as http:
                def get(i):
                    began = time.perf_counter()
                    resp = http.get(f"/v1/datasets/train/samples/{i}/bin")
                    assert resp.content == source[(i, "bin")]
                    return time.perf_counter() - began

                for i in range(40):  # learn the store's normal read time
                    get(i % SAMPLES)
                times = []
                for n in range(reads):
                    if n % 20 == 7:  # 5% of reads hit a latency spike
                        proxy.inject("latency", count=1, match=SHARD_READS, ms=spike_ms)
                    times.append(get(n % SAMPLES))
            hedges = metrics(svc.url).get("shardfeed_store_hedges_total", 0)
        p99[hedge] = sorted(times)[int(0.99 * (len(times) - 1))]
        print(f"{hedge}: p50 {1e3 * statistics.median(times):.1f} ms, p99 {1e3 * p99[hedge]:.1f} ms, "
              f"hedges {hedges:.0f}")
        if hedge == "--hedge":
            assert hedges >= reads // 20
    assert p99["--no-hedge"] >= spike_ms / 1e3
    assert p99["--hedge"] < p99["--no-hedge"] / 2


def test_the_soak_mode_runs_every_phase_and_delivers_no_wrong_byte():
    """A few seconds of ``python -m shardfeed.benchmarks.soak`` (its own moto, proxy and service)."""
    out = io.StringIO()
    tally = run_soak(duration=9, samples=600, workers=2, seed=1, out=out)
    total, report = tally["total"], out.getvalue()
    assert total["requests"] > 20 and total["faults"] > 0 and total["damaged"] > 0, report
    assert total["wrong"] == 0 and total["died"] == 0, report
    assert "| **all** |" in report


def test_a_change_that_cannot_be_reopened_now_is_a_409_and_is_read_once_the_store_answers(moto, proxy, tmp_path):
    url, source = bucket_dataset(moto, "reopen-later", samples=100, per_shard=50)
    client = moto.client()
    with serve((url, source), moto, proxy, tmp_path / "cache", "--store-retries", "1",
               "--block-size", "64KiB") as svc:
        key = "train/shards/part-0000.tar"
        old = client.get_object(Bucket="reopen-later", Key=key)["Body"].read()
        client.put_object(Bucket="reopen-later", Key=key, Body=flipped(old))
        proxy.inject("503", count=None, match=r"^HEAD .*index\.parquet")  # the reopen cannot read the index
        resp = httpx.get(f"{svc.url}/v1/datasets/train/samples/7/bin")
        assert resp.status_code == 409 and resp.json()["error"]["code"] == "dataset_changed"
        assert "send the request again" in resp.json()["error"]["message"] and resp.headers["Retry-After"]
        proxy.clear()
        resp = httpx.get(f"{svc.url}/v1/datasets/train/samples/7/bin")
        assert resp.status_code == 200 and resp.content == bytes(b ^ 0x5A for b in source[(7, "bin")])
