"""Block files (``service/cache/blockfile.py``): written around the page cache where the filesystem
allows, buffered where it refuses, read back verified either way."""

from __future__ import annotations

import errno
import os

import pytest

from shardfeed.service.cache.blockfile import CHUNK, BadBlock, BlockFile, file_size, write_file
from shardfeed.service.cache.disk import BlockCache
from shardfeed.service.cache.names import BlockKey
from shardfeed.service.observe.metrics import Metrics

# Around every alignment the direct writer cares about: the 4 KiB page, the 16 KiB checksum
# chunk, its own pieces of 1 MiB + 64 KiB (a 1 MiB block and its trailer in one write).
PIECE = (1 << 20) + (64 << 10)
SIZES = [1, 4095, 4096, 4097, CHUNK + 1, (1 << 20) - 1, 1 << 20, (1 << 20) + 5, PIECE - 1, PIECE, PIECE + 1,
         3 * (1 << 20) + 123]


def payload(n: int) -> bytes:
    return (bytes(range(251)) * (n // 251 + 1))[:n]


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "buffered"])
@pytest.mark.parametrize("n", SIZES)
def test_a_written_block_reads_back_whole_and_in_ranges(tmp_path, n, direct):
    data = payload(n)
    path = tmp_path / "b.blk"
    write_file(path, data, direct=direct)
    assert os.path.getsize(path) == file_size(n)
    block = BlockFile(path, file_size(n))
    assert block.read(None) == [data]
    ranges = [(0, 1), (n // 2, n), (n - 1, n)]
    assert block.read(ranges) == [data[a:b] for a, b in ranges]


def test_memoryviews_are_written_like_bytes(tmp_path):
    data = payload(3 * CHUNK)
    write_file(tmp_path / "a", memoryview(data)[CHUNK:], direct=True)
    assert BlockFile(tmp_path / "a").read(None) == [data[CHUNK:]]


@pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="no O_DIRECT on this system")
def test_a_cache_whose_filesystem_refuses_direct_writes_writes_buffered(tmp_path, monkeypatch):
    # As tmpfs before Linux 6.6 and some FUSE filesystems do: EINVAL on open.
    real_open, asked = os.open, []

    def refusing_open(path, flags, *args):
        if flags & os.O_DIRECT:
            os.close(real_open(path, flags & ~os.O_DIRECT, *args))  # a missing directory fails first
            asked.append(path)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", refusing_open)
    cache = BlockCache(tmp_path / "cache", capacity=1 << 30, block_size=1 << 20, metrics=Metrics())
    cache.open()
    data = payload((1 << 20) - 3)
    for block in range(3):
        assert cache.write(BlockKey("d", "s", block), data)
        assert cache.read(BlockKey("d", "s", block), None) == [data]
    assert len(asked) == 1 and cache.direct_writes is False  # asked once, then buffered


def test_a_file_cut_after_a_direct_write_is_refused(tmp_path):
    path = tmp_path / "b.blk"
    write_file(path, payload(100_000), direct=True)
    with open(path, "r+b") as f:
        f.truncate(file_size(100_000) - 1)
    with pytest.raises(BadBlock):
        BlockFile(path).read(None)
