"""Soak mode: minutes to hours of mixed traffic against one service while its store and
its cache misbehave, with every byte checked.

    python -m shardfeed.benchmarks.soak --duration 600

Everything runs on 127.0.0.1: a moto S3 server, the fault-injecting proxy in front of
it (``s3proxy.py``) and ``shardfeed serve`` reading through the proxy, with a block cache
a third of the dataset's size so that blocks keep being evicted and refetched. The
dataset is synthetic (``shardfeed.seeds.synthetic``), so every member's bytes are a pure
function of its sample number and can be checked without a copy.

The run is cut into phases of equal length: no faults; each store fault of the proxy
(503 SlowDown, 500, reset mid-body, truncated body, stall past the read timeout, latency
spike) injected at a steady rate; blocks in the cache's slabs damaged at a steady rate;
and all of these at once. Client threads (``shardfeed.client.Client``, which retries
429, 503 and broken streams) ask for random batches and single fields all along.

At the end it prints one row per phase: requests, samples checked, failures a client
saw (after its retries), wrong bytes (must be 0), faults injected, hedged reads, and the
service's peak memory. The exit status is 1 if any byte was wrong or the service died.
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import re
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from pathlib import Path

from shardfeed.benchmarks.s3proxy import KINDS, FaultProxy, start_proxy
from shardfeed.client import Client, ShardfeedError
from shardfeed.faults import DAMAGE, cached_blocks, damage_block, peak_rss_mib
from shardfeed.process import ServiceProcess, start_service
from shardfeed.s3server import start_moto
from shardfeed.seeds.synthetic import member_bytes, sample_size

SHARD_READS = r"^GET /[^?]*\.tar"  # range reads of shards, not the index
SIZES = (1024, 16 * 1024)
FIELDS = ("bin", "cls")


def _metric(url: str, name: str) -> float:
    text = urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()
    return sum(float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))


class Soak:
    """One soak run: the stack, the client threads and the tallies per phase."""

    def __init__(self, proxy: FaultProxy, service: ServiceProcess, cache_dir: Path, samples: int, seed: int):
        self.proxy, self.service, self.cache_dir = proxy, service, cache_dir
        self.samples, self.seed = samples, seed
        self.phase = "none"
        self.tally: dict[str, Counter] = {}
        self.errors: list[str] = []
        self._lock = threading.Lock()
        self._done = threading.Event()

    def count(self, **deltas: int) -> None:
        with self._lock:
            self.tally.setdefault(self.phase, Counter()).update(deltas)

    def client_loop(self, worker: int) -> None:
        rng = random.Random(self.seed * 1000 + worker)
        with Client(self.service.url, timeout=30) as client:
            while not self._done.is_set():
                try:
                    if rng.random() < 0.7:
                        indices = [rng.randrange(self.samples) for _ in range(rng.randint(1, 64))]
                        got = client.get_batch("soak", indices)
                        wrong = sum(sample[f] != member_bytes(self.seed, i, f, SIZES)
                                    for sample, i in zip(got, indices) for f in FIELDS)
                        wrong += abs(len(got) - len(indices))
                        self.count(requests=1, samples=len(indices), wrong=wrong)
                    else:
                        i = rng.randrange(self.samples)
                        wrong = client.get_field("soak", i, "bin") != member_bytes(self.seed, i, "bin", SIZES)
                        self.count(requests=1, samples=1, wrong=int(wrong))
                except Exception as err:  # noqa: BLE001 - a client bug must count, not kill the thread
                    self.count(requests=1, failures=1)
                    with self._lock:
                        if len(self.errors) < 10:
                            kind = "" if isinstance(err, ShardfeedError) else f"{type(err).__name__}: "
                            self.errors.append(f"{self.phase}: {kind}{err}")

    def run_phase(self, name: str, seconds: float, rng: random.Random) -> None:
        """Inject faults of kind ``name`` (or damage the cache) every few ms for ``seconds``."""
        self.phase = name
        faults_before = sum(v for k, v in self.proxy.counts.items() if k.startswith("fault:"))
        hedges_before = _metric(self.service.url, "shardfeed_store_hedges_total")
        stop = time.monotonic() + seconds
        while time.monotonic() < stop:
            kind = rng.choice([*KINDS, "cache"]) if name == "all" else name
            if kind == "cache":
                blocks = list(cached_blocks(self.cache_dir).values())
                if blocks:
                    damage_block(rng.choice(blocks), rng.choice(DAMAGE), rng)
                    self.count(damaged=1)
            elif kind != "none":
                self.proxy.inject(kind, count=1, match=SHARD_READS, ms=3000 if kind == "stall" else 300)
            time.sleep(0.05)
        self.proxy.clear()
        faults = sum(v for k, v in self.proxy.counts.items() if k.startswith("fault:")) - faults_before
        self.count(faults=faults, hedges=int(_metric(self.service.url, "shardfeed_store_hedges_total")
                                             - hedges_before))

    def stop(self) -> None:
        self._done.set()


def run_soak(duration: float, samples: int, workers: int, seed: int, out=sys.stdout) -> dict[str, Counter]:
    """Run the soak for about ``duration`` seconds; print and return the tallies per phase."""
    phases = ["none", *KINDS, "cache", "all"]
    # The service cancels store reads it no longer needs (hedge losers, timeouts); the proxy's
    # aiohttp server logs each one as an error with a traceback.
    logging.getLogger("aiohttp.server").setLevel(logging.CRITICAL)
    with tempfile.TemporaryDirectory(prefix="shardfeed-soak-") as tmp:
        moto = start_moto()
        proxy = None
        try:
            moto.create_bucket("soak")
            subprocess.run([sys.executable, "-m", "shardfeed", "seed", "s3://soak/data", "-q", "--samples",
                            str(samples), "--size", f"{SIZES[0]}-{SIZES[1]}", "--shard-size", "4MiB",
                            "--fields", ",".join(FIELDS), "--seed", str(seed)],
                           env={**os.environ, **moto.env()}, check=True)
            total = sum(sample_size(seed, i, SIZES) for i in range(samples))
            proxy = start_proxy(moto.endpoint)
            cache_dir = Path(tmp) / "cache"
            with start_service({"soak": "s3://soak/data"}, cache_dir=cache_dir, cache_size=str(max(total // 3, 1)),
                               env={**moto.env(), "AWS_ENDPOINT_URL": proxy.url},
                               args=["--block-size", "256KiB", "--store-timeout", "1", "--log-level",
                                     "warning"]) as service:
                soak = Soak(proxy, service, cache_dir, samples, seed)
                threads = [threading.Thread(target=soak.client_loop, args=(w,), daemon=True) for w in range(workers)]
                for t in threads:
                    t.start()
                rng = random.Random(seed)
                try:
                    for name in phases:
                        print(f"soak: phase {name} ({duration / len(phases):.0f} s)", file=out, flush=True)
                        soak.run_phase(name, duration / len(phases), rng)
                finally:
                    soak.stop()
                    for t in threads:
                        t.join(60)
                rss = peak_rss_mib(service.process.pid)
                alive = service.process.poll() is None
        finally:
            if proxy is not None:
                proxy.stop()
            moto.stop()
    _report(soak.tally, phases, rss, alive, soak.errors, out)
    soak.tally["total"] = sum(soak.tally.values(), Counter())
    soak.tally["total"].update(peak_rss_mib=int(rss), died=int(not alive))
    return soak.tally


def _report(tally: dict[str, Counter], phases: list[str], rss: float, alive: bool, errors: list[str], out) -> None:
    columns = ("requests", "samples", "failures", "wrong", "faults", "damaged", "hedges")
    print("\n| phase | " + " | ".join(columns) + " |", file=out)
    print("|---" * (len(columns) + 1) + "|", file=out)
    total: Counter = Counter()
    for name in phases:
        row = tally.get(name, Counter())
        total.update(row)
        print(f"| {name} | " + " | ".join(str(row[c]) for c in columns) + " |", file=out)
    print("| **all** | " + " | ".join(str(total[c]) for c in columns) + " |", file=out)
    print(f"\nservice peak RSS {rss:.0f} MiB, {'still up' if alive else 'DIED'}", file=out)
    for line in errors:
        print(f"  client failure: {line}", file=out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m shardfeed.benchmarks.soak", description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=300, help="seconds in all (default: %(default)s)")
    parser.add_argument("--samples", type=int, default=4000, help="dataset size, 1-16 KiB each (default: %(default)s)")
    parser.add_argument("--workers", type=int, default=6, help="client threads (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="dataset and traffic seed (default: %(default)s)")
    args = parser.parse_args(argv)
    if args.duration <= 0 or args.samples < 1 or args.workers < 1 or args.seed < 0:
        parser.error("--duration, --samples and --workers must be positive, --seed not negative")
    total = run_soak(args.duration, args.samples, args.workers, args.seed)["total"]
    return 1 if total["wrong"] or total["died"] else 0


if __name__ == "__main__":
    sys.exit(main())
