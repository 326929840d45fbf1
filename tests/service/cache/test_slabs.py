"""Slabs (``service/cache/slabs.py``) and block buffers (``shardfeed/buffers.py``): blocks written
around the page cache where the filesystem allows, through it where it refuses, from pool
buffers uncopied, read back verified either way; a slot holding another block, cut short or
damaged is refused; an evicted slot's disk is given back."""

from __future__ import annotations

import errno
import os

import pytest

from shardfeed.buffers import BufferPool
from shardfeed.service.cache.disk import BlockCache
from shardfeed.service.cache.names import BlockKey
from shardfeed.service.cache.slabs import CHUNK, BadBlock, NotThisBlock, Slabs, SlotSpace, block_name, slot_sizes
from shardfeed.service.observe.metrics import Metrics

BLOCK = 4 << 20
# Around every alignment the slabs care about: the 4 KiB page, the 16 KiB checksum chunk,
# the 64 KiB past which reads go around the page cache, and the slot sizes.
SIZES = [1, 4095, 4096, 4097, CHUNK + 1, (64 << 10) - 1, 64 << 10, (1 << 20) - 1, 1 << 20, (1 << 20) + 5,
         3 * (1 << 20) + 123, BLOCK]


def payload(n: int) -> bytes:
    return (bytes(range(251)) * (n // 251 + 1))[:n]


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "buffered"])
@pytest.mark.parametrize("pooled", [True, False], ids=["pool", "bytes"])
def test_a_written_block_reads_back_whole_and_in_ranges(tmp_path, direct, pooled):
    buffers = BufferPool(BLOCK, 8 * BLOCK)
    slabs = Slabs(tmp_path, BLOCK, direct=direct, buffers=buffers)
    space = SlotSpace(BLOCK)
    for n in SIZES:
        data = payload(n)
        source = data
        if pooled:
            source = buffers.take(n)
            source[:] = data
        place = space.take(n)
        slabs.write(place, block_name("d", "s", BLOCK, n), source)
        assert slabs.read(place, block_name("d", "s", BLOCK, n), None) == [data]
        ranges = [(0, 1), (n // 2, n), (n - 1, n)]
        assert slabs.read(place, block_name("d", "s", BLOCK, n), ranges) == [data[a:b] for a, b in ranges]
    assert slabs.direct is direct


def test_a_block_takes_the_smallest_slot_that_holds_it_and_slots_are_reused():
    space = SlotSpace(1 << 20)
    assert space.sizes == slot_sizes(1 << 20) == [4096 << i for i in range(9)]
    assert [space.sizes[space.fits(n)] for n in (1, 4096, 4097, 100_000, 1 << 20)] == \
        [4096, 4096, 8192, 128 << 10, 1 << 20]
    first = space.take(1 << 20)
    second = space.take(1 << 20)
    assert first != second
    space.give_back(first)
    assert space.take(1000 << 10) == first  # the slot let go of is the next taken
    assert SlotSpace(5000).sizes == [4096, 8192]  # a block size that is not a power of two


def test_a_slot_holding_another_block_cut_short_or_flipped_is_refused(tmp_path):
    slabs = Slabs(tmp_path, 1 << 20)
    space = SlotSpace(1 << 20)
    places = [space.take(1 << 20) for _ in range(3)]
    for i, place in enumerate(places):
        slabs.write(place, block_name("d", "s", 1 << 20, i), payload(1 << 20))
    with pytest.raises(NotThisBlock):
        slabs.read(places[0], block_name("d", "s", 1 << 20, 7), None)
    where = slabs.location(places[1])
    with open(where.data, "r+b") as f:
        f.seek(where.offset + 70_000)
        f.write(b"\xff")
    with pytest.raises(BadBlock, match="checksum"):
        slabs.read(places[1], block_name("d", "s", 1 << 20, 1), [(65_536, 80_000)])
    assert slabs.read(places[1], block_name("d", "s", 1 << 20, 1), [(0, 1000)]) == [payload(1000)]  # other chunks
    os.truncate(slabs.location(places[2]).data, slabs.location(places[2]).offset + 5000)
    with pytest.raises(BadBlock, match="cut short"):
        slabs.read(places[2], block_name("d", "s", 1 << 20, 2), None)


def test_an_evicted_blocks_slot_is_given_back_to_the_filesystem(tmp_path):
    cache = BlockCache(tmp_path, 4 << 20, 1 << 20, Metrics())
    cache.open()
    for i in range(12):
        assert cache.write(BlockKey("d", "s", i), payload(1 << 20))
    data = tmp_path / "slabs" / f"{1 << 20:x}.data"
    assert data.stat().st_size >= 5 << 20  # written in more places than it holds blocks...
    assert data.stat().st_blocks * 512 <= 4 << 20  # ...but only what it holds takes disk
    assert cache.bytes == 4 << 20
    assert [cache.read(BlockKey("d", "s", i), [(0, 5)]) for i in range(8, 12)] == [[payload(5)]] * 4
    cache.close()


@pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="no O_DIRECT on this system")
def test_a_cache_whose_filesystem_refuses_direct_io_goes_through_the_page_cache(tmp_path, monkeypatch):
    # As tmpfs before Linux 6.6 and some FUSE filesystems do: EINVAL on open.
    real_open, asked = os.open, []

    def refusing_open(path, flags, *args):
        if flags & os.O_DIRECT:
            asked.append(path)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", refusing_open)
    buffers = BufferPool(1 << 20, 4 << 20)
    cache = BlockCache(tmp_path / "cache", capacity=1 << 30, block_size=1 << 20, metrics=Metrics(), buffers=buffers)
    cache.open()
    data = payload((1 << 20) - 3)
    for block in range(3):
        assert cache.write(BlockKey("d", "s", block), data)
        assert cache.read(BlockKey("d", "s", block), None) == [data]
    assert len(asked) == 1 and cache.direct_writes is False  # asked once, then through the page cache


def test_pool_buffers_are_reused_only_once_nothing_refers_to_them():
    pool = BufferPool(1 << 20, 3 << 20)
    a = pool.take(100)
    b = pool.take(1 << 20)
    a[:3] = b"abc"
    view = a[1:2]  # a slice still being sent holds its buffer
    del a
    c = pool.take(10)
    assert pool.made == 3 and bytes(view) == b"b"
    del view
    d = pool.take(10)  # the first buffer again: nothing refers to it
    assert pool.made == 3 and pool.outside == 0
    assert pool.whole(d) is not None and pool.whole(d[1:]) is None and pool.whole(memoryview(b"x")) is None
    e = pool.take(10)  # past the pool's bound: a buffer of its own
    big = pool.take(2 << 20)  # larger than its buffers: the same
    assert pool.outside == 2 and len(e) == 10 and len(big) == 2 << 20
    assert pool.bytes == 3 << 20 and (b, c)


def test_buffers_the_ram_tier_lets_go_of_are_found_without_a_search():
    pool = BufferPool(4096, 64 * 4096)
    taken = [pool.take(4096) for _ in range(64)]
    last = taken.pop()
    pool.returned(last)
    del last
    assert pool.take(10) is not None and pool.made == 64 and pool.outside == 0
