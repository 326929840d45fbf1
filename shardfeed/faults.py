"""What the reliability harnesses (``benchmarks/chaos.py``, ``benchmarks/soak.py``) and the
reliability tests (``tests/common/reliability.py``) do to a service and watch of it: cache
block files broken in place, and the service's peak memory."""

from __future__ import annotations

import os
import random
from pathlib import Path

DAMAGE = ("flip", "truncate", "delete", "garbage")
"""The ways ``damage_block_file`` breaks a file."""


def damage_block_file(path: Path, how: str, rng: random.Random) -> None:
    """Break one cache block file in place, as a bad disk or a stray process would:
    ``flip`` one byte, ``truncate`` it, ``delete`` it, or overwrite it with ``garbage``."""
    try:
        size = path.stat().st_size
        if how == "delete":
            path.unlink()
        elif how == "truncate":
            os.truncate(path, rng.randrange(size))
        else:
            with open(path, "r+b") as f:
                if how == "flip":
                    f.seek(rng.randrange(size))
                    byte = f.read(1)
                    f.seek(-1, os.SEEK_CUR)
                    f.write(bytes([byte[0] ^ 0xFF]))
                else:
                    f.write(os.urandom(size))
    except (FileNotFoundError, ValueError):
        pass  # evicted or dropped meanwhile, or already empty


def peak_rss_mib(pid: int) -> float:
    """Peak resident memory of a process so far (``VmHWM``), in MiB."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmHWM for pid {pid}")
