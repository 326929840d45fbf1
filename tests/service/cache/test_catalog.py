"""The block cache's catalogue (``service/cache/catalog.py``): a kept cache reopens from it
without looking at its slabs, survives a crash at any point of a write or an eviction
without ever serving an unverified byte, and eviction ranks a few blocks, not all."""

from __future__ import annotations

import random

import numpy as np
import pytest

from shardfeed.service.cache.catalog import CATALOG, MAGIC, RECORD, STREAMS, Catalog, block_key, listed
from shardfeed.service.cache.disk import BlockCache
from shardfeed.service.cache.names import BlockKey
from shardfeed.service.cache.slabs import Slabs, block_name, place_of
from shardfeed.service.observe.metrics import Metrics

from common.reliability import cached_blocks, damage_block
from common.wait import wait_until

BLOCK = 4096


def cache_at(directory, capacity_blocks: int = 1000, victims=None) -> BlockCache:
    cache = BlockCache(directory, capacity_blocks * BLOCK, BLOCK, Metrics(), direct_writes=False,
                       victims=victims)
    cache.open()
    return cache


def payload(i: int) -> bytes:
    return bytes([i % 251]) * BLOCK


def keys(n: int, shard: str = "s1") -> list[BlockKey]:
    return [BlockKey("d1", shard, i) for i in range(n)]


def kept(directory, blocks: list[BlockKey]) -> None:
    """A cache left behind by a run that wrote ``blocks``."""
    cache = cache_at(directory)
    for key in blocks:
        assert cache.write(key, payload(key.block))
    cache.close()


def test_a_kept_cache_reopens_from_its_catalogue_with_every_block_and_their_order(tmp_path):
    cache = cache_at(tmp_path, capacity_blocks=10)
    for key in keys(8):
        assert cache.write(key, payload(key.block))
    cache.read(keys(1)[0], None)  # block 0 is now the most recently used
    cache.close()
    again = cache_at(tmp_path, capacity_blocks=10)
    assert again.bytes == cache.bytes and again.held("d1").total == 8
    assert [again.read(k, [(0, 3)]) for k in keys(8)] == [[payload(i)[:3]] for i in range(8)]
    again.close()
    # A smaller capacity at the next open evicts the least recently written first.
    small = cache_at(tmp_path, capacity_blocks=3)
    assert [k in small for k in keys(8)] == [False] * 5 + [True] * 3
    small.close()


def test_a_crash_at_any_point_leaves_nothing_unverified_served(tmp_path):
    kept(tmp_path, keys(6))
    slots = cached_blocks(tmp_path)
    rng = random.Random(3)
    # A block overwritten in place (checksums fail), one whose header is lost (a crash while a
    # place was written again, its record lost), one with a flipped byte, a torn record at the end.
    damage_block(slots[keys(6)[0]], "garbage", rng)
    damage_block(slots[keys(6)[1]], "delete", rng)
    damage_block(slots[keys(6)[2]]._replace(size=BLOCK - 1), "flip", rng)
    with open(tmp_path / CATALOG, "ab") as f:
        f.write(b"\x07" * 9)
    # A block written in a free place whose record never was (a crash between the two).
    Slabs(tmp_path, BLOCK).write(place_of(0, 6), block_name("d1", "s1", BLOCK, 99), payload(99))
    again = cache_at(tmp_path)
    assert [again.read(k, None) for k in keys(6)] == [None, None, None] + [[payload(i)] for i in (3, 4, 5)]
    assert [k in again for k in keys(6)] == [False] * 3 + [True] * 3  # the bad ones dropped
    assert again.read(BlockKey("d1", "s1", 99), None) is None
    # The torn tail was cut off: records appended from here on read back, and the places
    # given back are written again.
    for i in range(4):
        assert again.write(BlockKey("d1", "s2", i), payload(10 + i))
    again.close()
    third = cache_at(tmp_path)
    assert [third.read(BlockKey("d1", "s2", i), None) for i in range(4)] == [[payload(10 + i)] for i in range(4)]
    assert sorted(e.place for e in listed(tmp_path)) == list(range(7))
    assert (tmp_path / CATALOG).stat().st_size % RECORD.itemsize == len(MAGIC) % RECORD.itemsize
    third.close()


def test_two_records_of_one_place_leave_it_to_the_later_block(tmp_path):
    # Records lost to a full disk: a place let go of and written again, the first block still listed.
    kept(tmp_path, keys(1))
    slabs = Slabs(tmp_path, BLOCK)
    slabs.write(place_of(0, 0), block_name("d1", "s9", BLOCK, 0), payload(9))
    catalog = Catalog(tmp_path, BLOCK)
    catalog.load()
    catalog.start()
    catalog.add(block_key(catalog.stream("d1", "s9", BLOCK), 0), place_of(0, 0), BLOCK)
    catalog.close()
    again = cache_at(tmp_path)
    assert keys(1)[0] not in again and again.read(BlockKey("d1", "s9", 0), None) == [payload(9)]
    again.close()


def test_blocks_of_another_block_size_are_let_go_of_at_open(tmp_path):
    kept(tmp_path, keys(3))
    other = BlockCache(tmp_path, 10 * 2 * BLOCK, 2 * BLOCK, Metrics(), direct_writes=False)
    other.open()
    assert [k in other for k in keys(3)] == [False] * 3 and other.bytes == 0
    assert other.write(keys(1)[0], payload(5) * 2)  # into a place a 4 KiB block had
    assert other.read(keys(1)[0], None) == [payload(5) * 2]
    other.close()


def test_a_torn_streams_file_loses_only_the_blocks_of_the_torn_line(tmp_path):
    kept(tmp_path, keys(2, "a") + keys(2, "b"))
    lines = (tmp_path / STREAMS).read_text().splitlines(keepends=True)
    assert len(lines) == 2
    (tmp_path / STREAMS).write_text(lines[0] + lines[1][:7])
    again = cache_at(tmp_path)
    assert [k in again for k in keys(2, "a") + keys(2, "b")] == [True, True, False, False]
    assert again.read(keys(1, "a")[0], None) == [payload(0)]
    again.close()


def test_a_directory_without_a_catalogue_starts_empty_and_an_older_shardfeeds_files_go(tmp_path):
    kept(tmp_path, keys(4))
    (tmp_path / CATALOG).write_bytes(b"not a catalogue")  # or a catalogue lost
    (tmp_path / STREAMS).unlink()
    older = tmp_path / "older"
    old = older / "0123456789ab"  # an older shardfeed's dataset folder of block files
    old.mkdir(parents=True)
    (old / "s-1000-00000000.blk").write_bytes(payload(1))
    (older / CATALOG).write_bytes(b"shardfeed-cat-1\n")
    assert cache_at(older).bytes == 0
    again = cache_at(tmp_path)
    assert [k in again for k in keys(4)] == [False] * 4 and again.bytes == 0
    assert again.write(keys(1)[0], payload(8)) and again.read(keys(1)[0], None) == [payload(8)]
    assert (tmp_path / CATALOG).read_bytes().startswith(MAGIC)
    wait_until(lambda: not old.exists(), 10, "the older shardfeed's block files removed")
    again.close()


def test_records_are_rewritten_when_they_outnumber_the_blocks(tmp_path):
    cache = cache_at(tmp_path, capacity_blocks=4)
    for i in range(3000):
        cache.write(BlockKey("d1", "s1", i), payload(i))
    cache.close()
    records = ((tmp_path / CATALOG).stat().st_size - len(MAGIC)) // RECORD.itemsize
    assert records <= 2 * 4 + 4096 + 1
    again = cache_at(tmp_path, capacity_blocks=4)
    assert [BlockKey("d1", "s1", i) in again for i in range(2996, 3000)] == [True] * 4
    again.close()


def test_eviction_keeps_the_capacity_and_asks_the_policy_about_a_sample_of_blocks(tmp_path):
    asked = []

    class KeepEven:
        def victim_order(self, candidates: list[BlockKey]) -> list[BlockKey]:
            asked.append(len(candidates))
            return sorted(candidates, key=lambda k: k.block % 2 == 0)  # odd blocks go first

    cache = cache_at(tmp_path, capacity_blocks=100, victims=KeepEven())
    for i in range(300):
        cache.write(BlockKey("d1", "s1", i), payload(i))
        assert cache.bytes <= cache.capacity
    assert max(asked) == 64 and len(asked) == 200
    held = [i for i in range(300) if BlockKey("d1", "s1", i) in cache]
    assert len(held) == 100 and sum(i % 2 == 0 for i in held) > 90
    cache.close()


def test_the_catalogue_holds_under_a_hundred_bytes_a_block():
    catalog = Catalog(None, 1 << 20)
    n = 200_000
    streams = [catalog.stream("d", f"s{i}", 1 << 20) for i in range(n // 1000)]
    for i in range(n):
        catalog.add(block_key(streams[i % len(streams)], i // len(streams)), place_of(8, i), 1 << 20)
    assert catalog.count == n and catalog.nbytes / n < 100
    rng = np.random.default_rng(0)
    slots = catalog.candidates(rng, 64)
    assert len(set(slots.tolist())) == 64 and (np.diff([catalog._tick[s] for s in slots]) >= 0).all()
    for slot in slots.tolist():
        catalog.remove(slot)
    assert catalog.count == n - 64


@pytest.mark.parametrize("readers", [4])
def test_concurrent_writes_reads_and_evictions_agree_with_the_catalogue(tmp_path, readers):
    from concurrent.futures import ThreadPoolExecutor

    cache = cache_at(tmp_path, capacity_blocks=50)

    def work(seed: int) -> None:
        rng = np.random.default_rng(seed)
        for i in rng.integers(0, 200, 300).tolist():
            key = BlockKey("d1", "s1", i)
            got = cache.read(key, None)
            assert got is None or got == [payload(i)]
            if got is None:
                cache.write(key, payload(i))

    with ThreadPoolExecutor(readers) as pool:
        list(pool.map(work, range(readers)))
    assert cache.bytes <= cache.capacity
    on_disk = listed(tmp_path)
    assert sorted(e.key for e in on_disk) == [BlockKey("d1", "s1", i) for i in range(200)
                                             if BlockKey("d1", "s1", i) in cache]
    assert len({e.place for e in on_disk}) == len(on_disk)  # no place twice
    assert all(cache.read(e.key, None) == [payload(e.key.block)] for e in on_disk)
    cache.close()
