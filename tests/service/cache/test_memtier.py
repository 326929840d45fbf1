"""The RAM tier (``--memory-cache``): bounded, a mirror of the disk cache (blocks leave it when
their disk copy is evicted or found corrupt), and serving exact bytes through the service."""

from __future__ import annotations

import random
import subprocess
import sys
import time

import httpx
import pytest

from shardfeed.process import start_service
from shardfeed.service.cache.disk import BlockCache
from shardfeed.service.cache.memtier import MemoryTier
from shardfeed.service.cache.names import BlockKey
from shardfeed.service.config import machine_memory
from shardfeed.service.observe.metrics import Metrics
from shardfeed.sizes import format_size

from common.datasets import dir_put, make_dataset
from common.reliability import cached_blocks, damage_block, expected_members, received_members
from common.service import metrics


def tier(capacity: int, block_size: int = 100) -> MemoryTier:
    return MemoryTier(capacity, Metrics(), block_size)


def test_the_tier_is_an_lru_bounded_in_bytes():
    t = tier(300)
    t.put("a", b"a" * 100)
    t.put("b", b"b" * 100)
    t.put("c", b"c" * 100)
    assert t.get("a") == b"a" * 100  # now the most recently used
    t.put("d", b"d" * 100)
    assert (t.get("b"), len(t), t.bytes) == (None, 3, 300)
    assert t.get("a") and t.get("c") and t.get("d")
    t.put("big", b"x" * 301)  # larger than the whole tier: not kept, nothing evicted for it
    assert (t.get("big"), len(t)) == (None, 3)
    t.put("a", b"A" * 50)  # replaced, not counted twice
    assert (t.get("a"), t.bytes) == (b"A" * 50, 250)
    t.discard("a")
    t.discard("never there")
    assert (t.get("a"), t.bytes, len(t)) == (None, 200, 2)


def test_a_block_read_from_disk_is_admitted_on_its_second_read_within_the_window():
    t = tier(64 * 100)  # 64 blocks of 100 bytes: about 32 first reads remembered
    assert not t.admits("hot") and t.admits("hot")  # read twice, close together: kept
    sweep = [f"scan{i}" for i in range(200)]
    assert not any(t.admits(key) for key in sweep)  # an epoch's sweep, each read once
    assert not any(t.admits(key) for key in sweep[:100])  # ... and again, far apart: still not
    assert not t.admits("hot") and t.admits("hot")


def test_blocks_evicted_from_disk_leave_the_tier(tmp_path):
    t = tier(1 << 20)
    cache = BlockCache(tmp_path, capacity=3 * 5000, block_size=4096, metrics=Metrics(), on_forget=t.discard)
    cache.open()
    keys = [BlockKey("d", "s", n) for n in range(6)]
    for key in keys:
        payload = bytes([key.block]) * 4096
        assert cache.write(key, payload)
        t.put(key, payload)
    # The disk keeps about three blocks; the tier holds exactly the blocks the disk holds.
    on_disk = [k for k in keys if k in cache]
    assert 0 < len(on_disk) < len(keys)
    assert [k for k in keys if t.get(k) is not None] == on_disk
    # Rewriting a block replaces the disk copy: the tier forgets the old one.
    cache.write(on_disk[-1], b"z" * 4096)
    assert t.get(on_disk[-1]) is None


def test_a_block_found_corrupt_on_disk_leaves_the_tier(tmp_path):
    t = tier(1 << 20)
    cache = BlockCache(tmp_path, capacity=1 << 20, block_size=4096, metrics=Metrics(), on_forget=t.discard)
    cache.open()
    key = BlockKey("d", "s", 0)
    cache.write(key, b"q" * 4096)
    t.put(key, b"q" * 4096)
    assert cache.read(key, None) == [b"q" * 4096]  # the whole block, verified
    where = cache.location(key)
    with open(where.data, "r+b") as f:
        f.seek(where.offset + 10)
        f.write(b"\0")
    assert cache.read(key, [(0, 100)]) is None
    assert t.get(key) is None and key not in cache


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    root = tmp_path_factory.mktemp("memtier-data")
    source = make_dataset(dir_put(root), samples=120, per_shard=40)
    return root.as_uri(), source


def read_all(url: str, source: dict, seed: int) -> None:
    indices = random.Random(seed).choices(range(120), k=200)  # repeats too
    resp = httpx.post(f"{url}/v1/batch", json={"dataset": "train", "indices": indices,
                                               "continue_on_error": True}, timeout=60)
    assert resp.status_code == 200, resp.text
    got, ended = received_members(resp.content)
    assert ended and got == expected_members(source, "train", indices)


@pytest.mark.slow
def test_ram_hits_serve_exact_bytes_and_a_damaged_disk_block_is_refetched_once_ram_lets_go(dataset, tmp_path):
    url, source = dataset
    args = ["--block-size", "64KiB", "--merge-gap", "0", "--memory-cache", "256KiB"]
    with start_service({"train": url}, cache_dir=tmp_path / "cache", args=args) as svc:
        read_all(svc.url, source, 0)
        read_all(svc.url, source, 1)
        m = metrics(svc.url)
        assert m["shardfeed_memory_cache_hits_total"] > 0
        assert 0 < m["shardfeed_memory_cache_bytes"] <= 256 << 10  # bounded: four blocks of 64 KiB
        # The blocks came in pool buffers, reused: the pool within its bound, nothing made outside it.
        assert 0 < m["shardfeed_block_buffers_bytes"] <= (256 << 10) + 4 * 32 * (64 << 10)
        assert m["shardfeed_block_buffers_outside"] == 0
        rng = random.Random(3)
        for where in cached_blocks(tmp_path / "cache").values():  # every disk block damaged
            damage_block(where._replace(size=where.size // 2), "flip", rng)  # in the payload, not its padding
        for seed in range(2, 5):
            read_all(svc.url, source, seed)
            for i in (0, 41, 119):
                assert httpx.get(f"{svc.url}/v1/datasets/train/samples/{i}/bin").content == source[(i, "bin")]
        assert metrics(svc.url)["shardfeed_cache_corrupt_total"] > 0  # found when RAM did not hold them


@pytest.mark.slow
def test_fetched_blocks_that_the_disk_refuses_leave_the_tier(dataset, tmp_path):
    """Fetched blocks enter the tier before they are written; a block the disk cache refuses
    leaves it again, so the tier still holds only what the disk holds."""
    url, source = dataset
    args = ["--block-size", "64KiB", "--merge-gap", "0", "--memory-cache", "1MiB"]
    with start_service({"train": url}, cache_dir=tmp_path / "cache", args=args) as svc:
        (tmp_path / "cache" / "slabs").write_bytes(b"in the way")  # where its slabs would go
        read_all(svc.url, source, 0)
        read_all(svc.url, source, 1)
        deadline = time.monotonic() + 30  # the answers may go out before the writes fail
        while (m := metrics(svc.url))["shardfeed_memory_cache_bytes"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert m["shardfeed_memory_cache_bytes"] == 0
        assert m["shardfeed_cache_write_errors_total"] > 0
        assert m["shardfeed_cache_blocks"] == 0


def test_a_memory_cache_larger_than_the_ram_is_refused_with_one_line(tmp_path):
    too_much = format_size(2 * machine_memory())
    done = subprocess.run([sys.executable, "-m", "shardfeed", "serve", "--cache-dir", str(tmp_path),
                           "--memory-cache", too_much], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert done.stderr.strip().startswith("shardfeed: error: --memory-cache must be between 0B and ")
    assert done.stderr.strip().endswith(f"(the machine's RAM), not {too_much}")
    assert len(done.stderr.strip().splitlines()) == 1
