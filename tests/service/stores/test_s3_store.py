"""S3Store against real S3 servers (SeaweedFS and moto, SigV4 checked), and through the fault-injecting
proxy (on moto)."""

import asyncio
import hashlib
import json
import os
import subprocess
import sys
import time

import httpx
import pytest

from prometheus_client import CollectorRegistry

from shardfeed.benchmarks.s3proxy import start_proxy
from shardfeed.process import free_port
from shardfeed.retry import Backoff
from shardfeed.service.config import HedgePolicy
from shardfeed.service.stores.hedge import HEDGED_BYTES, Hedger
from shardfeed.service.stores import (
    AccessDenied, InvalidPath, ObjectChanged, ObjectNotFound, ShortRead, StoreUnavailable, open_store,
)

FAST = Backoff(attempts=4, base=0.01, cap=0.05)
DATA = os.urandom(256 << 10)


def run(coro):
    return asyncio.run(coro)


def s3(bucket: str, prefix: str = "data", **options):
    return open_store(f"s3://{bucket}/{prefix}", **{"backoff": FAST, **options})


@pytest.fixture(scope="module")
def proxy(moto):
    proxy = start_proxy(moto.endpoint)
    yield proxy
    proxy.stop()


@pytest.fixture
def via_proxy(proxy, bucket):
    """Run ``body(store)`` in one event loop with a store that reaches moto through the
    proxy, after writing ``shard.bin`` (= DATA). The read timeout is long enough that only an
    injected stall trips it, however loaded the machine (the stall test shortens it)."""
    proxy.clear()

    def go(body, read_timeout: float = 5):
        async def main():
            async with s3(bucket, endpoint_url=proxy.url, read_timeout=read_timeout) as store:
                await store.write("shard.bin", DATA)
                return await body(store)
        return run(main())

    yield go
    proxy.clear()


def run_clean(proxy, main) -> None:
    """``run(main())`` with no fault queued on ``proxy`` before or after it."""
    proxy.clear()
    try:
        run(main())
    finally:
        proxy.clear()


@pytest.mark.both_s3
def test_write_read_list_head_round_trip(bucket):
    async def go():
        async with s3(bucket) as store:
            await store.write("b/two.bin", b"second")
            await store.write("a one+.bin", DATA)
            assert await store.read("a one+.bin") == DATA
            assert await store.read_range("a one+.bin", 1000, 65536) == DATA[1000:1000 + 65536]
            pieces = await store.read_pieces("a one+.bin", 1000, 65536 + 7, 16384)
            assert [len(p) for p in pieces] == [16384] * 4 + [7]
            assert b"".join(pieces) == DATA[1000:1000 + 65536 + 7]
            assert await store.read_pieces("a one+.bin", 5, 100, 4096) == [DATA[5:105]]
            head = await store.head("b/two.bin")
            assert (head.path, head.size, head.etag) == ("b/two.bin", 6, hashlib.md5(b"second").hexdigest())
            listed = [(o.path, o.size) for o in await store.list()]
            assert listed == [("a one+.bin", len(DATA)), ("b/two.bin", 6)]
            assert [o.path for o in await store.list("b/")] == ["b/two.bin"]
            assert store.retries == 0
            return store.requests, store.bytes_read

    requests, bytes_read = run(go())
    assert requests == 9  # 2 PUT, GET, 3 ranged GETs, HEAD, 2 list pages
    assert bytes_read > len(DATA) + 2 * 65536  # the reads plus the two listing pages


@pytest.mark.both_s3
def test_list_pages_through_everything_sorted_and_stays_inside_the_prefix(bucket):
    async def go():
        async with s3(bucket) as store, s3(bucket, prefix="data2") as sibling:
            names = [f"part-{i:02d}" for i in range(23)]
            await asyncio.gather(*(store.write(n, n.encode()) for n in reversed(names)),
                                 sibling.write("other", b"x"))
            store.list_page_size = 5
            listed = await store.list()
            assert [o.path for o in listed] == names
            assert [o.size for o in listed] == [7] * 23
            assert store.requests == 23 + 5  # 23 PUTs, then 5 pages of at most 5 keys

    run(go())


@pytest.mark.both_s3
def test_read_range_checks_the_range_against_the_object(bucket):
    async def go():
        async with s3(bucket) as store:
            await store.write("small", b"0123456789")
            assert await store.read_range("small", 0, 10) == b"0123456789"
            assert await store.read_range("small", 9, 1) == b"9"
            assert await store.read_range("small", 3, 0) == b""
            with pytest.raises(ShortRead, match="object is 10 bytes"):
                await store.read_range("small", 5, 10)
            with pytest.raises(ShortRead, match="past the end"):
                await store.read_range("small", 20, 1)
            assert store.retries == 0  # a short object is not a transient fault

    run(go())


@pytest.mark.parametrize("path", ["../escape", "a/../../escape", "/etc/passwd", "", "a\\b"])
def test_paths_escaping_the_prefix_are_refused(bucket, path):
    async def go():
        async with s3(bucket) as store:
            for call in (store.read(path), store.read_range(path, 0, 1), store.head(path),
                         store.write(path, b"x")):
                with pytest.raises(InvalidPath):
                    await call
            assert store.requests == 0

    run(go())


@pytest.mark.both_s3
def test_a_wrongly_signed_request_is_access_denied_without_retries(bucket, monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")

    async def go():
        async with s3(bucket) as store:
            with pytest.raises(AccessDenied, match=f"s3://{bucket}/data/x.*SignatureDoesNotMatch"):
                await store.read("x")
            assert (store.requests, store.retries) == (1, 0)
            # A HEAD's error has no body: asked again as a one-byte GET, it says why all the same.
            with pytest.raises(AccessDenied, match=f"s3://{bucket}/data/x.*SignatureDoesNotMatch"):
                await store.head("x")

    run(go())


@pytest.mark.both_s3
def test_missing_bucket_and_object_are_object_not_found(bucket):
    async def go():
        async with s3("no-such-bucket") as store:
            with pytest.raises(ObjectNotFound, match="bucket 'no-such-bucket' does not exist"):
                await store.read_range("x", 0, 10)
            with pytest.raises(ObjectNotFound, match="no-such-bucket"):
                await store.list()
        async with s3(bucket) as store:
            with pytest.raises(ObjectNotFound, match=f"s3://{bucket}/data/missing: no such object"):
                await store.read("missing")
            with pytest.raises(ObjectNotFound):
                await store.head("missing")
            assert store.retries == 0

    run(go())


def test_unreachable_endpoint_is_store_unavailable_within_seconds(s3_env):
    endpoint = f"http://127.0.0.1:{free_port()}"  # nothing listens there

    async def go():
        async with s3("bucket", endpoint_url=endpoint) as store:
            waits, count = [], store._count_retry
            store._count_retry = lambda err, delay: (waits.append(delay), count(err, delay))
            with pytest.raises(StoreUnavailable, match=f"cannot connect to S3 endpoint {endpoint}.*4 att"):
                await store.read_range("x", 0, 10)
            assert store.requests == 4
            assert len(waits) == 3 and sum(waits) < 3  # refused at once; only the backoff's waits between

    run(go())


def test_injected_503s_are_retried_and_the_read_returns_the_right_bytes(via_proxy, proxy):
    async def body(store):
        proxy.inject("503", count=2, match="^GET ")
        assert await store.read_range("shard.bin", 4096, 65536) == DATA[4096:4096 + 65536]
        assert store.retries == 2
        assert proxy.counts["fault:503"] == 2

    via_proxy(body)


@pytest.mark.parametrize("kind", ["truncate", "reset"])
def test_cut_bodies_are_retried_and_never_returned(via_proxy, proxy, kind):
    async def body(store):
        proxy.inject(kind, count=2, match="^GET ")
        assert await store.read_range("shard.bin", 100, 100_000) == DATA[100:100_100]
        proxy.inject(kind, count=1, match="^GET ")
        assert await store.read("shard.bin") == DATA
        proxy.inject(kind, count=1, match="^GET ")
        assert b"".join(await store.read_pieces("shard.bin", 100, 100_000, 8192)) == DATA[100:100_100]
        assert store.retries == 4
        assert proxy.counts[f"fault:{kind}"] >= 4

    via_proxy(body)


def test_a_body_cut_on_every_try_is_a_short_read(via_proxy, proxy):
    async def body(store):
        proxy.inject("truncate", count=None, match="^GET ")
        with pytest.raises(ShortRead, match="shard.bin: body cut short.*after 4 attempts"):
            await store.read_range("shard.bin", 0, 100_000)
        with pytest.raises(ShortRead, match="shard.bin: body cut short.*after 4 attempts"):
            await store.read_pieces("shard.bin", 0, 100_000, 8192)

    via_proxy(body)


def test_persistent_503_is_store_unavailable_after_the_configured_attempts(via_proxy, proxy):
    async def body(store):
        proxy.inject("503", count=None, match="^GET ")
        before = proxy.counts.get("GET", 0)
        with pytest.raises(StoreUnavailable, match="shard.bin: S3 answered HTTP 503 .SlowDown.*after 4"):
            await store.read_range("shard.bin", 0, 10)
        assert proxy.counts["GET"] - before == 4
        assert store.retries == 3

    via_proxy(body)


def test_a_stall_past_the_read_timeout_is_retried(via_proxy, proxy):
    async def body(store):
        proxy.inject("stall", count=1, ms=5000, match="^GET ")
        assert await store.read_range("shard.bin", 0, 1000) == DATA[:1000]
        assert store.retries == 1  # the stalled try timed out (waited out, it would have answered)

    via_proxy(body, read_timeout=0.5)


@pytest.mark.parametrize("kind", ["stall", "hang"], ids=["no-first-byte", "silent-mid-body"])
def test_a_read_gone_silent_is_asked_again_in_seconds_not_after_the_read_timeout(proxy, bucket, kind):
    async def main():
        async with s3(bucket, endpoint_url=proxy.url, read_timeout=30, first_byte_timeout=1,
                      progress_timeout=0.5) as store:
            await store.write("shard.bin", DATA)
            before = proxy.counts.get("GET range", 0)
            proxy.inject(kind, count=1, ms=60_000, match="^GET ")
            began = time.monotonic()
            assert await store.read_range("shard.bin", 0, len(DATA)) == DATA
            assert time.monotonic() - began < 10  # not the 30 s read timeout, nor the 60 s silence
            assert store.retries == 1 and proxy.counts["GET range"] - before == 2

    run_clean(proxy, main)


def test_retries_spend_no_hedges_and_late_reads_still_get_them(proxy, bucket):
    hedger = Hedger(HedgePolicy(min_delay=0.02, max_delay=0.02), CollectorRegistry())

    async def main():
        raw = s3(bucket, endpoint_url=proxy.url, backoff=Backoff(attempts=5, base=0.2, cap=0.2))
        async with raw:
            await raw.write("shard.bin", DATA)
            store = hedger.wrap(raw)
            before = proxy.counts.get("GET range", 0)
            proxy.inject("503", count=3, match="^GET ")  # failing, not late: retried, never hedged
            assert await store.read_range("shard.bin", 0, 1000) == DATA[:1000]
            assert (hedger.hedges._value.get(), proxy.counts["GET range"] - before) == (0, 4)
            proxy.inject("latency", count=1, ms=1000, match="^GET ")  # late: hedged, the hedge wins
            assert await store.read_range("shard.bin", 0, 1000) == DATA[:1000]
            assert (hedger.hedges._value.get(), hedger.wins._value.get()) == (1, 1)

    run_clean(proxy, main)


def test_a_large_read_is_never_hedged_and_a_small_late_one_is(proxy, bucket):
    """A run of blocks is not hedged, however late (its copy would read every byte again);
    a read of a block is."""
    hedger = Hedger(HedgePolicy(min_delay=0.05, max_delay=0.05), CollectorRegistry())
    large = HEDGED_BYTES + 1
    data = DATA * (large // len(DATA) + 1)

    async def main():
        raw = s3(bucket, endpoint_url=proxy.url)
        async with raw:
            await raw.write("big.bin", data)
            store = hedger.wrap(raw)
            before = proxy.counts.get("GET range", 0)
            proxy.inject("latency", count=1, ms=400, match="^GET ")
            pieces = await store.read_pieces("big.bin", 0, large, 1 << 20)
            assert b"".join(pieces) == data[:large]
            assert (hedger.hedges._value.get(), proxy.counts["GET range"] - before) == (0, 1)
            proxy.inject("latency", count=1, ms=1000, match="^GET ")  # a block, late: hedged, the hedge wins
            assert b"".join(await store.read_pieces("big.bin", 0, 65536, 16384)) == data[:65536]
            assert (hedger.hedges._value.get(), hedger.wins._value.get()) == (1, 1)

    run_clean(proxy, main)


def test_the_store_works_again_under_a_new_event_loop(bucket):
    store = s3(bucket)
    run(store.write("x", b"abc"))
    assert run(store.read("x")) == b"abc"  # asyncio.run closed the first loop
    run(store.close())


@pytest.mark.both_s3
def test_objects_of_tens_of_mib_round_trip(bucket):
    big = os.urandom(24 << 20)

    async def go():
        async with s3(bucket) as store:
            await store.write("big.bin", big)
            assert (await store.head("big.bin")).size == len(big)
            start = (20 << 20) + 7
            assert await store.read_range("big.bin", start, 1 << 20) == big[start:start + (1 << 20)]

    run(go())


def test_the_proxy_subprocess_adds_latency_and_takes_faults_over_http(moto, bucket):
    proc = subprocess.Popen(
        [sys.executable, "-m", "shardfeed.benchmarks.s3proxy", "--upstream", moto.endpoint,
         "--latency-ms", "100"], stdout=subprocess.PIPE, text=True)
    try:
        url = proc.stdout.readline().split()[3]  # "s3proxy listening on URL -> ..."
        fault = {"kind": "503", "count": 1, "match": "^GET "}
        httpx.post(f"{url}/_proxy/inject", json=fault).raise_for_status()

        async def go():
            async with s3(bucket, endpoint_url=url) as store:
                await store.write("x", b"payload")
                start = time.monotonic()
                assert await store.read("x") == b"payload"
                return store.retries, time.monotonic() - start

        retries, elapsed = run(go())
        assert retries == 1
        assert elapsed >= 0.2  # two GETs, each delayed 100 ms
        assert httpx.get(f"{url}/_proxy/counts").json() == {
            "requests": 3, "PUT": 1, "GET": 2, "fault:503": 1}
        assert httpx.get(f"{url}/_proxy/bytes").json() == {"read": len(b"payload")}  # the GET upstream answered
        assert httpx.post(f"{url}/_proxy/inject", json={"kind": "boom"}).status_code == 400
    finally:
        proc.terminate()
        assert proc.wait(10) == 0


@pytest.mark.both_s3
def test_refreshed_credentials_are_used_on_the_next_request(s3_env, bucket, tmp_path, monkeypatch):
    # A credential_process whose credentials always expire within minutes: botocore refreshes
    # them on every use, so rotating the file rotates the key the store signs with.
    creds = tmp_path / "creds.json"
    config = tmp_path / "config"
    config.write_text(f"[profile rotating]\ncredential_process = cat {creds}\n")
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(key)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(config))
    monkeypatch.setenv("AWS_PROFILE", "rotating")

    def rotate(secret: str) -> None:
        expiry = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + 300))
        creds.write_text(json.dumps({"Version": 1, "AccessKeyId": s3_env.access_key,
                                     "SecretAccessKey": secret, "Expiration": expiry}))

    async def go():
        async with s3(bucket) as store:
            rotate("stale-secret")
            with pytest.raises(AccessDenied):
                await store.write("x", b"1")
            rotate(s3_env.secret_key)
            await store.write("x", b"1")
            assert await store.read("x") == b"1"

    run(go())


def test_a_read_of_a_version_is_refused_once_the_object_is_replaced(bucket):
    async def main():
        async with s3(bucket) as store:
            await store.write("c", DATA)
            listed = {info.path: info for info in await store.list()}["c"]
            head = await store.head("c")
            assert listed.etag == head.etag and listed.etag
            assert await store.read_range("c", 0, 10, head.etag) == DATA[:10]
            assert await store.read("c", head.etag) == DATA
            await store.write("c", DATA[::-1])  # same size, other bytes
            for read in (store.read_range("c", 0, 10, head.etag), store.read("c", head.etag),
                         store.read_pieces("c", 0, 2 * len(DATA) // 3, len(DATA) // 3, head.etag)):
                with pytest.raises(ObjectChanged, match="replaced in the store"):
                    await read
            assert await store.read_range("c", 0, 10) == DATA[::-1][:10]  # no version: whatever is there
            assert await store.read_range("c", 0, 10, (await store.head("c")).etag) == DATA[::-1][:10]

    run(main())
