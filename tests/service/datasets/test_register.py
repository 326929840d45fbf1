"""Datasets added and removed at runtime (``POST /v1/datasets``, ``DELETE /v1/datasets/{name}``):
on every worker of ``--workers N`` (a restarted one too), tar shards without an index indexed
on registration (the index beside them, or in the cache directory where the prefix is
read-only), and every refusal a JSON error."""

from __future__ import annotations

import os
import signal
import subprocess
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from shardfeed.process import start_service

from common.datasets import dir_put, make_dataset
from common.reliability import expected_members
from common.service import fetch_batch
from common.workers import worker_pids, worker_urls
from common.wait import wait_until

pytestmark = pytest.mark.xdist_group("register")  # one worker: its module services start once

ARGS = ["--block-size", "64KiB"]


@pytest.fixture(scope="module")
def datasets(tmp_path_factory):
    """``train`` (served from the start), ``extra`` (indexed) and ``raw`` (tar shards, no index)."""
    out = {}
    for name, seed in (("train", 0), ("extra", 1)):
        root = tmp_path_factory.mktemp(name)
        out[name] = (root.as_uri(), make_dataset(dir_put(root), samples=60, per_shard=20, seed=seed))
    return out


@pytest.fixture(scope="module")
def service(datasets, tmp_path_factory):
    """One service of ``train`` for the tests that need no restart and no token: each registers
    names of its own."""
    with start_service({"train": datasets["train"][0]}, cache_dir=tmp_path_factory.mktemp("service") / "cache",
                       args=ARGS) as svc:
        yield svc


def unindexed(root) -> dict:
    source = make_dataset(dir_put(root), samples=40, per_shard=10, seed=2, sizes=(100, 2000))
    (root / "index.parquet").unlink()
    return source


def register(url: str, name: str, dataset_url: str, **params) -> httpx.Response:
    return httpx.post(f"{url}/v1/datasets", json={"name": name, "url": dataset_url}, params=params, timeout=60)


def answers(url: str) -> bool:
    """Whether ``GET url`` answers 200 now (a worker that is down does not)."""
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def outcome(answer: httpx.Response) -> httpx.Response | None:
    """``answer`` unless it is a 202 (still registering: ask again)."""
    return None if answer.status_code == 202 else answer


def names(url: str) -> list[str]:
    return [d["name"] for d in httpx.get(f"{url}/v1/datasets", timeout=10).json()]


def error_code(response: httpx.Response) -> str:
    return response.json()["error"]["code"]


@pytest.mark.slow  # two workers, one killed and restarted, as in the other tests of --workers N
def test_a_registered_dataset_is_served_by_every_worker_and_a_restarted_one_and_removed_from_all(
        datasets, tmp_path):
    train_url, _ = datasets["train"]
    extra_url, extra = datasets["extra"]
    with start_service({"train": train_url}, cache_dir=tmp_path / "cache", workers=2, args=ARGS) as svc:
        # Answered at once (202); nobody asks again, and every worker gets it all the same.
        assert register(svc.url, "extra", extra_url, wait=0).status_code == 202
        workers = worker_urls(svc.url)
        wait_until(lambda: all(httpx.get(f"{w}/v1/datasets/extra", timeout=5).status_code == 200 for w in workers),
                   30, "every worker serving the registered dataset")
        answer = register(svc.url, "extra", extra_url)  # the same again: idempotent
        assert answer.status_code == 200, answer.text
        assert answer.json()["dataset"]["samples"] == 60
        for worker in workers:
            assert fetch_batch(worker, [5, 59, 0], "extra") == expected_members(extra, "extra", [5, 59, 0])

        os.kill(worker_pids(svc)[1], signal.SIGKILL)
        wait_until(lambda: answers(f"{workers[1]}/v1/datasets/extra"), 30, "the restarted worker serving it")
        assert fetch_batch(workers[1], [1, 2], "extra") == expected_members(extra, "extra", [1, 2])

        # The same dataset registered on both workers at once (two ranks' clients, each at a worker):
        # each worker relays it to the other, which must answer once the dataset is served there,
        # not wait for its own relay to the first (that wait was mutual, until the relays timed out).
        raw_url = (tmp_path / "raw").as_uri()
        make_dataset(dir_put(tmp_path / "raw"), samples=600, per_shard=2, seed=3)  # 300 shards to index: a while
        (tmp_path / "raw" / "index.parquet").unlink()
        with ThreadPoolExecutor(2) as pool:
            both = list(pool.map(lambda worker: register(worker, "raw", raw_url, wait=50), workers))
        assert [answer.status_code for answer in both] == [200, 200], [answer.text for answer in both]

        removed = httpx.delete(f"{svc.url}/v1/datasets/extra", timeout=30)
        assert removed.status_code == 200 and removed.json()["removed"]["name"] == "extra"
        for worker in workers:
            gone = httpx.post(f"{worker}/v1/batch", json={"dataset": "extra", "indices": [1]}, timeout=10)
            assert gone.status_code == 404 and error_code(gone) == "unknown_dataset"
        assert error_code(httpx.delete(f"{svc.url}/v1/datasets/extra", timeout=10)) == "unknown_dataset"
        assert fetch_batch(svc.url, [3], "train")  # the others are untouched


def test_refusals_are_json_errors(service, datasets, tmp_path):
    train_url, _ = datasets["train"]
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "notes.txt").write_text("no shards here")
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "part-0.tar").write_bytes(b"not a tar file at all" * 100)
    served = names(service.url)
    taken = register(service.url, "train", datasets["extra"][0])
    assert taken.status_code == 409 and error_code(taken) == "dataset_exists"
    assert train_url in taken.json()["error"]["message"]
    assert register(service.url, "train", train_url).status_code == 200
    for name, url, status, code in [
            ("x", "relative/path", 400, "invalid_request"),
            ("x", "http://example.com/data", 400, "invalid_request"),
            ("a/b", str(empty), 400, "invalid_request"),
            ("x", str(tmp_path / "missing"), 422, "no_dataset"),
            ("x", str(empty), 422, "no_dataset"),
            ("x", str(corrupt), 422, "invalid_index")]:
        answer = register(service.url, name, url)
        assert (answer.status_code, error_code(answer)) == (status, code), (url, answer.text)
    assert "neither index.parquet nor .tar shards" in register(service.url, "x", str(empty)).text
    bad = httpx.post(f"{service.url}/v1/datasets", content=b"{not json", timeout=10)
    assert bad.status_code == 400 and error_code(bad) == "invalid_request"
    assert names(service.url) == served  # none of them added


def test_registration_needs_the_token_when_tokens_are_on(datasets, tmp_path):
    train_url, _ = datasets["train"]
    with start_service({"train": train_url}, cache_dir=tmp_path / "cache", args=ARGS,
                       env={"SHARDFEED_TOKENS": "s3cret"}) as svc:
        denied = register(svc.url, "extra", datasets["extra"][0])
        assert denied.status_code == 401 and error_code(denied) == "unauthorized"
        assert httpx.delete(f"{svc.url}/v1/datasets/train", timeout=10).status_code == 401


def test_tar_shards_without_an_index_are_indexed_on_registration_and_the_index_written_beside_them(
        service, tmp_path):
    root = tmp_path / "raw"
    source = unindexed(root)
    first = register(service.url, "raw", str(root), wait=0)  # answered before the dataset is open
    assert first.status_code == 202 and first.headers["Retry-After"] == "1"
    assert first.json()["registering"]["name"] == "raw"
    answer = wait_until(lambda: outcome(register(service.url, "raw", str(root))), 30, "the registration's outcome")
    assert answer.status_code == 200 and answer.json()["dataset"]["samples"] == 40
    assert (root / "index.parquet").exists()
    assert fetch_batch(service.url, [0, 39, 17], "raw") == expected_members(source, "raw", [0, 39, 17])


def test_a_read_only_prefix_keeps_its_index_in_the_cache_directory_and_a_restart_reuses_it(datasets, tmp_path):
    root = tmp_path / "readonly"
    root.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(root)],
                             capture_output=True, text=True, check=False)
    if mounted.returncode != 0:  # not root, or no right to mount here
        pytest.skip(f"cannot mount a tmpfs to make read-only: {mounted.stderr.strip()}")
    try:
        source = unindexed(root)
        subprocess.run(["mount", "-o", "remount,ro", str(root)], check=True)
        for run in range(2):
            with start_service({"train": datasets["train"][0]}, cache_dir=tmp_path / "cache", args=ARGS) as svc:
                answer = register(svc.url, "raw", str(root))
                assert answer.status_code == 200, answer.text
                assert fetch_batch(svc.url, [0, 39, 17], "raw") == expected_members(source, "raw", [0, 39, 17])
                indexed = f"indexing {root}:" in svc.log()
                assert indexed == (run == 0), svc.log()
        assert not (root / "index.parquet").exists()
        assert len(list((tmp_path / "cache" / "indexes").glob("*.parquet"))) == 1
    finally:
        subprocess.run(["umount", "-l", str(root)], check=False)
