"""The index mapped once per host (``service/datasets/mapped.py``): the same answers as the
index read from parquet, torn files made again, and one file for every worker of a service,
mapped again (never rebuilt) by a restarted one."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import time

import httpx
import numpy as np
import pyarrow as pa
import pytest

from shardfeed.process import start_service
from shardfeed.service.datasets.index import Index
from shardfeed.service.datasets.indexfile import IndexFormatError
from shardfeed.service.datasets.mapped import SharedIndexes, map_index, member_scratch, write_mapped

from common.reliability import expected_members
from common.service import fetch_batch
from common.workers import directory_dataset, worker_pids


def index_of(samples: int, *, uneven: bool = False, large_keys: bool = False) -> Index:
    """Two fields a sample (a third on every third sample when ``uneven``), shards of 7."""
    rows = {"sample": [], "key": [], "field": [], "shard": [], "offset": [], "size": []}
    for i in range(samples):
        fields = ["jpg", "cls"] + (["json"] if uneven and i % 3 == 0 else [])
        for j, field in enumerate(fields):
            rows["sample"].append(i)
            rows["key"].append(f"dir/ü{i:06d}" + "x" * (i % 5))
            rows["field"].append(field)
            rows["shard"].append(f"shard-{i // 7:04d}.tar")
            rows["offset"].append((i % 7) * 4096 + j * 1024)
            rows["size"].append(100 + i + j)
    table = pa.table(rows)
    if large_keys:
        table = table.set_column(1, "key", table.column("key").cast(pa.large_string()))
    return Index.from_table(table)


def same(a: Index, b: Index, indices: np.ndarray, fields=None) -> None:
    x, y = a.lookup(indices, fields), b.lookup(indices, fields)
    for name in ("position", "sample", "field", "shard", "offset", "size", "found", "row"):
        assert np.array_equal(getattr(x, name), getattr(y, name)), name
    assert a.keys(indices) == b.keys(indices)


@pytest.mark.parametrize("uneven,large_keys", [(False, False), (True, False), (False, True)])
def test_a_mapped_index_answers_as_the_index_it_was_made_from(tmp_path, uneven, large_keys):
    index = index_of(500, uneven=uneven, large_keys=large_keys)
    write_mapped(index, tmp_path / "i.idx")
    mapped = map_index(tmp_path / "i.idx")
    rng = np.random.default_rng(0)
    for fields in (None, ["cls"], ["json", "jpg"] if uneven else ["cls", "jpg"]):
        same(index, mapped, rng.integers(0, 500, 64), fields)
    assert mapped.to_table().equals(index.to_table())
    assert (mapped.shards, mapped.fields, mapped.total_bytes, mapped.shard_samples(), len(mapped)) == \
        (index.shards, index.fields, index.total_bytes, index.shard_samples(), len(index))
    assert np.array_equal(mapped.shard_extents(), index.shard_extents())
    for got, want in zip(mapped.shard_runs(), index.shard_runs()):
        assert np.array_equal(got, want)
    assert [mapped.key(i) for i in (0, 499)] == [index.key(i) for i in (0, 499)]
    assert not mapped.arrays()["offset"].flags.writeable  # a view of the read-only mapping


@pytest.mark.parametrize("damage", ["truncated", "magic", "header", "empty"])
def test_a_torn_map_file_is_refused_and_made_again(tmp_path, damage, caplog):
    index = index_of(100)
    shared = SharedIndexes(tmp_path)
    builds = []

    async def build():
        builds.append(1)
        return index

    path = shared.path("file:///d", "v1")
    asyncio.run(shared.share("file:///d", "v1", build))
    data = path.read_bytes()
    path.write_bytes({"truncated": data[:-100], "magic": b"x" + data[1:], "empty": b"",
                      "header": data[:30] + b"\xff" * 40 + data[70:]}[damage])
    with pytest.raises(IndexFormatError):
        map_index(path)
    with caplog.at_level(logging.WARNING, "shardfeed.datasets"):
        again = asyncio.run(shared.share("file:///d", "v1", build))
    assert len(builds) == 2 and "making it again" in caplog.text
    same(index, again, np.arange(100))
    assert asyncio.run(shared.share("file:///d", "v1", build)) is not None and len(builds) == 2


def test_a_new_version_replaces_the_older_map_and_its_scratch(tmp_path):
    shared = SharedIndexes(tmp_path)
    one, two = index_of(50), index_of(60)

    async def open_both():
        first = await shared.share("s3://b/d", "v1", lambda: asyncio.sleep(0, one))
        member_scratch(first, "headers-x")[:] = 1
        await shared.share("s3://b/other", "v1", lambda: asyncio.sleep(0, one))
        return first, await shared.share("s3://b/d", "v2", lambda: asyncio.sleep(0, two))

    first, second = asyncio.run(open_both())
    names = sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock"))
    assert names == sorted([shared.path("s3://b/d", "v2").name, shared.path("s3://b/other", "v1").name])
    assert len(second) == 60 and first.keys(np.arange(3)) == one.keys(np.arange(3))  # still mapped


def test_scratch_bytes_are_shared_between_processes_mapping_one_index(tmp_path):
    index = index_of(100)
    write_mapped(index, tmp_path / "i.idx")
    mine = member_scratch(map_index(tmp_path / "i.idx"), "t")
    assert len(mine) == index.members and not mine.any()
    code = ("import sys; from pathlib import Path; from shardfeed.service.datasets.mapped import map_index, "
            "member_scratch; s = member_scratch(map_index(Path(sys.argv[1])), 't'); s[7] = 2; print(int(s[9]))")
    mine[9] = 1
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "i.idx")], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "1" and mine[7] == 2
    assert not member_scratch(index, "t").any()  # an index of no map: its own bytes


def map_files(pid: int) -> set[str]:
    """The index map files process ``pid`` has mapped."""
    with open(f"/proc/{pid}/maps") as f:
        return {line.split()[-1] for line in f if line.rstrip().endswith(".idx")}


@pytest.mark.slow
def test_the_workers_of_a_service_map_one_file_and_a_restarted_worker_maps_it_again(tmp_path):
    url, source = directory_dataset(tmp_path / "data", 60)
    cache = tmp_path / "cache"
    with start_service({"train": url}, cache_dir=cache, workers=2) as svc:
        files = list((cache / "indexes" / "mapped").glob("*.idx"))
        assert len(files) == 1
        made = files[0].stat()
        pids = worker_pids(svc)
        assert [map_files(pid) for pid in pids] == [{str(files[0])}] * 2
        os.kill(pids[1], signal.SIGKILL)
        deadline = time.monotonic() + 60
        while len(set(worker_pids(svc)) - set(pids)) < 1 or not all(map_files(p) for p in worker_pids(svc)):
            assert time.monotonic() < deadline, svc.log()[-3000:]
            time.sleep(0.2)
        for pid in worker_pids(svc):
            assert map_files(pid) == {str(files[0])}
        assert (files[0].stat().st_ino, files[0].stat().st_mtime_ns) == (made.st_ino, made.st_mtime_ns)
        indices = list(range(0, 60, 7))
        assert fetch_batch(svc.url, indices) == expected_members(source, "train", indices)
        assert httpx.get(f"{svc.url}/healthz", timeout=10).status_code == 200
