"""What the status page costs the service: CPU per ``/v1/stats`` call, and samples/s with
50 pages open.

1. Seeds a local dataset (file://, so the store costs nothing), starts the service and
   warms its cache with one pass.
2. Runs a warm batch load (``--workers`` concurrent batches of ``--batch`` random samples)
   for ``--seconds`` per round, alternating rounds without and with ``--pages`` pollers
   (each polls as the page does: the whole history once, then ``?since=`` once a second,
   in a separate process); reports the median samples/s of each kind.
3. Measures the service's CPU time (user + system, from ``/proc``) with no load, idle and
   then with the pages open: what the pages cost, as a share of the one core the service
   runs on (a bound on the samples/s they can take, which the noisy throughput rounds of a
   shared machine cannot resolve to 5%).
4. Calls ``/v1/stats`` ``--calls`` times in a row, as a first load (the whole history) and
   as the page's steady poll (``?since=``), and divides the service's CPU time by the
   calls, less what the idle service used over as long.

    python -m shardfeed.benchmarks.status_page --seconds 15 --rounds 3
"""

from __future__ import annotations

import asyncio
import multiprocessing
import re
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import numpy as np

from shardfeed.benchmarks.common import Digests, benchmark_parser, dataset_arguments, load_note, seed_by_cli
from shardfeed.benchmarks.hotpath import cpu_seconds
from shardfeed.process import start_service
from shardfeed.seeds.synthetic import DEFAULT_FIELDS, parse_sizes


def _pages(url: str, pages: int, stop, calls) -> None:
    """``pages`` status pages, one connection each: the whole history once, then once a second
    only what is new (``?since=``). Raw HTTP/1.1 on asyncio streams, so the pollers (a client
    cost, which a browser on another machine would pay) take as little of this machine's CPU
    as they can."""
    parts = urlsplit(url)

    async def page() -> None:
        reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
        since = b""
        while not stop.is_set():
            began = time.monotonic()
            writer.write(b"GET /v1/stats" + (b"?since=" + since if since else b"") +
                         b" HTTP/1.1\r\nHost: bench\r\nAccept: application/json\r\n\r\n")
            head = await reader.readuntil(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 200"), head[:100]
            length = int(re.search(rb"(?i)content-length: *(\d+)", head)[1])
            body = await reader.readexactly(length)
            since = re.search(rb'"time":([0-9.]+)', body)[1]  # newer points than this reading
            with calls.get_lock():
                calls.value += 1
            await asyncio.sleep(max(0.0, 1.0 - (time.monotonic() - began)))
        writer.close()

    async def main() -> None:
        await asyncio.gather(*(page() for _ in range(pages)))

    asyncio.run(main())


def _load(url: str, digests: Digests, batch: int, workers: int, seconds: float, seed: int) -> float:
    """Samples/s of a warm batch load over ``seconds``, every sample checked."""
    rng = np.random.default_rng(seed)
    deadline = time.monotonic() + seconds

    def worker(i: int) -> int:
        served = 0
        local = np.random.default_rng(rng.integers(1 << 32) + i)
        with httpx.Client(timeout=60) as client:
            while time.monotonic() < deadline:
                indices = local.integers(0, digests.samples, batch).tolist()
                resp = client.post(f"{url}/v1/batch", json={"dataset": "bench", "indices": indices})
                resp.raise_for_status()
                served += digests.check_tar(indices, resp.content)
        return served

    began = time.monotonic()
    with ThreadPoolExecutor(workers) as pool:
        served = sum(pool.map(worker, range(workers)))
    return served / (time.monotonic() - began)


def _cpu_rate(pid: int, seconds: float) -> float:
    """CPU seconds per second the process uses over the next ``seconds``."""
    cpu, began = cpu_seconds(pid), time.monotonic()
    time.sleep(seconds)
    return (cpu_seconds(pid) - cpu) / (time.monotonic() - began)


def _start_pages(url: str, pages: int):
    """The pollers in their own process, once every page is past its first (full) load."""
    stop, calls = multiprocessing.Event(), multiprocessing.Value("l", 0)
    process = multiprocessing.Process(target=_pages, args=(url, pages, stop, calls))
    process.start()
    while calls.value < pages:
        time.sleep(0.1)
    calls.value = 0
    return process, stop, calls


def _cpu_per_call(url: str, pid: int, calls: int, steady: bool, idle_seconds: float) -> tuple[float, int]:
    """Service CPU seconds per /v1/stats call, less the idle service's CPU over as long; and
    the points of history the calls returned (the last call's)."""
    with httpx.Client(base_url=url, timeout=30) as client:
        doc = client.get("/v1/stats").json()
        params = {"since": doc["series"]["points"][-1][0]} if steady else {}
        idle_rate = _cpu_rate(pid, idle_seconds)
        cpu, began = cpu_seconds(pid), time.monotonic()
        for _ in range(calls):
            last = client.get("/v1/stats", params=params)
            last.raise_for_status()
        used = cpu_seconds(pid) - cpu - idle_rate * (time.monotonic() - began)
    return used / calls, len(last.json()["series"]["points"])


def main(argv=None) -> int:
    parser = benchmark_parser(__doc__, __spec__.name)
    dataset_arguments(parser, samples=20000, batch=256)
    parser.add_argument("--workers", type=int, default=4, help="concurrent batch requests")
    parser.add_argument("--pages", type=int, default=50, help="status pages polling once a second")
    parser.add_argument("--seconds", type=float, default=15, help="length of one load round")
    parser.add_argument("--rounds", type=int, default=3, help="rounds without and with pages, alternating")
    parser.add_argument("--calls", type=int, default=2000, help="/v1/stats calls for the CPU figure")
    parser.add_argument("--cpu-seconds", type=float, default=10,
                        help="how long the service's CPU is watched with the pages open (idle: half)")
    args = parser.parse_args(argv)

    before = load_note()
    with tempfile.TemporaryDirectory(prefix="shardfeed-status-") as tmp:
        data = Path(tmp) / "data"
        seed_by_cli(data.as_uri(), args.samples, args.size, shard_size="4MiB")
        digests = Digests(args.samples, parse_sizes(args.size), DEFAULT_FIELDS)
        with start_service({"bench": data.as_uri()}, cache_dir=Path(tmp) / "cache") as svc:
            _load(svc.url, digests, args.batch, args.workers, min(5.0, args.seconds), seed=0)  # warm the cache, the code
            rates: dict[bool, list[float]] = {False: [], True: []}
            polls = []
            for round_ in range(args.rounds):
                for with_pages in (False, True) if round_ % 2 == 0 else (True, False):
                    pollers = _start_pages(svc.url, args.pages) if with_pages else None
                    rate = _load(svc.url, digests, args.batch, args.workers, args.seconds, seed=round_ + 1)
                    rates[with_pages].append(rate)
                    if pollers is not None:
                        process, stop, calls = pollers
                        polls.append(calls.value / args.seconds)
                        stop.set()
                        process.join(10)
                    print(f"round {round_ + 1}: {'with' if with_pages else 'without'} {args.pages} pages: "
                          f"{rate:,.0f} samples/s", flush=True)
            idle = _cpu_rate(svc.process.pid, args.cpu_seconds / 2)
            process, stop, _ = _start_pages(svc.url, args.pages)
            paged = _cpu_rate(svc.process.pid, args.cpu_seconds)
            stop.set()
            process.join(10)
            full, points = _cpu_per_call(svc.url, svc.process.pid, args.calls, False, args.cpu_seconds / 5)
            steady, _ = _cpu_per_call(svc.url, svc.process.pid, args.calls, True, args.cpu_seconds / 5)
    without, with_ = statistics.median(rates[False]), statistics.median(rates[True])
    print(f"\nbefore: {before}; after: {load_note()}")
    print(f"warm batch load ({args.workers} x {args.batch} x {args.size}), median of {args.rounds} rounds of "
          f"{args.seconds:g} s: {without:,.0f} samples/s without pages, {with_:,.0f} with {args.pages} "
          f"({statistics.median(polls):.0f} /v1/stats calls/s): {100 * (with_ / without - 1):+.1f}%")
    print(f"service CPU, no load: {1e3 * idle:.1f} ms/s idle, {1e3 * paged:.1f} ms/s with {args.pages} pages "
          f"open: the pages cost {100 * (paged - idle):.1f}% of one core")
    print(f"/v1/stats service CPU per call: {1e3 * steady:.3f} ms as the page polls (?since=), "
          f"{1e3 * full:.3f} ms for a first load ({points} points of history); {args.calls} calls each")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
