"""Where the time per sample goes: CPU accounting and py-spy for the processes of a scenario.

``profiled(pids, ...)`` reads each process's CPU time (``/proc``) around a block of load
and samples its stacks with py-spy meanwhile; ``summarize`` turns that into CPU time per
served sample and py-spy's shares of it: by module (self time: where the process actually
is) and by shardfeed function (inclusive time: which stage of our code it is under).

``client_parse_us`` times the client's side of a batch alone: parsing a response stream
into samples (``python -m shardfeed.benchmarks.hotpath`` prints it per sample size).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import shardfeed
import shardfeed.benchmarks
import shardfeed.client
import shardfeed.seeds
import shardfeed.service
from shardfeed.process import installed_script

RATE = 200
"""Stack samples per second per process (py-spy reads them without pausing the process)."""

# Frames under which everything runs: no information in their inclusive time.
_ENTRY_POINTS = ("benchmarks/", "shardfeed/cli.py", "shardfeed/__main__.py", "service/server.py")

# Our packages' directories (an editable install maps them to the repo's top-level folders).
_OURS = {os.path.dirname(m.__file__) + "/": m.__name__.removeprefix("shardfeed").lstrip(".") or "shardfeed"
         for m in (shardfeed, shardfeed.benchmarks, shardfeed.client, shardfeed.seeds, shardfeed.service)}


def available() -> bool:
    """Whether py-spy is installed (it is optional: ``pip install py-spy``)."""
    return installed_script("py-spy") is not None


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` and of the children it has waited for."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return sum(int(v) for v in fields[11:15]) / os.sysconf("SC_CLK_TCK")


@dataclass
class Recording:
    """What ``profiled`` leaves behind: py-spy's output file and the CPU seconds used, per process."""

    paths: dict[str, Path] = field(default_factory=dict)
    cpu: dict[str, float] = field(default_factory=dict)


@contextmanager
def profiled(pids: dict[str, int], directory: Path) -> Iterator[Recording]:
    """Record ``{name: pid}`` with py-spy (and their CPU time) until the block ends."""
    directory.mkdir(parents=True, exist_ok=True)
    recording, spies, before = Recording(), {}, {}
    for name, pid in pids.items():
        recording.paths[name] = directory / f"{name}.txt"
        with open(directory / f"{name}.log", "wb") as log:
            spies[name] = subprocess.Popen(
                [installed_script("py-spy"), "record", "--pid", str(pid), "--rate", str(RATE), "--format", "raw", "--nonblocking",
                 "--full-filenames", "--output", str(recording.paths[name])],
                stdout=subprocess.DEVNULL, stderr=log)
        before[name] = cpu_seconds(pid)
    try:
        yield recording
    finally:
        for name, pid in pids.items():
            recording.cpu[name] = cpu_seconds(pid) - before[name]
        for spy in spies.values():
            spy.send_signal(signal.SIGINT)  # py-spy writes its output on SIGINT
        for spy in spies.values():
            try:
                spy.wait(30)
            except subprocess.TimeoutExpired:
                spy.kill()
                spy.wait()


def _ours(filename: str) -> str | None:
    """``'service/api.py'`` for a file of shardfeed's own code, else None."""
    for directory, package in _OURS.items():
        if filename.startswith(directory):
            return f"{package}/{filename[len(directory):]}"
    return None


def _module(filename: str) -> str:
    """A short, stable name for the code a frame runs: ``service/api.py``, ``h11``, ``stdlib/json``."""
    ours = _ours(filename)
    if ours is not None:
        return ours
    marker = "site-packages/"
    if marker in filename:
        rest = filename.split(marker, 1)[1]
        return rest.split("/", 1)[0].removesuffix(".py")
    stdlib = f"/lib/python{sys.version_info.major}.{sys.version_info.minor}/"
    if stdlib in filename:
        rest = filename.split(stdlib, 1)[1]
        return "stdlib/" + rest.split("/", 1)[0].removesuffix(".py")
    return os.path.basename(filename) or filename


def _frame(text: str) -> tuple[str, str]:
    """``'fn (/path/file.py:12)'`` -> ``('fn', '/path/file.py')``."""
    name, _, where = text.rpartition(" (")
    return name, where.rstrip(")").rsplit(":", 1)[0]


def summarize(path: Path, cpu: float, served: int, top: int = 10) -> dict:
    """CPU microseconds per served sample, and py-spy's shares: top modules (self time) and
    top shardfeed functions (inclusive time)."""
    by_module: Counter[str] = Counter()
    by_function: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    total = 0
    text = path.read_text() if path.exists() else ""
    for line in text.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        frames = [_frame(f) for f in stack.split(";")]
        frames = [f for f in frames if not f[0].startswith(("process ", "thread "))]
        if not frames:
            continue
        total += n
        name, filename = frames[-1]
        by_module[_module(filename)] += n
        by_function[f"{name} ({_module(filename)})"] += n
        ours = {f"{fn} ({module})" for fn, fl in frames
                if (module := _ours(fl)) is not None and not module.startswith(_ENTRY_POINTS)}
        for key in ours:
            inclusive[key] += n

    def shares(counter: Counter[str]) -> list[dict]:
        return [{"name": key, "share": round(n / total, 4)} for key, n in counter.most_common(top)] if total else []

    return {
        "cpu_seconds": round(cpu, 2),
        "samples_served": served,
        "cpu_us_per_sample": round(cpu / served * 1e6, 1) if served else None,
        "stack_samples": total,
        "self_by_module": shares(by_module),
        "self_by_function": shares(by_function),
        "inclusive_shardfeed": shares(inclusive),
    }


def render(scenario: str, process: str, summary: dict) -> str:
    """A readable block of ``profile.txt``."""
    lines = [f"== {scenario}: {process}: {summary['cpu_seconds']} CPU-s, "
             f"{summary['cpu_us_per_sample']} us of CPU per served sample ({summary['stack_samples']} stacks)"]
    for title, key in (("self time by module", "self_by_module"), ("self time by function", "self_by_function"),
                       ("inclusive time in shardfeed code", "inclusive_shardfeed")):
        if summary[key]:
            lines.append(f"  {title}:")
            lines += [f"    {e['share'] * 100:5.1f}%  {e['name']}" for e in summary[key]]
    return "\n".join(lines)


def client_parse_us(size: int, batch: int = 256, chunk: int = 64 << 10, rounds: int = 20) -> float:
    """Microseconds per sample for ``BatchReader`` to parse a batch of ``batch`` members of
    ``size`` bytes arriving in ``chunk``-byte network reads (the best of ``rounds``); every
    sample parsed is checked, off the clock."""
    from shardfeed.client.samples import BatchReader
    from shardfeed.tar import END_OF_ARCHIVE, frame

    payload = os.urandom(size)
    body = b"".join(b"".join(frame(f"{i:09d}.bin", payload)) for i in range(batch)) + END_OF_ARCHIVE
    chunks = [body[i:i + chunk] for i in range(0, len(body), chunk)]
    best = float("inf")
    for _ in range(rounds):
        began = time.perf_counter()
        reader = BatchReader("bench", range(batch), ["bin"])
        samples = []
        for piece in chunks:
            samples += reader.feed(piece)
        samples += reader.finish()
        best = min(best, time.perf_counter() - began)
        if [(s["__key__"], bytes(s["bin"])) for s in samples] != [(f"{i:09d}", payload) for i in range(batch)]:
            raise AssertionError("the client parsed other samples than the batch held")
    return best / batch * 1e6


if __name__ == "__main__":
    for size in (1 << 10, 10 << 10, 100 << 10, 1 << 20):
        print(f"client parse, {size >> 10:>5} KiB samples: {client_parse_us(size, 256 if size < 1 << 20 else 32):8.2f} "
              "us per sample")
