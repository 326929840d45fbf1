"""The figures behind the block cache's slabs and buffer pool: CPU per MiB of each way of
writing a block, reading it back and getting a buffer for it, on this machine's disk.

- writes: a file per block (``open``, ``O_DIRECT`` write, ``ftruncate``, ``close``, rename,
  and the ``unlink`` its eviction costs), against a write into a slot of one large file
  (``slabs.py``), into a slot written before, and into a hole punched by an eviction;
- reads of a block written around the page cache: through the page cache into a new
  ``bytes`` (the first read fills the page cache), against ``O_DIRECT`` into a pool buffer;
- buffers: a new 1 MiB ``bytearray`` filled (pages faulted and zeroed when first written),
  a new pool buffer filled (its pages faulted in at once, ``MAP_POPULATE``), and a pool
  buffer filled again (``shardfeed/buffers.py``).

    python -m shardfeed.benchmarks.slabs --blocks 300 --dir /var/cache/shardfeed
"""

from __future__ import annotations

import argparse
import mmap
import os
import resource
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from shardfeed.buffers import BufferPool, _mapped
from shardfeed.service.cache.slabs import _PUNCH_HOLE, _fallocate

MiB = 1 << 20


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def measured(name: str, blocks: int, each: Callable[[int], None]) -> None:
    """Run ``each(i)`` for every block; print its CPU and wall time per MiB."""
    cpu, wall = _cpu(), time.perf_counter()
    for i in range(blocks):
        each(i)
    cpu, wall = _cpu() - cpu, time.perf_counter() - wall
    print(f"  {name:52s} {cpu / blocks * 1e3:6.3f} ms CPU/MiB   {wall / blocks * 1e3:6.3f} ms wall/MiB", flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=300, help="1 MiB blocks per measurement")
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: a temporary directory)")
    args = parser.parse_args(argv)
    if args.blocks < 1:
        parser.error("--blocks must be at least 1")
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        root = Path(tmp)
        block = mmap.mmap(-1, MiB)
        block[:] = os.urandom(MiB)
        n = args.blocks
        print(f"{n} blocks of 1 MiB in {root}:")

        def file_per_block(i: int) -> None:
            temp, path = root / f".tmp-{i}", root / f"{i}.blk"
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
            os.write(fd, block)
            os.ftruncate(fd, MiB)
            os.close(fd)
            os.replace(temp, path)

        measured("write: a new file per block", n, file_per_block)
        measured("evict: unlink its file", n, lambda i: os.unlink(root / f"{i}.blk"))
        slab = os.open(root / "slab", os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o644)
        measured("write: a slot of a slab, new", n, lambda i: os.pwrite(slab, block, i * MiB))
        measured("write: a slot of a slab, written before", n, lambda i: os.pwrite(slab, block, i * MiB))
        measured("evict: punch its slot's hole", n, lambda i: _fallocate(slab, _PUNCH_HOLE, i * MiB, MiB))
        measured("write: a slot of a slab, punched", n, lambda i: os.pwrite(slab, block, i * MiB))
        buffered = os.open(root / "slab", os.O_RDONLY)
        pool = BufferPool(MiB, 4 * MiB)
        measured("read: O_DIRECT into a pool buffer", n, lambda i: os.preadv(slab, [pool.take(MiB)], i * MiB))
        measured("read: through the page cache, first, new bytes", n, lambda i: os.pread(buffered, MiB, i * MiB))
        measured("read: through the page cache, again, new bytes", n, lambda i: os.pread(buffered, MiB, i * MiB))

        def fresh(i: int) -> None:
            buffer = bytearray(MiB)
            buffer[:] = block

        def pooled(i: int) -> None:
            buffer = pool.take(MiB)
            buffer[:] = block

        def new_pooled(i: int) -> None:
            buffer = _mapped(MiB)
            buffer[:] = block

        measured("buffer: a new bytearray, filled", n, fresh)
        measured("buffer: a new pool buffer, filled", n, new_pooled)
        measured("buffer: a pool buffer again, filled", n, pooled)
        os.close(slab)
        os.close(buffered)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
