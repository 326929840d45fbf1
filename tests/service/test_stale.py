"""Never a stale byte: the cache is keyed by the version the store holds (ETag and size, a
file's inode and mtime), every read asks for that version, and a dataset or object that
changes is reopened. Real moto over HTTP, the service as a subprocess, byte-exact checks
against what was put in the store."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import tarfile
import threading
import time

import httpx
import pytest
from aistore.sdk import Client as AisClient

from shardfeed.client import Client
from shardfeed.process import start_service
from shardfeed.service.datasets.agreement import agreed, disagreeing
from shardfeed.service.datasets.dataset import open_dataset
from shardfeed.service.stores import ObjectChanged, open_store

from common.datasets import dir_put, make_dataset, s3_put, tar_dataset
from common.s3 import point_aws_at
from common.service import fetch_batch, metrics, tar_members
from common.wait import wait_until

pytestmark = pytest.mark.slow

SAMPLES = 120
SAME_LAYOUT = {"samples": SAMPLES, "per_shard": 30, "sizes": (6000, 6000)}
"""Fixed sizes: two seeds give shards of the same layout and other bytes, so a listing taken
while shards are being replaced still reads every sample whole, from one version."""


def expected(source: dict, indices) -> list[tuple[str, bytes]]:
    fields = sorted({f for (_, f) in source})
    return [(f"sample{i:06d}.{f}", source[(i, f)]) for i in indices for f in fields if (i, f) in source]


def version(url: str, **kw) -> str:
    return httpx.get(f"{url}/v1/datasets/train", **kw).json()["version"]


def test_a_restart_on_a_kept_cache_after_reseeding_serves_the_new_bytes(moto, tmp_path):
    moto.create_bucket("reseeded")
    s3 = moto.client()
    old = make_dataset(s3_put(s3, "reseeded", "train"), samples=SAMPLES, per_shard=30, seed=1)
    cache = tmp_path / "cache"
    every = list(range(SAMPLES))
    with start_service({"train": "s3://reseeded/train"}, cache_dir=cache, env=moto.env(),
                       args=["--block-size", "64KiB"]) as svc:
        assert fetch_batch(svc.url, every) == expected(old, every)
        assert metrics(svc.url)["shardfeed_cache_blocks"] > 0
    new = make_dataset(s3_put(s3, "reseeded", "train"), samples=SAMPLES, per_shard=30, seed=2)
    with start_service({"train": "s3://reseeded/train"}, cache_dir=cache, env=moto.env(),
                       args=["--block-size", "64KiB"]) as svc:
        assert metrics(svc.url)["shardfeed_cache_blocks"] == 0  # every shard changed: its blocks dropped
        order = random.Random(3).sample(every, SAMPLES)
        assert fetch_batch(svc.url, order) == expected(new, order)


def test_getbatch_objects_overwritten_are_never_served_stale(moto, tmp_path):
    moto.create_bucket("gb-stale")
    s3 = moto.client()
    rng = random.Random(5)
    keys = [f"obj/{i:03d}.bin" for i in range(40)]
    old = {key: rng.randbytes(rng.randint(1000, 90_000)) for key in keys}
    for key in keys:
        s3.put_object(Bucket="gb-stale", Key=key, Body=old[key])

    def getbatch(url: str, wanted: list[str]) -> list[bytes]:
        batch = AisClient(url).batch(wanted, bucket=AisClient(url).bucket("gb-stale", provider="s3"))
        return [data for _, data in batch.get()]

    def overwrite(wanted: list[str]) -> dict[str, bytes]:
        new = {key: bytes(b ^ 0xA5 for b in old[key]) for key in wanted}  # same size, other bytes
        for key in wanted:
            s3.put_object(Bucket="gb-stale", Key=key, Body=new[key])
        return new

    cache = tmp_path / "cache"
    args = ["--bucket", "gb-stale", "--block-size", "64KiB", "--object-ttl", "1"]
    with start_service({}, cache_dir=cache, env=moto.env(), args=args) as svc:
        assert getbatch(svc.url, keys) == [old[k] for k in keys]
        assert getbatch(svc.url, keys) == [old[k] for k in keys]  # warm, from the cache
    new = overwrite(keys)  # while the service is stopped: its cache keeps the old blocks
    with start_service({}, cache_dir=cache, env=moto.env(), args=args) as svc:
        assert getbatch(svc.url, keys) == [new[k] for k in keys]
        old.update(new)
        newer = overwrite(keys[:10])  # while it runs: seen once --object-ttl has passed
        wait_until(lambda: getbatch(svc.url, keys) == [newer.get(k, new[k]) for k in keys], 10, "the newer objects")


def test_shards_replaced_mid_epoch_never_yield_a_mixed_sample(moto, tmp_path):
    """Readers hammer random batches while every shard is replaced one by one; reads of the old
    versions fail (If-Match), the dataset is reopened, the batch read again. Every sample is
    wholly one version; after the reload, every sample is the new one."""
    moto.create_bucket("midepoch")
    s3 = moto.client()
    old = make_dataset(s3_put(s3, "midepoch", "train"), seed=1, **SAME_LAYOUT)
    staged = {}
    new = make_dataset(lambda path, data: staged.__setitem__(path, data), seed=2, **SAME_LAYOUT)
    mixed, served, errors = [], [0], []
    stop = threading.Event()
    # A cache of a quarter of the dataset: blocks keep being evicted and read again.
    with start_service({"train": "s3://midepoch/train"}, cache_dir=tmp_path / "cache", cache_size="200KiB",
                       env=moto.env(), args=["--block-size", "16KiB", "--memory-cache", "0"]) as svc:

        def read(seed: int) -> None:
            rng = random.Random(seed)
            with Client(svc.url) as client:
                while not stop.is_set():
                    indices = rng.sample(range(SAMPLES), 16)
                    try:
                        samples = client.get_batch("train", indices)
                    except Exception as err:  # noqa: BLE001 - counted, and the test fails on it
                        errors.append(repr(err))
                        continue
                    for i, sample in zip(indices, samples):
                        versions = {name for name, source in (("old", old), ("new", new))
                                    if all(sample[f] == source[(i, f)] for f in ("bin", "cls"))}
                        if not versions:
                            mixed.append(i)
                    served[0] += len(indices)

        threads = [threading.Thread(target=read, args=(seed,)) for seed in range(3)]
        def served_more(samples: int) -> None:  # the readers read on: batches of every version seen
            mark = served[0]
            wait_until(lambda: served[0] >= mark + samples or errors, 30, "the readers' batches")

        for thread in threads:
            thread.start()
        served_more(100)
        before = version(svc.url)
        for path, data in staged.items():  # the shards, then the index, as a writer would
            if path != "index.parquet":
                s3.put_object(Bucket="midepoch", Key=f"train/{path}", Body=data)
                served_more(16)
        s3.put_object(Bucket="midepoch", Key="train/index.parquet", Body=staged["index.parquet"])
        reloaded = httpx.post(f"{svc.url}/v1/datasets/train/reload", timeout=30).json()["dataset"]
        served_more(100)
        stop.set()
        for thread in threads:
            thread.join(timeout=60)
        assert reloaded["version"] != before and reloaded["checked"] > time.time() - 30
        assert not mixed and not errors, (mixed[:5], errors[:3])
        assert served[0] > 100
        assert metrics(svc.url)["shardfeed_store_errors_total"] > 0  # old versions were refused
        assert fetch_batch(svc.url, range(SAMPLES)) == expected(new, range(SAMPLES))


def test_sighup_and_the_reload_route_reopen_every_worker(moto, tmp_path):
    moto.create_bucket("reopened")
    s3 = moto.client()
    first_source = make_dataset(s3_put(s3, "reopened", "train"), samples=60, per_shard=20, seed=1)
    auth = {"Authorization": "Bearer sesame"}
    with start_service({"train": "s3://reopened/train"}, cache_dir=tmp_path / "cache", workers=2,
                       env={**moto.env(), "SHARDFEED_TOKENS": "sesame"}, args=["--block-size", "64KiB"]) as svc:
        first = version(svc.url, headers=auth)

        def batch(indices, at: str | None = None) -> list[tuple[str, bytes]]:
            resp = httpx.post(f"{svc.url}/v1/batch", json={"dataset": "train", "indices": list(indices)},
                              headers=auth, timeout=60)
            assert resp.status_code == 200, resp.text
            assert at is None or resp.headers["X-Shardfeed-Dataset-Version"] == at
            return tar_members(resp.content)

        def every_worker_at_a_new_version(than: str) -> str:
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                seen = {version(svc.url, headers=auth) for _ in range(12)}  # the port is shared by both
                if than not in seen and len(seen) == 1:
                    return seen.pop()
                time.sleep(0.2)
            raise AssertionError(f"workers still at {seen}")

        for _ in range(4):  # both workers serve (and rank the shards)
            assert batch(range(60), first) == expected(first_source, range(60))
        second_source = make_dataset(s3_put(s3, "reopened", "train"), samples=80, per_shard=20, seed=2)
        os.kill(svc.process.pid, signal.SIGHUP)  # the supervisor passes it on to its workers
        second = every_worker_at_a_new_version(first)
        assert svc.process.poll() is None
        for _ in range(4):  # a shard more than before: each worker routes by the new list
            assert batch(range(80)) == expected(second_source, range(80))
        third_source = make_dataset(s3_put(s3, "reopened", "train"), samples=70, per_shard=35, seed=3)
        refused = httpx.post(f"{svc.url}/v1/datasets/train/reload")
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "unauthorized"
        unknown = httpx.post(f"{svc.url}/v1/datasets/nope/reload", headers=auth)
        assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "unknown_dataset"
        answer = httpx.post(f"{svc.url}/v1/datasets/train/reload", headers=auth, timeout=30).json()["dataset"]
        assert answer["samples"] == 70 and answer["version"] != second
        assert every_worker_at_a_new_version(second) == answer["version"]  # relayed to the sibling
        assert batch(range(70), answer["version"]) == expected(third_source, range(70))


def test_opening_a_dataset_lists_its_root_in_pages_and_heads_no_shard(moto, monkeypatch):
    moto.create_bucket("listed")
    make_dataset(s3_put(moto.client(), "listed", "train"), samples=31, per_shard=1)  # 31 shards
    point_aws_at(moto, monkeypatch)

    async def main():
        store = open_store("s3://listed/train")
        store.list_page_size = 10  # 32 objects: 4 pages
        try:
            dataset = await open_dataset("train", "s3://listed/train", store=store)
        finally:
            await store.close()
        return dataset, store.requests

    dataset, requests = asyncio.run(main())
    assert len(dataset.index.shards) == 31 and all(dataset.versions)
    assert requests == 1 + 1 + 4  # the index's HEAD and read, the listing of its shards: no HEAD per shard


def test_a_file_store_read_of_a_version_fails_once_the_file_is_replaced(tmp_path):
    make_dataset(dir_put(tmp_path), samples=4, per_shard=2)

    async def main():
        store = open_store(str(tmp_path))
        infos = {info.path: info for info in await store.list()}
        shard = infos["shards/part-0000.tar"]
        assert (await store.head(shard.path)).etag == shard.etag
        assert len(await store.read_range(shard.path, 0, 512, shard.etag)) == 512
        await store.write(shard.path, b"x" * shard.size)  # replaced: same size, new inode
        with pytest.raises(ObjectChanged):
            await store.read_range(shard.path, 0, 512, shard.etag)
        with pytest.raises(ObjectChanged):
            await store.read(shard.path, shard.etag)
        assert await store.read_range(shard.path, 0, 4) == b"xxxx"

    asyncio.run(main())


@pytest.mark.both_s3
def test_a_disagreeing_version_fails_every_read_of_a_shard_as_changed(s3_env, bucket, tmp_path):
    """What ``agreement.py`` reads a shard at when its index does not describe it: each store
    answers ``ObjectChanged`` (S3: If-Match's 412), not another error and not the bytes."""
    make_dataset(s3_put(s3_env.client(), bucket, "d"), samples=4, per_shard=2)
    make_dataset(dir_put(tmp_path), samples=4, per_shard=2)

    async def main():
        for store in (open_store(f"s3://{bucket}/d"), open_store(str(tmp_path))):
            try:
                shard = next(i for i in await store.list() if i.path == "shards/part-0000.tar")
                assert len(await store.read_range(shard.path, 0, 512, shard.etag)) == 512
                with pytest.raises(ObjectChanged):
                    await store.read_range(shard.path, 0, 512, disagreeing(shard.etag))
                with pytest.raises(ObjectChanged):
                    await store.read_pieces(shard.path, 0, 4096, 1024, disagreeing(shard.etag))
            finally:
                await store.close()

    asyncio.run(main())


def test_shards_of_every_tar_format_agree_with_their_index(tmp_path):
    """The check a first opening makes (``agreement.py``) finds no disagreement in shards whose
    names tar holds in a GNU or PAX record (long, or not ASCII: the header's own name field is
    then cut or replaced) or in upper case: each shard read as its index says."""
    names = ["\u00e9t\u00e9/s0000.bin", "s0001.JPG", f"{'long-' * 25}/s0002.bin", "d/s0003.seg.PNG",
             "\u4e2d/s0004.bin"]
    shards = [{name: bytes([i]) * (100 + 37 * i) for i, name in enumerate(names)} for _ in range(3)]
    url = tar_dataset(tmp_path / "data", shards, [tarfile.PAX_FORMAT, tarfile.GNU_FORMAT, tarfile.USTAR_FORMAT])

    async def main():
        dataset = await open_dataset("train", url)
        try:
            return dataset, await agreed(None, dataset)
        finally:
            await dataset.store.close()

    dataset, checked = asyncio.run(main())
    assert checked is dataset and len(dataset.index.shards) == 3


def test_a_shard_replaced_before_its_index_is_never_read_at_the_old_offsets(tmp_path):
    """A writer puts a shard of a new layout, then (later) the index that agrees with it. A
    reopening between the two, or a first opening, finds the index not describing the shard
    (``agreement.py``): the other shards are served, that one's samples fail with 409; never a
    sample cut at the old offsets. Once the index is written too, the reopening takes the new
    layout."""
    root = tmp_path / "data"
    old = make_dataset(dir_put(root), seed=1, samples=SAMPLES, per_shard=30, sizes=(3000, 9000))
    staged = {}
    new = make_dataset(lambda path, data: staged.__setitem__(path, data), seed=2, samples=SAMPLES, per_shard=30,
                       sizes=(2000, 12000))
    with start_service({"train": root.as_uri()}, cache_dir=tmp_path / "cache", args=["--memory-cache", "0"]) as svc:
        assert fetch_batch(svc.url, range(SAMPLES)) == expected(old, range(SAMPLES))
        before = version(svc.url)
        (root / "shards/part-0001.tar").write_bytes(staged["shards/part-0001.tar"])  # the shard, not the index
        httpx.post(f"{svc.url}/v1/datasets/train/reload", timeout=30).raise_for_status()
        assert version(svc.url) != before
        for _ in range(2):  # and again: the reopening each failed read asks for finds the same
            resp = httpx.post(f"{svc.url}/v1/batch", json={"dataset": "train", "indices": list(range(30, 60))},
                              timeout=60)
            assert resp.status_code == 409 and resp.json()["error"]["code"] == "dataset_changed", resp.text
        assert fetch_batch(svc.url, range(30)) == expected(old, range(30))  # the unchanged shard's
        # A service that starts now (a restarted worker or replica) finds the same on its first opening.
        with start_service({"train": root.as_uri()}, cache_dir=tmp_path / "cache2") as starting:
            resp = httpx.post(f"{starting.url}/v1/batch", json={"dataset": "train", "indices": list(range(30, 60))},
                              timeout=60)
            assert resp.status_code == 409 and resp.json()["error"]["code"] == "dataset_changed", resp.text
            assert fetch_batch(starting.url, range(30)) == expected(old, range(30))
        (root / "index.parquet").write_bytes(staged["index.parquet"])
        for path, data in staged.items():
            if path.startswith("shards/") and path != "shards/part-0001.tar":
                (root / path).write_bytes(data)
        httpx.post(f"{svc.url}/v1/datasets/train/reload", timeout=30).raise_for_status()
        assert fetch_batch(svc.url, range(SAMPLES)) == expected(new, range(SAMPLES))
