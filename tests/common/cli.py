"""The ``shardfeed`` command line in a subprocess, as a user runs it, and a dataset read back
through its index."""

from __future__ import annotations

import asyncio
import json
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
    return one_line_error(shardfeed(*args, env=env))


def one_line_error(result: subprocess.CompletedProcess) -> str:
    """The one-line error of a command that failed as it should: no output, one line on stderr."""
    assert result.returncode != 0
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("shardfeed: error: "), result.stderr
    return lines[0]


REFUSALS = """
import contextlib, io, json, sys
from shardfeed.cli import main
done = []
for argv in json.load(sys.stdin):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            status = main(argv)
        except SystemExit as exit:  # argparse's refusals
            status = exit.code
    done.append((argv, status, out.getvalue(), err.getvalue()))
print(json.dumps(done))
"""


def refusals(argvs: list[list[str]]) -> list[subprocess.CompletedProcess]:
    """Each of ``argvs`` (commands that must fail at once) as run from the command line, all in
    one fresh process: a dozen refusals cost one start and one import of shardfeed, not a dozen.
    A command that runs on after all (a ``serve`` that serves) holds the process until its
    timeout: the tests fail."""
    done = subprocess.run([sys.executable, "-c", REFUSALS], input=json.dumps([["--quiet", *a] for a in argvs]),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return [subprocess.CompletedProcess(*run) for run in json.loads(done.stdout)]


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
