"""What the reliability harnesses (``benchmarks/chaos.py``, ``benchmarks/soak.py``) and the
reliability tests (``tests/common/reliability.py``) do to a service and watch of it: cached
blocks broken in place in the slabs, and the service's peak memory."""

from __future__ import annotations

import os
import random
from pathlib import Path

from shardfeed.service.cache.catalog import listed
from shardfeed.service.cache.names import BlockKey
from shardfeed.service.cache.slabs import Slabs, SlotLocation

DAMAGE = ("flip", "truncate", "delete", "garbage")
"""The ways ``damage_block`` breaks a cached block."""


def cached_blocks(directory: Path) -> dict[BlockKey, SlotLocation]:
    """The blocks a cache directory holds (its catalogue on disk), and where each is."""
    return {entry.key: Slabs(Path(directory), entry.block_size, writable=False).location(entry.place)
            for entry in listed(Path(directory))}


def damage_block(where: SlotLocation, how: str, rng: random.Random) -> None:
    """Break one cached block in place, as a bad disk or a stray process would: ``flip`` one
    byte of its slot, cut its slab short within it (``truncate``), lose its header (``delete``),
    or overwrite its slot with ``garbage``."""
    try:
        if how == "truncate":
            os.truncate(where.data, where.offset + rng.randrange(where.size))
            return
        path, at, size = ((where.head, where.head_offset, where.head_size) if how == "delete"
                          else (where.data, where.offset, where.size))
        with open(path, "r+b") as f:
            if how == "flip":
                f.seek(at + rng.randrange(size))
                byte = f.read(1) or b"\0"
                f.seek(-len(byte), os.SEEK_CUR)
                f.write(bytes([byte[0] ^ 0xFF]))
            else:
                f.seek(at)
                f.write(bytes(size) if how == "delete" else os.urandom(size))
    except FileNotFoundError:
        pass  # nothing written there yet


def peak_rss_mib(pid: int) -> float:
    """Peak resident memory of a process so far (``VmHWM``), in MiB."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmHWM for pid {pid}")
