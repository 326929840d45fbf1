"""The service end to end: real S3 servers (round trips on SeaweedFS and moto), the service as a
subprocess, HTTP over a socket."""

from __future__ import annotations

import asyncio
import json
import random
import socket
import subprocess
import time
from pathlib import Path

import aiohttp
import httpx
import pytest

from shardfeed.process import launch_service, start_service

from common.cli import refusals
from common.datasets import bucket_dataset, make_dataset, s3_put
from common.reliability import cached_blocks, damage_block
from common.service import metrics, tar_members

pytestmark = pytest.mark.xdist_group("service")  # one worker: its module services start once

SAMPLES = 200


@pytest.fixture(scope="module")
def s3_dataset(s3_server):
    """A 200-sample dataset (4 shards) on the S3 server; returns (url, source bytes)."""
    return bucket_dataset(s3_server, "svc-data", samples=SAMPLES, per_shard=50)


def serve_train(s3_dataset, s3_server, cache_dir):
    """A service on the S3 dataset; small blocks so a shard spans several."""
    return start_service({"train": s3_dataset[0]}, cache_dir=cache_dir, env=s3_server.env(),
                         args=["--block-size", "64KiB", "--max-batch", "5000"])


@pytest.fixture
def service(s3_dataset, s3_server, tmp_path):
    """A service with a fresh cache."""
    with serve_train(s3_dataset, s3_server, tmp_path / "cache") as svc:
        yield svc


@pytest.fixture(scope="module")
def shared_service(s3_dataset, s3_server, tmp_path_factory):
    """One service for the tests that check only the bytes they read (cold or warm alike) or
    send only requests it must refuse: they share it."""
    with serve_train(s3_dataset, s3_server, tmp_path_factory.mktemp("shared") / "cache") as svc:
        yield svc


def expected(source, indices, fields=None):
    out = []
    for i in indices:
        for field in fields or ("bin", "cls", "json"):
            if (i, field) in source:
                out.append((f"sample{i:06d}.{field}", source[(i, field)]))
    return out


def batch(url, body, **kw) -> httpx.Response:
    return httpx.post(f"{url}/v1/batch", json=body, timeout=30, **kw)


@pytest.mark.both_s3
def test_random_batches_come_back_byte_exact_in_request_order(shared_service, s3_dataset):
    _, source = s3_dataset
    rng = random.Random(1)
    for fields in (None, ["cls", "bin"], ["bin"]):
        indices = [rng.randrange(SAMPLES) for _ in range(150)] + [3, 3, 3]  # repeats allowed
        resp = batch(shared_service.url, {"dataset": "train", "indices": indices, "fields": fields})
        assert resp.status_code == 200, resp.text
        assert resp.headers["content-type"] == "application/x-tar"
        assert tar_members(resp.content) == expected(source, indices, fields)


@pytest.mark.both_s3
def test_per_sample_and_whole_sample_gets_return_the_source_bytes(shared_service, s3_dataset):
    _, source = s3_dataset
    assert httpx.get(f"{shared_service.url}/v1/datasets/train/samples/7/bin").content == source[(7, "bin")]
    assert httpx.get(f"{shared_service.url}/v1/datasets/train/samples/7/JSON").content == source[(7, "json")]
    whole = httpx.get(f"{shared_service.url}/v1/datasets/train/samples/14")
    assert tar_members(whole.content) == expected(source, [14])
    info = httpx.get(f"{shared_service.url}/v1/datasets/train").json()
    assert len(info.pop("version")) == 12 and abs(info.pop("checked") - time.time()) < 3600
    assert info == {"name": "train", "url": s3_dataset[0], "samples": SAMPLES, "shards": 4,
                    "bytes": sum(len(v) for v in source.values()), "fields": ["bin", "cls", "json"],
                    "layout": "tar", "encodings": {}, "shard_samples": 50,
                    "cache": {"bytes": 10 << 30, "block_size": 64 << 10}}
    assert [d["name"] for d in httpx.get(f"{shared_service.url}/v1/datasets").json()] == ["train"]


@pytest.mark.both_s3
def test_concurrent_per_sample_gets_are_coalesced_into_few_store_reads(service, s3_dataset):
    _, source = s3_dataset
    rng = random.Random(2)
    wanted = [(rng.randrange(SAMPLES), rng.choice(["bin", "cls"])) for _ in range(1000)]

    async def fetch_all():
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=250)) as session:
            async def get(i, field):
                async with session.get(f"{service.url}/v1/datasets/train/samples/{i}/{field}") as resp:
                    return resp.status, await resp.read()
            return await asyncio.gather(*(get(i, f) for i, f in wanted))

    responses = asyncio.run(fetch_all())
    assert [status for status, _ in responses] == [200] * 1000
    assert [body for _, body in responses] == [source[w] for w in wanted]
    m = metrics(service.url)
    dataset_blocks = sum(len(v) + 1024 for v in source.values()) // 65536 + 4
    assert m["shardfeed_store_requests_total"] <= dataset_blocks  # each block read at most once
    assert m["shardfeed_store_requests_total"] < 1000 / 10


@pytest.mark.slow
@pytest.mark.parametrize("args, windows", [([], True), (["--fetch-window", "0"], False),
                                           (["--cache-size", "1MiB"], False)])
def test_a_dataset_the_cache_holds_is_fetched_in_windows_a_larger_one_block_by_block(
        s3_dataset, s3_server, tmp_path, args, windows):
    url, source = s3_dataset
    one_per_shard = [0, 50, 100, 150]
    with start_service({"train": url}, cache_dir=tmp_path / "cache", env=s3_server.env(),
                       args=["--block-size", "64KiB", *args]) as svc:
        assert tar_members(batch(svc.url, {"dataset": "train", "indices": one_per_shard}).content) == \
            expected(source, one_per_shard)
        m = metrics(svc.url)
        assert m["shardfeed_store_requests_total"] == 4  # one read per shard either way
        shard_bytes = sum(len(v) + 1024 for v in source.values())
        if windows:  # each shard (under 1 MiB) is one window: read whole
            assert m["shardfeed_store_bytes_total"] >= 0.9 * shard_bytes
            assert tar_members(batch(svc.url, {"dataset": "train", "indices": list(range(SAMPLES))}).content) == \
                expected(source, range(SAMPLES))
            assert metrics(svc.url)["shardfeed_store_requests_total"] == 4
        else:  # the samples' own blocks only
            assert m["shardfeed_store_bytes_total"] <= 4 * 2 * 65536


@pytest.mark.both_s3
def test_unreadable_samples_become_404_entries_with_continue_on_error(s3_dataset, s3_server, tmp_path):
    _, source = s3_dataset
    bucket = "svc-broken"
    s3_server.create_bucket(bucket)
    client = s3_server.client()
    make_dataset(s3_put(client, bucket, "train"), samples=SAMPLES, per_shard=50)
    client.delete_object(Bucket=bucket, Key="train/shards/part-0001.tar")  # samples 50..99
    with start_service({"train": f"s3://{bucket}/train"}, cache_dir=tmp_path / "cache", env=s3_server.env()) as svc:
        indices = [10, 60, 150, 99]
        resp = batch(svc.url, {"dataset": "train", "indices": indices, "continue_on_error": True})
        assert resp.status_code == 200
        assert tar_members(resp.content) == (expected(source, [10]) + [("__404__/train/60", b"")]
                                             + expected(source, [150]) + [("__404__/train/99", b"")])
        resp = batch(svc.url, {"dataset": "train", "indices": indices})
        assert resp.status_code == 503
        assert resp.json()["error"]["code"] == "store_unavailable"
        assert "60" in resp.json()["error"]["message"]
        assert httpx.get(f"{svc.url}/v1/datasets/train/samples/60/bin").status_code == 503
        assert httpx.get(f"{svc.url}/healthz").status_code == 200


@pytest.mark.parametrize("body, status, code", [
    (b"{not json", 400, "invalid_request"),
    (b'["a list"]', 400, "invalid_request"),
    ({"dataset": "train", "indices": "1,2"}, 400, "invalid_request"),
    ({"dataset": "train", "indices": ["1"]}, 400, "invalid_request"),
    ({"dataset": "train", "indices": [1.5]}, 400, "invalid_request"),
    ({"dataset": "train", "indices": [True]}, 400, "invalid_request"),
    ({"dataset": "train", "indices": [-1]}, 400, "invalid_index"),
    ({"dataset": "train", "indices": [1], "format": "zip"}, 400, "unsupported_format"),
    ({"dataset": "train", "indices": [1], "surprise": 1}, 400, "invalid_request"),
    ({"dataset": "nope", "indices": [1]}, 404, "unknown_dataset"),
    ({"dataset": "train", "indices": [SAMPLES]}, 404, "sample_out_of_range"),
    ({"dataset": "train", "indices": [2**70]}, 404, "sample_out_of_range"),
    ({"dataset": "train", "indices": [1], "fields": ["jpg"]}, 404, "unknown_field"),
    ({"dataset": "train", "indices": [1], "fields": ["json"]}, 404, "unknown_field"),
    ({"dataset": "train", "indices": [0] * 5001}, 413, "too_many_items"),
    ({"dataset": "train", "indices": [0] * 800_000}, 413, "body_too_large"),
])
def test_bad_batch_requests_get_a_json_error_before_any_data(shared_service, body, status, code):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    resp = httpx.post(f"{shared_service.url}/v1/batch", content=content, timeout=30,
                      headers={"content-type": "application/json"})
    assert resp.status_code == status, resp.text
    assert resp.json()["error"]["code"] == code
    assert resp.json()["error"]["message"]


@pytest.mark.parametrize("path, status, code", [
    ("/v1/datasets/nope", 404, "unknown_dataset"),
    ("/v1/datasets/train/samples/200/bin", 404, "sample_out_of_range"),
    ("/v1/datasets/train/samples/-1/bin", 400, "invalid_index"),
    ("/v1/datasets/train/samples/abc", 400, "invalid_index"),
    ("/v1/datasets/train/samples/1/jpg", 404, "unknown_field"),
    ("/v1/datasets/train/samples/1/json", 404, "unknown_field"),
    ("/v1/datasets/..%2F..%2Fetc/samples/1", 404, "not_found"),
    ("/no/such/route", 404, "not_found"),
])
def test_bad_sample_requests_get_a_json_error(shared_service, path, status, code):
    resp = httpx.get(f"{shared_service.url}{path}")
    assert resp.status_code == status, resp.text
    assert resp.json()["error"]["code"] == code


def test_a_service_left_on_the_port_is_not_taken_for_the_one_started(shared_service, tmp_path):
    """``/healthz`` names its pid, so a start on a port that a stale service still holds fails
    (the new process exits: one that cannot bind, or here one that never serves) instead of
    handing back the stale one's URL."""
    assert httpx.get(f"{shared_service.url}/healthz").json()["pid"] == shared_service.process.pid
    port = int(shared_service.url.rsplit(":", 1)[1])
    with pytest.raises(RuntimeError, match="exited with 0"):
        launch_service(["--version"], port=port, log_path=tmp_path / "version.log")


@pytest.mark.slow
def test_overload_is_refused_with_429_and_retry_after(s3_dataset, s3_server, tmp_path):
    with start_service({"train": s3_dataset[0]}, cache_dir=tmp_path / "cache", env=s3_server.env(),
                       args=["--max-inflight-batches", "1", "--max-batch", "16384"]) as svc:
        # A client that asks for ~300 MB and never reads holds the only batch slot.
        body = json.dumps({"dataset": "train", "indices": [5] * 16384}).encode()
        host, port = svc.url.removeprefix("http://").split(":")
        hog = socket.create_connection((host, int(port)))
        hog.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        hog.sendall(b"POST /v1/batch HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    b"Content-Length: %d\r\n\r\n" % len(body) + body)
        deadline = time.monotonic() + 10
        while metrics(svc.url).get("shardfeed_inflight_requests", 0) < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        resp = batch(svc.url, {"dataset": "train", "indices": [1]})
        assert resp.status_code == 429
        assert resp.headers["retry-after"] == "1"
        assert resp.json()["error"]["code"] == "overloaded"
        hog.close()
        deadline = time.monotonic() + 10
        while batch(svc.url, {"dataset": "train", "indices": [1]}).status_code == 429:
            assert time.monotonic() < deadline, "the slot of a client that went away was never freed"
            time.sleep(0.1)


@pytest.mark.slow
def test_token_auth_refuses_missing_or_wrong_tokens(s3_dataset, s3_server, tmp_path):
    tokens = tmp_path / "tokens"
    tokens.write_text("s3cret-one\ns3cret-two\n")
    with start_service({"train": s3_dataset[0]}, cache_dir=tmp_path / "cache", env=s3_server.env(),
                       args=["--token-file", str(tokens)]) as svc:
        assert httpx.get(f"{svc.url}/healthz").status_code == 200
        for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "s3cret-one"}):
            resp = httpx.get(f"{svc.url}/v1/datasets", headers=headers)
            assert resp.status_code == 401
            assert resp.json()["error"]["code"] == "unauthorized"
        ok = httpx.get(f"{svc.url}/v1/datasets", headers={"Authorization": "Bearer s3cret-two"})
        assert ok.status_code == 200
        assert "s3cret" not in svc.log() and s3_server.secret_key not in svc.log()


@pytest.mark.slow
@pytest.mark.parametrize("writes", ["direct", "buffered"])
def test_cache_is_reused_after_restart_and_corrupt_blocks_are_refetched(s3_dataset, s3_server, tmp_path, writes):
    url, source = s3_dataset
    indices = list(range(SAMPLES))
    random.Random(3).shuffle(indices)
    args = ["--block-size", "64KiB", "--cache-writes", writes]
    with start_service({"train": url}, cache_dir=tmp_path / "cache", env=s3_server.env(), args=args) as svc:
        assert tar_members(batch(svc.url, {"dataset": "train", "indices": indices}).content) == \
            expected(source, indices)
        cold = metrics(svc.url)
    assert cold["shardfeed_store_requests_total"] > 0
    assert cold["shardfeed_store_bytes_total"] <= 1.1 * sum(len(v) + 1536 for v in source.values())

    with start_service({"train": url}, cache_dir=tmp_path / "cache", env=s3_server.env(), args=args) as svc:
        assert tar_members(batch(svc.url, {"dataset": "train", "indices": indices}).content) == \
            expected(source, indices)
        assert metrics(svc.url)["shardfeed_store_requests_total"] == 0  # all from the cache

    blocks = sorted(cached_blocks(tmp_path / "cache").values())
    assert blocks
    rng = random.Random(4)
    damage_block(blocks[len(blocks) // 2]._replace(size=100), "flip", rng)
    damage_block(blocks[-1], "delete", rng)  # its header lost
    last = max(blocks, key=lambda where: (where.data, where.offset))
    damage_block(last._replace(size=5000), "truncate", rng)  # its slab cut short within it
    with start_service({"train": url}, cache_dir=tmp_path / "cache", env=s3_server.env(), args=args) as svc:
        assert tar_members(batch(svc.url, {"dataset": "train", "indices": indices}).content) == \
            expected(source, indices)
        m = metrics(svc.url)
        assert m["shardfeed_cache_corrupt_total"] >= 2
        assert 1 <= m["shardfeed_store_requests_total"] <= 6


@pytest.mark.slow
def test_cache_stays_within_its_bound_under_churn(s3_dataset, s3_server, tmp_path):
    url, source = s3_dataset
    cache = tmp_path / "cache"
    with start_service({"train": url}, cache_dir=cache, cache_size="256KiB", env=s3_server.env(),
                       args=["--block-size", "32KiB", "--merge-gap", "0"]) as svc:
        rng = random.Random(4)
        for _ in range(4):
            indices = rng.sample(range(SAMPLES), 100)
            resp = batch(svc.url, {"dataset": "train", "indices": indices})
            assert tar_members(resp.content) == expected(source, indices)
            assert _bytes_on_disk(cache) <= 256 * 1024 + 16 * 1024  # and the slabs' extent trees
        m = metrics(svc.url)
        assert m["shardfeed_cache_evictions_total"] > 0
        assert m["shardfeed_cache_bytes"] <= 256 * 1024


def _bytes_on_disk(cache: Path) -> int:
    """Disk the slabs take (an evicted block's slot is a hole: it takes nothing), with the
    filesystem's own blocks for their extents."""
    return sum(path.stat().st_blocks * 512 for path in (cache / "slabs").glob("*.data"))


@pytest.mark.slow
def test_a_second_service_on_the_same_cache_dir_is_refused(s3_dataset, s3_server, tmp_path):
    with start_service({"train": s3_dataset[0]}, cache_dir=tmp_path / "cache", env=s3_server.env()):
        with pytest.raises(RuntimeError) as err:
            start_service({"train": s3_dataset[0]}, cache_dir=tmp_path / "cache", env=s3_server.env())
        assert "in use by another shardfeed process" in str(err.value)
        assert "Traceback" not in str(err.value)


@pytest.mark.slow
@pytest.mark.both_s3
def test_concurrent_cold_batches_that_share_blocks_all_complete(s3_dataset, s3_server, tmp_path):
    _, source = s3_dataset
    from concurrent.futures import ThreadPoolExecutor

    with start_service({"train": s3_dataset[0]}, cache_dir=tmp_path / "cache", env=s3_server.env(),
                       args=["--block-size", "16KiB", "--merge-gap", "32KiB"]) as svc:
        rng = random.Random(7)
        batches = [rng.sample(range(SAMPLES), 60) for _ in range(24)]
        with ThreadPoolExecutor(8) as pool:
            responses = list(pool.map(lambda b: batch(svc.url, {"dataset": "train", "indices": b}), batches))
        for indices, resp in zip(batches, responses):
            assert resp.status_code == 200
            assert tar_members(resp.content) == expected(source, indices)
        m = metrics(svc.url)
        assert m["shardfeed_requests_total"] == 24  # all 200: no batch failed or was retried


@pytest.mark.slow
def test_a_removed_cache_dir_is_recreated_and_locked_again(s3_dataset, s3_server, tmp_path):
    import shutil

    _, source = s3_dataset
    cache = tmp_path / "cache"
    with start_service({"train": s3_dataset[0]}, cache_dir=cache, env=s3_server.env()) as svc:
        assert tar_members(batch(svc.url, {"dataset": "train", "indices": [1, 2]}).content) == \
            expected(source, [1, 2])
        shutil.rmtree(cache)
        assert tar_members(batch(svc.url, {"dataset": "train", "indices": [150, 3]}).content) == \
            expected(source, [150, 3])
        deadline = time.monotonic() + 30  # blocks reach the disk after their waiters are served
        while not cached_blocks(cache):
            assert time.monotonic() < deadline, "no block was written to the recreated cache"
            time.sleep(0.05)
        assert (cache / ".lock").exists()  # locked again when the first block was written
        with pytest.raises(RuntimeError) as err:
            start_service({"train": s3_dataset[0]}, cache_dir=cache, env=s3_server.env())
        assert "in use by another shardfeed process" in str(err.value)


BAD_ARGUMENTS = [
    (["--block-size", "0"], "--block-size must be between"),
    (["--port", "70000"], "--port must be between"),
    (["--max-batch", "0"], "--max-batch must be between"),
    (["--peer-timeout", "0"], "--peer-timeout must be positive"),
    (["--cache-size", "lots"], "invalid size value: 'lots'"),
    (["--dataset", "no-equals-sign"], "--dataset expects NAME=URL"),
    (["--workers", "0"], "--workers must be between 1 and"),
    (["--workers", "-2"], "--workers must be between 1 and"),
    (["--workers", "100000"], "--workers must be between 1 and"),
    (["--restart-pause", "0"], "--restart-pause must be between 0.01 s and 1 hour, not 0 s"),
    (["--restart-pause", "soon"], "argument --restart-pause: invalid float value: 'soon'"),
    (["--bucket", "Not_A/Bucket"], "--bucket 'Not_A/Bucket' is not an S3 bucket name"),
]


@pytest.fixture(scope="module")
def refused(tmp_path_factory) -> dict[str, subprocess.CompletedProcess]:
    """``serve`` with each of ``BAD_ARGUMENTS``, all in one process; by the arguments' text."""
    cache = str(tmp_path_factory.mktemp("refused"))
    runs = refusals([["serve", "--cache-dir", cache, *args] for args, _ in BAD_ARGUMENTS])
    return {" ".join(args): run for (args, _), run in zip(BAD_ARGUMENTS, runs)}


@pytest.mark.parametrize("args, message", BAD_ARGUMENTS)
def test_bad_serve_arguments_are_refused_with_one_line(refused, args, message):
    result = refused[" ".join(args)]
    assert result.returncode != 0
    assert message in result.stderr
    assert "Traceback" not in result.stderr
