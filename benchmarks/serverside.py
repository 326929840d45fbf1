"""Server-side throughput: the service on a warm cache, loaded by ``wrk`` (a C client, so the
client is not the limit), next to the bare pusher (``minimal_http.py``) run with the same
number of processes.

For each sample size and each ``--workers`` count of ``shardfeed serve`` (the axis; a count
above 1 needs a service that has ``--workers``), one point measures:

- ``batch``: ``POST /v1/batch`` of ``batch`` random samples (a fixed set of request bodies,
  cycled), on a cache warmed by one epoch first; ``arrow``: the same bodies with
  ``"format": "arrow"`` (an Arrow IPC stream);
- ``pusher``: the same request against the bare pusher, which answers a prebuilt tar of the
  same size;
- ``sample`` and ``healthz``: per-sample GETs of random samples, and ``GET /healthz`` on
  the same server, with 64 connections: the price of a request through the service.

Service CPU per sample is the user + system time of the service's processes (``/proc``)
over the batch load, divided by the samples served: load-independent enough on a busy
machine, unlike the rates. The pusher's CPU per sample is measured the same way, and their
quotient ("per CPU-second") is the ratio the two would reach with the cores to themselves,
where on a small machine ``wrk`` takes a core from both. Every figure carries the load average
it was measured under.

Every sample counted is checked. The warming epoch compares each sample's bytes with its
digest (``common.Digests``). wrk cannot look at what it receives without costing the load
its figures, so each load is checked by its count of bytes: every answer to one request
has the same length on the wire (measured beforehand, headers included), and wrk's bytes
must lie between ``requests x length`` and what the connections' unfinished answers at the
end can add. After the batch load, one of its batches is fetched and checked byte for byte.

Run on its own (``python -m shardfeed.benchmarks.serverside``) it seeds ``file://``
datasets; ``shardfeed bench`` runs it on its S3-backed services. Without ``wrk`` on the
PATH it is skipped with a note (Debian: ``apt-get install wrk``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from pathlib import Path
from urllib.parse import urlsplit

import numpy as np

from shardfeed.benchmarks import hotpath
from shardfeed.benchmarks.common import Digests
from shardfeed.client import Client
from shardfeed.process import ServiceProcess, free_port, start_service, stop_process
from shardfeed.seeds.synthetic import seed_dataset
from shardfeed.service.stores import open_store
from shardfeed.sizes import format_size, parse_size

DATASET = "bench"
CONNECTIONS = 64
"""wrk connections for the per-sample and /healthz loads (the issue's figure)."""
BODIES = 64
"""Distinct batch bodies wrk cycles through: random samples, without a body per request."""

SKIP_NOTE = "server-side scenario skipped: wrk is not installed (Debian: apt-get install wrk)"

# wrk reports through this script: one JSON line with the totals, and the request bodies.
_LUA = """
local bodies = {%(bodies)s}
local paths = {%(paths)s}
local n = 0
request = function()
  n = n + 1
  if #bodies > 0 then
    return wrk.format("POST", "/v1/batch", {["Content-Type"] = "application/json"}, bodies[n %% #bodies + 1])
  end
  return wrk.format("GET", paths[n %% #paths + 1])
end
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format('WRK {"requests": %%d, "duration_us": %%d, "bytes": %%d, "errors": %%d, "status": %%d, "p50_us": %%d, "p99_us": %%d}\\n',
    summary.requests, summary.duration, summary.bytes, e.connect + e.read + e.write + e.timeout, e.status,
    latency:percentile(50), latency:percentile(99)))
end
"""


def available() -> bool:
    return shutil.which("wrk") is not None


def _lua_strings(items: list[str]) -> str:
    return ", ".join(json.dumps(s) for s in items)  # JSON string escapes are valid Lua for ASCII


def wrk(url: str, script: str, *, connections: int, threads: int, seconds: float, scratch: Path) -> dict:
    """Run wrk against ``url`` with a Lua ``script``; the totals of its ``done`` line."""
    path = scratch / f"wrk-{time.monotonic_ns()}.lua"
    path.write_text(script)
    done = subprocess.run(["wrk", "-t", str(threads), "-c", str(connections), "-d", f"{seconds:g}s",
                           "--timeout", "30s", "-s", str(path), url],
                          capture_output=True, text=True, timeout=seconds + 60)
    line = next((l for l in done.stdout.splitlines() if l.startswith("WRK ")), None)
    if done.returncode != 0 or line is None:
        raise RuntimeError(f"wrk failed ({done.returncode}): {done.stderr.strip() or done.stdout.strip()}")
    totals = json.loads(line[4:])
    if totals["errors"] or totals["status"]:
        raise RuntimeError(f"wrk saw {totals['errors']} socket errors and {totals['status']} non-2xx answers "
                           f"from {url}")
    return totals


def answer_length(url: str, method: str, path: str, body: str = "") -> int:
    """The bytes of one answer on the wire (status line, headers and body), as wrk counts
    them: the request written as ``wrk.format`` writes it, on a connection of its own."""
    host, _, port = urlsplit(url).netloc.partition(":")
    payload = body.encode()
    head = f"{method} {path} HTTP/1.1\r\nHost: {host}:{port}\r\n"
    if payload:
        head += f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n"
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        sock.sendall(head.encode() + b"\r\n" + payload)
        data = b""
        while b"\r\n\r\n" not in data:
            data += sock.recv(1 << 16) or _closed(url)
        header, _, received = data.partition(b"\r\n\r\n")
        found = re.search(rb"^content-length: *(\d+)\r?$", header, re.I | re.M)
        if not header.startswith(b"HTTP/1.1 200") or found is None:
            raise RuntimeError(f"{method} {path} on {url}: {header.splitlines()[0]!r}, not a 200 of a known length")
        left = int(found[1]) - len(received)
        while left > 0:  # read it all: the server's work is done and its connection closed cleanly
            left -= len(sock.recv(min(left, 1 << 20)) or _closed(url))
    return len(header) + 4 + int(found[1])


def _closed(url: str) -> bytes:
    raise RuntimeError(f"{url} closed the connection before its answer ended")


def check_bytes(got: dict, length: int, connections: int, what: str) -> None:
    """wrk's bytes against its requests: each answer ``length`` bytes, and at most one
    unfinished answer per connection when the load stopped (counted in bytes, not requests)."""
    least, most = got["requests"] * length, (got["requests"] + connections) * length
    if not least <= got["bytes"] <= most:
        raise RuntimeError(f"{what}: wrk received {got['bytes']} bytes for {got['requests']} answers of {length} "
                           f"bytes (from {least} to {most} expected)")


def batch_body(dataset: str, indices: list[int], fmt: str = "tar") -> str:
    """A ``POST /v1/batch`` body (the tar's as it always was: no ``format``)."""
    return json.dumps({"dataset": dataset, "indices": indices, **({"format": fmt} if fmt != "tar" else {})})


def batch_script(dataset: str, bodies: list[list[int]], fmt: str = "tar") -> str:
    texts = [batch_body(dataset, b, fmt) for b in bodies]
    return _LUA % {"bodies": _lua_strings(texts), "paths": ""}


def get_script(paths: list[str]) -> str:
    return _LUA % {"bodies": "", "paths": _lua_strings(paths)}


def process_tree(pid: int) -> list[int]:
    """``pid`` and its living descendants (the workers of a multi-process service)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            children.setdefault(int(stat.rpartition(")")[2].split()[1]), []).append(int(entry))
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        todo += children.get(p, [])
    return tree


def tree_cpu(pid: int) -> float:
    """User + system CPU seconds of ``pid`` and its living descendants."""
    total = 0.0
    for p in process_tree(pid):
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rpartition(")")[2].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def _load() -> float:
    return round(os.getloadavg()[0], 2)


def start_pusher(processes: int, log: Path) -> tuple[str, subprocess.Popen]:
    """The bare pusher with ``processes`` uvicorn worker processes on one port."""
    port = free_port()
    with open(log, "ab") as err:
        process = subprocess.Popen([sys.executable, "-m", "shardfeed.benchmarks.minimal_http", "--port", str(port),
                                    "--processes", str(processes)], stdout=err, stderr=err)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            urllib.request.urlopen(url, timeout=1).close()
        except urllib.error.HTTPError:  # it answers 404 to anything but a batch: it is up
            return url, process
        except OSError:
            if process.poll() is not None or time.monotonic() > deadline:
                stop_process(process)
                raise RuntimeError(f"the bare pusher did not start (see {log})") from None
            time.sleep(0.1)


def measure_point(service: ServiceProcess, pusher: tuple[str, subprocess.Popen], size: int, batch: int, samples: int, workers: int,
                  seconds: float, scratch: Path, seed: int = 0, say: Callable[[str], None] = print,
                  profile: bool = False) -> dict:
    """One (size, workers) point: warm the cache, then the four loads. ``service`` serves
    ``samples`` synthetic samples of ``size`` bytes (field ``bin``) as ``bench``. With
    ``profile``, py-spy samples the service during the batch and per-sample loads."""
    rng = np.random.default_rng(seed)
    threads = max(1, min(4, os.cpu_count() or 1))
    # Enough batches in flight for every process: SO_REUSEPORT hashes each connection to one
    # worker, so a few connections may leave a worker idle.
    connections = max(4 * workers, threads)
    digests = Digests(samples, (size, size), seed=seed)
    with Client(service.url) as client:
        for lo in range(0, samples, batch):  # warm: every block cached, every sample checked
            order = list(range(lo, min(samples, lo + batch)))
            digests.check_batch(order, client.get_batch(DATASET, order))
    bodies = [rng.integers(0, samples, batch).tolist() for _ in range(BODIES)]
    point: dict = {"sample_size": size, "batch_size": batch, "serve_workers": workers, "seconds": seconds}
    for name, fmt in (("batch", "tar"), ("arrow", "arrow")):
        point[name] = batch_load(service, digests, size, bodies, fmt, connections=connections, threads=threads,
                                 seconds=seconds, scratch=scratch, say=say, profile=profile)

    synthetic = f"synthetic-{size}-{batch}"
    pusher_url, pusher_process = pusher
    pusher_body = json.dumps({"dataset": synthetic, "indices": bodies[0]})
    pusher_length = answer_length(pusher_url, "POST", "/v1/batch", pusher_body)
    load, before = _load(), tree_cpu(pusher_process.pid)
    got = wrk(pusher_url, batch_script(synthetic, [bodies[0]]), connections=connections, threads=threads,
              seconds=seconds, scratch=scratch)
    cpu = tree_cpu(pusher_process.pid) - before
    check_bytes(got, pusher_length, connections, f"pusher {format_size(size)}")
    pushed = got["requests"] * batch
    point["pusher"] = {"samples_per_s": round(pushed / (got["duration_us"] / 1e6), 1),
                       "mb_per_s": round(got["bytes"] / got["duration_us"], 1),
                       "cpu_us_per_sample": round(cpu / pushed * 1e6, 2) if pushed else None,
                       "processes": workers, "connections": connections, "load": load}

    paths = [f"/v1/datasets/{DATASET}/samples/{i}/bin" for i in rng.integers(0, samples, 4096).tolist()]
    for name, script, probe in (("sample", get_script(paths), paths[0]), ("healthz", get_script(["/healthz"]), "/healthz")):
        length = answer_length(service.url, "GET", probe)  # one sample's bytes, or the same JSON
        before, load = tree_cpu(service.process.pid), _load()
        with _profiled(profile and name == "sample", service, scratch / f"profile-{size}-{name}") as spy:
            got = wrk(service.url, script, connections=CONNECTIONS, threads=threads, seconds=seconds,
                      scratch=scratch)
        cpu = tree_cpu(service.process.pid) - before
        check_bytes(got, length, CONNECTIONS, f"{name} {format_size(size)}")
        spy.report(f"per-sample GET {format_size(size)}", got["requests"], say)
        point[name] = {"requests_per_s": round(got["requests"] / (got["duration_us"] / 1e6), 1),
                       "p50_ms": got["p50_us"] / 1e3, "p99_ms": got["p99_us"] / 1e3,
                       "service_cpu_us_per_request": round(cpu / got["requests"] * 1e6, 2),
                       "connections": CONNECTIONS, "load": load}
    point["batch_vs_pusher"] = round(point["batch"]["samples_per_s"] / point["pusher"]["samples_per_s"], 3)
    # Samples per CPU-second against the pusher's: what the ratio is where wrk does not share the cores.
    point["cpu_vs_pusher"] = (round(point["pusher"]["cpu_us_per_sample"] / point["batch"]["service_cpu_us_per_sample"], 3)
                              if point["pusher"]["cpu_us_per_sample"] and point["batch"]["service_cpu_us_per_sample"]
                              else None)
    point["sample_vs_healthz"] = round(point["sample"]["requests_per_s"] / point["healthz"]["requests_per_s"], 3)
    say(render_point(point))
    return point


def batch_load(service: ServiceProcess, digests: Digests, size: int, bodies: list[list[int]], fmt: str, *,
               connections: int, threads: int, seconds: float, scratch: Path, say: Callable[[str], None],
               profile: bool) -> dict:
    """wrk's load of ``POST /v1/batch`` in format ``fmt`` (``tar``, ``arrow``) over ``bodies``, cycled;
    its figures. Every answer has one length (every body asks for as many samples of one size);
    after the load one answer is checked byte for byte."""
    batch, what = len(bodies[0]), f"batch {format_size(size)} {fmt}"
    length = answer_length(service.url, "POST", "/v1/batch", batch_body(DATASET, bodies[0], fmt))
    before = tree_cpu(service.process.pid)
    load = _load()
    with _profiled(profile, service, scratch / f"profile-{size}-{fmt}") as spy:
        got = wrk(service.url, batch_script(DATASET, bodies, fmt), connections=connections, threads=threads,
                  seconds=seconds, scratch=scratch)
    cpu = tree_cpu(service.process.pid) - before
    check_bytes(got, length, connections, what)
    answer = urllib.request.urlopen(urllib.request.Request(  # and after the load, still the right bytes
        f"{service.url}/v1/batch", batch_body(DATASET, bodies[-1], fmt).encode(),
        {"Content-Type": "application/json"}), timeout=60).read()
    (digests.check_tar if fmt == "tar" else digests.check_arrow)(bodies[-1], answer)
    served = got["requests"] * batch
    spy.report(what, served, say)
    return {"samples_per_s": round(served / (got["duration_us"] / 1e6), 1),
            "mb_per_s": round(got["bytes"] / got["duration_us"], 1),
            "p50_ms": got["p50_us"] / 1e3, "p99_ms": got["p99_us"] / 1e3,
            "service_cpu_us_per_sample": round(cpu / served * 1e6, 2) if served else None,
            "connections": connections, "load": load}


class _Spy:
    """py-spy over the service's processes for one load (or nothing, when not profiling)."""

    def __init__(self, recording: hotpath.Recording | None):
        self.recording = recording

    def report(self, what: str, served: int, say: Callable[[str], None]) -> None:
        for name, path in (self.recording.paths.items() if self.recording else ()):
            say(hotpath.render(what, name, hotpath.summarize(path, self.recording.cpu[name], served)))


@contextmanager
def _profiled(enabled: bool, service: ServiceProcess, directory: Path) -> Iterator[_Spy]:
    if not enabled:
        yield _Spy(None)
        return
    pids = {f"service-{pid}": pid for pid in process_tree(service.process.pid)}
    with hotpath.profiled(pids, directory) as recording:
        time.sleep(0.5)  # py-spy attaching
        yield _Spy(recording)


def render_point(p: dict) -> str:
    b, s = p["batch"], p["sample"]
    return (f"server-side {format_size(p['sample_size']):>6} batch {p['batch_size']} serve --workers "
            f"{p['serve_workers']}: {b['samples_per_s']:>9,.0f} samples/s ({b['mb_per_s']:.0f} MB/s, "
            f"{b['service_cpu_us_per_sample']} us service CPU/sample, load {b['load']}) = "
            f"{p['batch_vs_pusher']:.2f}x the bare pusher ({p['pusher']['samples_per_s']:,.0f}; per CPU-second "
            f"{p['cpu_vs_pusher']}x, it spent {p['pusher']['cpu_us_per_sample']} us/sample); arrow "
            f"{p['arrow']['samples_per_s']:,.0f} samples/s ({p['arrow']['service_cpu_us_per_sample']} us service "
            f"CPU/sample); per-sample GETs "
            f"{s['requests_per_s']:,.0f}/s ({s['service_cpu_us_per_request']} us CPU each) = "
            f"{p['sample_vs_healthz']:.2f}x /healthz ({p['healthz']['requests_per_s']:,.0f}/s)")


def markdown(points: list[dict]) -> str:
    """The server-side section of ``results.md``."""
    lines = ["", "## Server side (wrk, warm cache)", "",
             "| size | batch | serve --workers | batch samples/s | MB/s | service CPU us/sample | arrow samples/s | "
             "arrow CPU us/sample | bare pusher samples/s | ratio | pusher CPU us/sample | ratio per CPU-second | "
             "per-sample GET/s | /healthz/s | ratio | load |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for p in points:
        b, a = p["batch"], p["arrow"]
        lines.append(f"| {format_size(p['sample_size'])} | {p['batch_size']} | {p['serve_workers']} | "
                     f"{b['samples_per_s']:,.0f} | {b['mb_per_s']:.0f} | {b['service_cpu_us_per_sample']} | "
                     f"{a['samples_per_s']:,.0f} | {a['service_cpu_us_per_sample']} | "
                     f"{p['pusher']['samples_per_s']:,.0f} | {p['batch_vs_pusher']:.2f} | "
                     f"{p['pusher']['cpu_us_per_sample']} | {p['cpu_vs_pusher']} | "
                     f"{p['sample']['requests_per_s']:,.0f} | {p['healthz']['requests_per_s']:,.0f} | "
                     f"{p['sample_vs_healthz']:.2f} | {b['load']} |")
    return "\n".join(lines) + "\n"


def serve_has_workers() -> bool:
    """Whether ``shardfeed serve`` takes ``--workers`` (the axis above 1 needs it)."""
    from shardfeed.service.server import add_arguments as serve_arguments

    parser = argparse.ArgumentParser(add_help=False)
    serve_arguments(parser)
    return not parser.parse_known_args(["--workers", "2"])[1]


def serve_args(workers: int) -> list[str]:
    """``serve`` arguments for one value of the ``--workers`` axis."""
    return [] if workers == 1 else ["--workers", str(workers)]


def run_points(sizes: list[int], workers_axis: list[int], samples: dict[int, int], batch: int,
               service_for: Callable[[int, int], AbstractContextManager[ServiceProcess]], scratch: Path,
               seconds: float, seed: int = 0, say: Callable[[str], None] = print,
               profile: bool = False) -> list[dict]:
    """Every (size, workers) point; ``service_for(size, workers)`` starts a service on a fresh cache."""
    points = []
    for workers in workers_axis:
        pusher = start_pusher(workers, scratch / "pusher.log")
        try:
            for size in sizes:
                n = samples[size]
                with service_for(size, workers) as service:
                    points.append(measure_point(service, pusher, size, min(batch, n), n, workers, seconds,
                                                scratch, seed, say, profile))
        finally:
            stop_process(pusher[1])
    return points


def _file_services(root: Path, seed: int, samples: dict[int, int], extra: list[str]):
    """``service_for`` over ``file://`` datasets seeded under ``root``."""
    urls: dict[int, str] = {}

    def service_for(size: int, workers: int) -> Iterator[ServiceProcess]:
        if size not in urls:
            path = root / f"data-{size}"
            path.mkdir(parents=True, exist_ok=True)

            async def seed_it() -> None:
                async with open_store(path.as_uri()) as store:
                    await seed_dataset(store, samples=samples[size], size=size, fields="bin", seed=seed,
                                       shard_size=64 << 20, progress=False)

            asyncio.run(seed_it())
            urls[size] = path.as_uri()
        cache = root / f"cache-{size}-{workers}-{time.monotonic_ns()}"
        return start_service({DATASET: urls[size]}, cache_dir=cache,
                             args=["--log-level", "warning", *serve_args(workers), *extra])

    return service_for


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m shardfeed.benchmarks.serverside", description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="10KiB,1MiB", help="sample sizes (default: %(default)s)")
    parser.add_argument("--batch", type=int, default=256, help="samples per batch (default: %(default)s)")
    parser.add_argument("--workers", default="1", help="the serve --workers axis, e.g. 1,2 (default: %(default)s)")
    parser.add_argument("--seconds", type=float, default=5, help="wrk duration per load (default: %(default)s)")
    parser.add_argument("--dataset-bytes", type=parse_size, default=parse_size("64MiB"),
                        help="bytes per seeded dataset (default: 64MiB)")
    parser.add_argument("--serve-arg", action="append", default=[],
                        help="a further argument for shardfeed serve, e.g. --serve-arg=--memory-cache=1GiB")
    parser.add_argument("--out", type=Path, help="write the points as JSON here")
    parser.add_argument("--profile", action="store_true",
                        help="sample the service with py-spy during the batch and per-sample loads")
    args = parser.parse_args(argv)
    if not available():
        print(SKIP_NOTE)
        return 0
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    axis = [int(w) for w in args.workers.split(",")]
    if max(axis) > 1 and not serve_has_workers():
        parser.error("--workers above 1 needs a `shardfeed serve` that has --workers")
    samples = {s: max(2 * args.batch, args.dataset_bytes // s) for s in sizes}
    with ExitStack() as stack:
        root = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="shardfeed-serverside-")))
        points = run_points(sizes, axis, samples, args.batch, _file_services(root, 0, samples, args.serve_arg),
                            root, args.seconds, profile=args.profile)
    if args.out:
        args.out.write_text(json.dumps(points, indent=1) + "\n")
    print(markdown(points))
    return 0


if __name__ == "__main__":
    sys.exit(main())
