"""Cache faults while the service runs: block files corrupted, truncated or deleted
between and during requests, the cache directory removed, writes refused (a full disk,
an unwritable directory). The cache may lose blocks; a client never gets a wrong byte."""

from __future__ import annotations

import errno
import random
import resource
import shutil
import subprocess
import threading
import time

import httpx
import pytest

from shardfeed.process import start_service

from common.datasets import bucket_dataset
from common.reliability import SteadyClient, cached_blocks, damage_block, expected_members, received_members
from common.service import metrics

pytestmark = pytest.mark.slow  # starts several services, S3 servers or a browser; not in `make check`

SAMPLES = 200


@pytest.fixture(scope="module")
def dataset(moto):
    return bucket_dataset(moto, "cachefaults", samples=SAMPLES, per_shard=50)


@pytest.fixture
def service(dataset, moto, tmp_path):
    # No RAM tier: every read goes to the block files these tests damage.
    with start_service({"train": dataset[0]}, cache_dir=tmp_path / "cache", env=moto.env(),
                       args=["--block-size", "64KiB", "--merge-gap", "0", "--memory-cache", "0"]) as svc:
        yield svc


def read_all(url: str, source: dict, seed: int) -> None:
    """Every sample in a random order, in one batch: exact bytes, complete stream."""
    indices = random.Random(seed).sample(range(SAMPLES), SAMPLES)
    resp = httpx.post(f"{url}/v1/batch", json={"dataset": "train", "indices": indices}, timeout=60)
    assert resp.status_code == 200, resp.text
    got, ended = received_members(resp.content)
    assert ended and got == expected_members(source, "train", indices)


def blocks(cache_dir) -> list:
    """Where each block the cache holds is (its catalogue on disk), in its order."""
    return list(cached_blocks(cache_dir).values())


def test_block_files_damaged_between_requests_are_detected_and_refetched(service, dataset, tmp_path):
    _, source = dataset
    read_all(service.url, source, 0)
    rng = random.Random(1)
    for round_ in range(4):
        files = blocks(tmp_path / "cache")
        for path in rng.sample(files, min(6, len(files))):
            damage_block(path, rng.choice(["flip", "truncate", "delete", "garbage"]), rng)
        read_all(service.url, source, round_ + 1)
    m = metrics(service.url)
    assert m["shardfeed_cache_corrupt_total"] > 0
    assert m["shardfeed_cache_hits_total"] > 0


def test_block_files_damaged_while_requests_run_never_reach_a_client(service, dataset, tmp_path):
    _, source = dataset
    read_all(service.url, source, 0)
    clients = [SteadyClient(service.url, "train", source, SAMPLES, seed=s) for s in range(3)]
    for client in clients:
        client.start()
    rng = random.Random(2)
    damaged = 0
    deadline = time.monotonic() + 4
    while time.monotonic() < deadline:
        files = blocks(tmp_path / "cache")
        if files:
            damage_block(rng.choice(files), rng.choice(["flip", "truncate", "delete", "garbage"]), rng)
            damaged += 1
        time.sleep(0.01)
    tallies = [client.stop() for client in clients]
    assert sum(t.requests for t in tallies) > 50 and damaged > 100
    assert [t.wrong for t in tallies] == [0, 0, 0]
    assert [t.failures for t in tallies] == [0, 0, 0], [t.errors for t in tallies]
    assert metrics(service.url)["shardfeed_cache_corrupt_total"] > 0


def remove_tree(path) -> None:
    """``rmtree`` while the service may still be writing there (its cache writes finish after
    the answers): a file renamed or added under the walk is met again on the next pass."""
    for _ in range(100):
        if not path.exists():
            return
        try:
            shutil.rmtree(path)
        except FileNotFoundError:
            continue
        except OSError as err:
            if err.errno != errno.ENOTEMPTY:
                raise
    raise AssertionError(f"{path} kept being written to")


def test_removing_the_cache_directory_while_running_loses_nothing(service, dataset, tmp_path):
    _, source = dataset
    read_all(service.url, source, 0)
    remove_tree(tmp_path / "cache")
    read_all(service.url, source, 1)
    read_all(service.url, source, 2)
    assert httpx.get(f"{service.url}/healthz").status_code == 200


@pytest.mark.parametrize("how", ["disk full", "not a directory"])
def test_a_cache_that_refuses_writes_degrades_to_the_store_with_a_warning_and_a_metric(
        service, dataset, tmp_path, how):
    _, source = dataset
    pid = service.process.pid
    if how == "disk full":
        # The kernel refuses to grow any file of the service past 16 KiB (EFBIG, like ENOSPC).
        # Its log file is opened in append mode and stays far below that.
        soft, hard = resource.prlimit(pid, resource.RLIMIT_FSIZE, (16 * 1024, resource.RLIM_INFINITY))
    else:
        # Where the cache wants its slabs' directory there is now a file.
        (tmp_path / "cache" / "slabs").write_bytes(b"in the way")
    read_all(service.url, source, 0)
    read_all(service.url, source, 1)
    m = metrics(service.url)
    assert m["shardfeed_cache_write_errors_total"] > 0
    assert m["shardfeed_cache_blocks"] == 0
    assert m["shardfeed_store_requests_total"] > 0
    assert "cannot write cache block" in service.log()

    if how == "disk full":  # space comes back: the cache fills again
        resource.prlimit(pid, resource.RLIMIT_FSIZE, (soft, hard))
        read_all(service.url, source, 2)
        assert metrics(service.url)["shardfeed_cache_blocks"] > 0


def test_a_cache_filesystem_that_runs_out_of_space_never_fails_a_batch(dataset, moto, tmp_path):
    """A real ENOSPC: the cache directory on a 1 MiB tmpfs, the cache allowed 64 MiB."""
    _, source = dataset
    small = tmp_path / "small"
    small.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(small)],
                             capture_output=True, text=True, check=False)
    if mounted.returncode != 0:  # not root, or no right to mount here: the EFBIG case above stands in
        pytest.skip(f"cannot mount a small tmpfs for the cache: {mounted.stderr.strip()}")
    try:
        with start_service({"train": dataset[0]}, cache_dir=small / "cache", cache_size="64MiB", env=moto.env(),
                           args=["--block-size", "64KiB", "--memory-cache", "0"]) as svc:
            for seed in range(3):
                read_all(svc.url, source, seed)
            m = metrics(svc.url)
            assert m["shardfeed_cache_write_errors_total"] > 0 and m["shardfeed_cache_blocks"] > 0
            assert "cannot write cache block" in svc.log()  # once per 30 s at most, not per block
    finally:
        subprocess.run(["umount", "-l", str(small)], check=False)


def test_concurrent_readers_of_a_damaged_cache_agree_with_the_source(service, dataset, tmp_path):
    """Many requests for the same few blocks while they are damaged: singleflight refetches
    must hand every waiter the good bytes."""
    _, source = dataset
    read_all(service.url, source, 0)
    errors: list[str] = []

    def hammer(seed: int) -> None:
        rng = random.Random(seed)
        with httpx.Client(base_url=service.url, timeout=30) as http:
            for _ in range(40):
                i = rng.randrange(50)  # all in shard 0: a handful of blocks
                resp = http.get(f"/v1/datasets/train/samples/{i}/bin")
                if resp.status_code != 200 or resp.content != source[(i, "bin")]:
                    errors.append(f"sample {i}: HTTP {resp.status_code}")

    threads = [threading.Thread(target=hammer, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    rng = random.Random(3)
    while any(t.is_alive() for t in threads):
        files = blocks(tmp_path / "cache")
        if files:
            damage_block(rng.choice(files[:8]), rng.choice(["flip", "garbage", "truncate"]), rng)
        time.sleep(0.005)
    for t in threads:
        t.join()
    assert errors == []
