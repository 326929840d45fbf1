"""The ``shardfeed`` command line in a subprocess, as a user runs it, and a dataset read back
through its index."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import numpy as np

from shardfeed.service.datasets.index import Index, load_index
from shardfeed.service.stores import open_store


def shardfeed(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shardfeed.cli", "--quiet", *args], capture_output=True,
                          text=True, timeout=120, env={**os.environ, **(env or {})})


def ok(*args: str) -> str:
    result = shardfeed(*args)
    assert result.returncode == 0, result.stderr
    return result.stdout


def fails(*args: str, env: dict | None = None) -> str:
    """Run a command that must fail; return its one-line error."""
    result = shardfeed(*args, env=env)
    assert result.returncode != 0
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("shardfeed: error: "), result.stderr
    return lines[0]


def run(coro):
    return asyncio.run(coro)


async def with_store(url, fn):
    async with open_store(url) as store:
        return await fn(store)


def members_through_index(url: str) -> tuple[Index, dict[tuple[str, str], bytes]]:
    """Every member of the dataset at ``url``, read with one ranged read at its indexed offset and size."""
    async def go(store):
        index = await load_index(store)
        m = index.lookup(np.arange(len(index)))
        datas = await asyncio.gather(*(store.read_range(index.shards[s], int(o), int(z))
                                       for s, o, z in zip(m.shard, m.offset, m.size)))
        names = [(index.key(int(i)), index.fields[f]) for i, f in zip(m.sample, m.field)]
        return index, dict(zip(names, datas))
    return run(with_store(url, go))
