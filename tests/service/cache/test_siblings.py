"""Sibling workers' blocks read from their slabs (``service/cache/siblings.py``): warm batches make
no hop, a bad, missing or since replaced sibling block is never served, and its owner is asked
instead, so every block is still cached once on the host."""

from __future__ import annotations

import random
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from shardfeed.process import start_service
from shardfeed.service.cache.disk import BlockCache
from shardfeed.service.cache.names import BlockKey
from shardfeed.service.cache.siblings import SiblingBlocks
from shardfeed.service.observe.metrics import Metrics

from common.reliability import cached_blocks, damage_block, expected_members
from common.service import fetch_batch, hops, metrics
from common.workers import worker_blocks, directory_dataset, each_workers_shards, sibling_blocks, worker_urls

pytestmark = pytest.mark.slow  # starts several services, S3 servers or a browser; not in `make check`

SAMPLES = 240
ARGS = ["--block-size", "64KiB", "--peer-timeout", "5"]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return directory_dataset(tmp_path_factory.mktemp("siblings-data"), SAMPLES)  # 12 shards


# -- the reader, on real slabs -----------------------------------------------------------------
def sibling_of_six_blocks(tmp_path):
    """A sibling's cache (worker 1) of five full 4 KiB blocks and a short one, and a reader of it."""
    owner = BlockCache(tmp_path / "worker-1", 1 << 20, 4096, Metrics(), hints=True)
    owner.open()
    rng = random.Random(1)
    payloads = {BlockKey("d", "s", b): rng.randbytes(4096 if b < 5 else 1000) for b in range(6)}
    for key, payload in payloads.items():
        assert owner.write(key, payload)
    metrics = Metrics()
    return owner, payloads, SiblingBlocks({1: tmp_path / "worker-1"}, 4096, metrics), metrics


def test_a_sibling_block_is_read_verified_and_one_its_owner_let_go_of_is_left_out(tmp_path):
    owner, payloads, reader, metrics = sibling_of_six_blocks(tmp_path)
    assert reader.read(1, dict.fromkeys(payloads)) == {k: [p] for k, p in payloads.items()}
    key = BlockKey("d", "s", 5)
    assert reader.read(1, {key: [(0, 10), (900, 1000)]}) == {key: [payloads[key][:10], payloads[key][900:]]}
    owner.retain("d", [])  # evicted by its owner: unpublished
    got = reader.read(1, dict.fromkeys(payloads))
    assert got == {}
    assert [metrics.sibling_blocks.labels(r)._value.get() for r in ("read", "absent", "bad")] == [7, 6, 0]


def test_a_sibling_block_damaged_or_cut_short_is_bad_and_a_stale_hint_is_absent(tmp_path):
    owner, payloads, reader, metrics = sibling_of_six_blocks(tmp_path)
    rng = random.Random(2)
    slots = cached_blocks(tmp_path / "worker-1")
    damage_block(slots[BlockKey("d", "s", 0)], "garbage", rng)
    with open(slots[BlockKey("d", "s", 2)].data, "r+b") as f:  # one flipped payload byte
        f.seek(slots[BlockKey("d", "s", 2)].offset + 4000)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 1]))
    damage_block(slots[BlockKey("d", "s", 3)], "delete", rng)  # its header gone: not this block
    damage_block(slots[BlockKey("d", "s", 4)]._replace(size=100), "truncate", rng)  # cut within it, and 5 after it
    got = reader.read(1, dict.fromkeys(payloads))
    assert got == {BlockKey("d", "s", 1): [payloads[BlockKey("d", "s", 1)]]}
    assert [metrics.sibling_blocks.labels(r)._value.get() for r in ("read", "absent", "bad")] == [1, 1, 4]


def test_a_place_its_owner_writes_again_is_never_served_for_the_block_it_held(tmp_path):
    owner = BlockCache(tmp_path, 2 * 4096, 4096, Metrics(), hints=True)
    owner.open()
    first = BlockKey("d", "s", 0)
    owner.write(first, b"a" * 4096)
    reader = SiblingBlocks({1: tmp_path}, 4096, Metrics())
    assert reader.read(1, {first: None}) == {first: [b"a" * 4096]}
    owner.write(BlockKey("d", "s", 1), b"b" * 4096)
    owner.write(BlockKey("d", "s", 2), b"c" * 4096)  # evicts the first; its place is written again
    assert reader.read(1, {first: None}) == {}


# -- through the service -----------------------------------------------------------------------
@pytest.mark.parametrize("memory", ["64MiB", "0"])
def test_warm_batches_through_the_public_port_make_no_worker_hop_and_are_exact(dataset, tmp_path, memory):
    url, source = dataset
    order = list(range(SAMPLES))
    random.Random(2).shuffle(order)
    batches = [order[i:i + 24] for i in range(0, SAMPLES, 24)]
    with start_service({"train": url}, cache_dir=tmp_path / "cache", workers=2,
                       args=[*ARGS, "--memory-cache", memory]) as svc:
        urls = worker_urls(svc.url)
        assert fetch_batch(urls[0], order) == expected_members(source, "train", order)  # cold: owners cache
        before = [hops(u, "worker") for u in urls]
        with ThreadPoolExecutor(8) as pool:  # a fresh connection per batch: the kernel spreads them
            for _ in range(3):
                got = list(pool.map(lambda b: fetch_batch(svc.url, b), batches))
                assert got == [expected_members(source, "train", b) for b in batches]
        for u in urls:  # and each worker's own port, for sure both answer
            assert fetch_batch(u, order) == expected_members(source, "train", order)
        assert [hops(u, "worker") for u in urls] == before, "a warm batch crossed a sibling's socket"
        assert all(sibling_blocks(u, "read") > 0 for u in urls)
        if memory != "0":  # then on the lean path, from RAM
            assert all(metrics(u)["shardfeed_memory_cache_hits_total"] > 0 for u in urls)
        # The host's status counts blocks from a sibling's files as hits, beside RAM and disk.
        deadline = time.monotonic() + 15
        while (doc := httpx.get(f"{svc.url}/v1/stats").json())["cache"]["hits"]["sibling"] \
                != sum(sibling_blocks(u, "read") for u in urls):
            assert time.monotonic() < deadline, doc["cache"]
            time.sleep(0.2)
        assert doc["cache"]["hit_ratio"] > 0.7  # one cold pass, then four warm ones
        cache = tmp_path / "cache"
        assert worker_blocks(cache, 0) and worker_blocks(cache, 1)
        assert not worker_blocks(cache, 0) & worker_blocks(cache, 1), "a block cached twice on one host"


@pytest.mark.parametrize("damage", ["garbage", "delete"])
def test_a_bad_or_evicted_sibling_block_is_not_served_and_its_owner_is_asked(dataset, tmp_path, damage):
    """``delete`` is what an eviction does to a file a sibling was about to read."""
    url, source = dataset
    cache = tmp_path / "cache"
    # No RAM tier: the owner reads its disk again, so it also finds the damage and refetches.
    with start_service({"train": url}, cache_dir=cache, workers=2, args=[*ARGS, "--memory-cache", "0"]) as svc:
        urls = worker_urls(svc.url)
        theirs = [i for shard in each_workers_shards(svc.url, urls, SAMPLES)[1] for i in shard]
        assert fetch_batch(urls[1], theirs) == expected_members(source, "train", theirs)  # worker 1 caches them
        rng = random.Random(5)
        damaged = cached_blocks(cache / "worker-1")
        assert damaged
        for where in damaged.values():
            damage_block(where, damage, rng)
        before = hops(urls[0], "worker")
        order = list(range(SAMPLES))
        random.Random(6).shuffle(order)
        for _ in range(2):
            assert fetch_batch(urls[0], order) == expected_members(source, "train", order)
        assert hops(urls[0], "worker") > before, "the owner was not asked"
        assert sibling_blocks(urls[0], "bad" if damage == "garbage" else "absent") > 0
        assert metrics(urls[0])["shardfeed_peer_fallbacks_total"] == 0  # the owner answered
        if damage == "garbage":
            assert metrics(urls[1])["shardfeed_cache_corrupt_total"] > 0  # dropped by its owner
        assert worker_blocks(cache, 1) and not worker_blocks(cache, 0) & worker_blocks(cache, 1)
