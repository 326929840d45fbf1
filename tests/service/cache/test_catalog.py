"""The block cache's catalogue (``service/cache/catalog.py``): a kept cache reopens from it
without looking at its files, survives a crash at any point of a write or an eviction
without ever serving an unverified byte, and eviction ranks a few blocks, not all."""

from __future__ import annotations


import numpy as np
import pytest

from shardfeed.service.cache.catalog import CATALOG, MAGIC, RECORD, STREAMS, Catalog, block_key
from shardfeed.service.cache.disk import BlockCache
from shardfeed.service.cache.names import BlockKey
from shardfeed.service.observe.metrics import Metrics

from common.wait import wait_until

BLOCK = 4096


def cache_at(directory, capacity_blocks: int = 1000, victims=None) -> BlockCache:
    cache = BlockCache(directory, capacity_blocks * (BLOCK + 64), BLOCK, Metrics(), direct_writes=False,
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


def test_a_crash_at_any_point_leaves_nothing_unverified_served_and_orphans_are_removed(tmp_path):
    kept(tmp_path, keys(6))
    directory = tmp_path / "d1"
    name = keys(6)[0].filename(BLOCK).split("/")[1]
    # A block whose file is cut short (a disk that lost a tail), one whose file is gone (a
    # crash between an eviction's record and its unlink, reversed), a torn record at the end.
    (directory / keys(6)[1].filename(BLOCK).split("/")[1]).write_bytes(payload(1)[:100])
    (directory / keys(6)[2].filename(BLOCK).split("/")[1]).unlink()
    (directory / name).write_bytes(b"\0" * (BLOCK + 64))  # overwritten in place: checksums fail
    with open(tmp_path / CATALOG, "ab") as f:
        f.write(b"\x07" * 9)
    # A file no record names (a crash after an eviction's record, before its unlink), and a
    # temporary file of a write that never finished.
    orphan = directory / BlockKey("d1", "s1", 99).filename(BLOCK).split("/")[1]
    orphan.write_bytes(payload(99))
    temp = directory / f".tmp-{orphan.name}-1"
    temp.write_bytes(b"half")
    again = cache_at(tmp_path)
    assert [again.read(k, None) for k in keys(6)] == [None, None, None] + [[payload(i)] for i in (3, 4, 5)]
    assert [k in again for k in keys(6)] == [False] * 3 + [True] * 3  # the bad ones dropped
    wait_until(lambda: not orphan.exists() and not temp.exists(), 10, "the orphan scan removing what no record names")
    assert again.read(BlockKey("d1", "s1", 99), None) is None
    # The torn tail was cut off: records appended from here on read back.
    again.write(BlockKey("d1", "s2", 0), payload(7))
    again.close()
    third = cache_at(tmp_path)
    assert third.read(BlockKey("d1", "s2", 0), None) == [payload(7)]
    assert (tmp_path / CATALOG).stat().st_size % RECORD.itemsize == len(MAGIC) % RECORD.itemsize
    third.close()


def test_a_torn_streams_file_loses_only_the_blocks_of_the_torn_line(tmp_path):
    kept(tmp_path, keys(2, "a") + keys(2, "b"))
    lines = (tmp_path / STREAMS).read_text().splitlines(keepends=True)
    assert len(lines) == 2
    (tmp_path / STREAMS).write_text(lines[0] + lines[1][:7])
    again = cache_at(tmp_path)
    assert [k in again for k in keys(2, "a") + keys(2, "b")] == [True, True, False, False]
    assert again.read(keys(1, "a")[0], None) == [payload(0)]
    again.close()


def test_a_directory_without_a_catalogue_is_scanned_once_and_then_catalogued(tmp_path):
    kept(tmp_path, keys(4))
    (tmp_path / CATALOG).write_bytes(b"not a catalogue")  # or an older shardfeed's directory
    (tmp_path / STREAMS).unlink()
    again = cache_at(tmp_path)
    assert [again.read(k, None) for k in keys(4)] == [[payload(i)] for i in range(4)]
    assert (tmp_path / CATALOG).read_bytes().startswith(MAGIC)
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
    catalog = Catalog(None)
    n = 200_000
    streams = [catalog.stream("d", f"s{i}", 1 << 20) for i in range(n // 1000)]
    for i in range(n):
        catalog.add(block_key(streams[i % len(streams)], i // len(streams)), 1 << 20)
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
    files = sorted(p.name for p in (tmp_path / "d1").glob("*.blk"))
    held = sorted(BlockKey("d1", "s1", i).filename(BLOCK).split("/")[1] for i in range(200)
                  if BlockKey("d1", "s1", i) in cache)
    assert files == held
    cache.close()


def test_a_file_that_vanishes_during_the_orphan_scan_does_not_stop_it(tmp_path):
    # A file gone between the listing and its stat or unlink (a block dropped by a read at
    # that moment) once ended the scan, leaving the orphans after it: a dangling temporary
    # name, whose stat fails so, stands in for it anywhere in the listing.
    kept(tmp_path, keys(2))
    directory = tmp_path / "d1"
    orphans = [directory / BlockKey("d1", "s1", 100 + i).filename(BLOCK).split("/")[1] for i in range(50)]
    for path in orphans:
        path.write_bytes(payload(1))
    (directory / ".tmp-vanished").symlink_to(directory / "no-such-file")
    again = cache_at(tmp_path)
    wait_until(lambda: not any(path.exists() for path in orphans), 10, "the orphan scan past the vanished file")
    assert [again.read(k, None) for k in keys(2)] == [[payload(0)], [payload(1)]]
    again.close()
