"""Chaos under load, measured: a DataLoader job checks every byte it gets while the harness
kills workers and replicas, cuts S3 off, fills the cache's disk, damages cache blocks and
rewrites a shard in the store.

    python -m shardfeed.benchmarks.chaos --duration 600

The stack, all on 127.0.0.1: an S3 server (SeaweedFS, or moto with ``--s3 moto``) holding a
synthetic dataset (``shardfeed.seeds.synthetic``, dataset seed 0: every member's bytes are a
pure function of its sample number, so nothing is kept to check them against), the
fault-injecting proxy (``s3proxy.py``, a process of its own) in front of it, and two
replicas, ``serve --workers 2`` each, that are each other's ``--peers`` (as ``shardfeed
stack`` runs them), reading S3 through the proxy. Each replica's block cache holds a quarter
of the dataset (about half of the shards it owns), on a filesystem of its own sized to it
(a tmpfs, when root), with no RAM tier, so blocks keep being evicted and fetched again.

The load: two DataLoaders with 4 workers each run at the same time, in repeated epochs
until ``--duration`` is over, both given both replicas' URLs: the map-style
``ShardfeedDataset`` (``ShardfeedSampler``: a new order and plan each epoch, persistent
workers) and the iterable ``ShardfeedIterableDataset`` (through ``ShardfeedLoader``,
which resumes after a batch that failed; without a plan, as the service reads most blocks
of a planned order as uncached ranges and the cache faults would find few blocks). Every sample is checked byte for byte against
the sample the epoch's order puts at its place. The clients retry for about two minutes
(``Backoff(attempts=100, cap=2)``, ``down_for`` 2 s), longer than any fault lasts, so a
failed batch is a finding, not a tuning matter.

The faults, each kind on its own period (the first at a fixed fraction of it, so that the
kinds spread out), none begun later than 5 s before the end:

=================  =================================================================
``worker-kill``    SIGKILL a random worker of a random replica (its supervisor restarts it)
``replica-kill``   SIGKILL a replica's supervisor and workers, then start it again (same port
                   and cache directory); the replicas take turns
``s3-outage``      S3 unreachable for ``--s3-outage-for`` seconds: the proxy resets every
                   connection at once (``FaultProxy.outage``)
``enospc``         fill each replica's cache filesystem to ENOSPC with a filler file, hold it
                   ``--enospc-for`` seconds, delete it (skipped, with a note, when not root:
                   the filesystems are tmpfs mounts)
``cache-damage``   flip, cut short, lose the header of or overwrite ``--damage-blocks`` random
                   cached blocks in their slabs (``shardfeed.faults.damage_block``)
``overwrite``      write a new version of a random shard with the same samples in another
                   byte layout (a padding member without an extension, which the index skips,
                   at its start, and the fields of each sample in the other order), then a
                   new ``index.parquet`` that agrees with it, then ``POST
                   /v1/datasets/chaos/reload`` on every replica up: every sample's bytes are
                   the same, their offsets all move, so a stale or mixed read is a wrong sample
=================  =================================================================

Knobs: ``--duration`` (s, default 600), ``--samples`` (8000), ``--size`` (``1KiB-16KiB``,
a range sizes are drawn from), ``--shard-size`` (4MiB), ``--s3`` (the server), ``--seed``
(the epochs' orders and the faults' choices; 0), ``--batch`` (64), per kind
``--<kind>-every`` (s: worker-kill 20, replica-kill 60, s3-outage 150, enospc 120,
cache-damage 15, overwrite 120; 0 turns the kind off), ``--s3-outage-for`` (30),
``--enospc-for`` (10), ``--damage-blocks`` (4), ``--window`` (s, the sliding window of
rates: 2), ``--progress-every`` (s, 5), ``--json FILE`` (the figures, also as JSON), ``--logs DIR``
(keep the services' and the proxy's logs there).

Printed: a progress line every ``--progress-every`` seconds and a line per fault, to stderr;
at the end, to stdout, the samples verified and their rate, wrong samples (bytes, key or
place not the expected ones), lost samples (in an epoch's order, never delivered: a batch
that failed, or came back short), duplicate samples (delivered more often than the order
has them), failed batches (exceptions that reached the training loop), the longest stall
(the largest gap between two batches of one loader, and when), the harness's own errors
(e.g. a reload route that answers 404), and per fault kind how many were injected and the
time they took to recover: from the fault's end (a kill's or a damage's moment, an outage's
or a fill's end, the reload after an overwrite) to the start of the first window of
``--window`` seconds that delivered at least 90% of the rate of the 10 s before the fault
(min, median, max; "not by the end": faults after which no such window came before the run
ended), and per kind the longest stall (gap between two batches of one loader) that overlaps a
fault of the kind (up to 2 s past its end), beside the longest fault of the kind, and how long
past a fault's end a loader stalled during it stayed stalled (the target: at most 5 s). Faults
close together share their stalls; the JSON's ``gaps`` (start, end) tell which. The exit status
is 1 if any sample was wrong or lost, a loader hung or crashed, or a replica died for good.
"""

from __future__ import annotations

import argparse
import errno
import faulthandler
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections import Counter
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import httpx
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from torch.utils.data import DataLoader

from shardfeed.benchmarks.common import BENCH_DATA, seeded_s3, seeded_s3_arguments
from shardfeed.benchmarks.s3proxy import start_proxy_process
from shardfeed.client.sampling import epoch_order
from shardfeed.client.torch import ShardfeedDataset, ShardfeedIterableDataset, ShardfeedLoader, ShardfeedSampler
from shardfeed.faults import DAMAGE, cached_blocks, damage_block
from shardfeed.service.cache.catalog import CATALOG
from shardfeed.service.cache.slabs import SlotLocation
from shardfeed.process import (
    ServiceProcess,
    child_pids,
    free_port,
    healthy,
    start_all,
    start_service,
    stop_all,
    stop_process,
)
from shardfeed.retry import Backoff
from shardfeed.s3server import S3Server
from shardfeed.seeds.synthetic import member_bytes, parse_sizes, sample_key, sample_size
from shardfeed.service.datasets.index import Index, index_from_parquet, parquet_bytes
from shardfeed.service.datasets.indexfile import INDEX_FILE
from shardfeed.service.datasets.tarscan import ShardScan
from shardfeed.tar import END_OF_ARCHIVE, frame

DATASET = "chaos"
DATA_SEED = 0
"""The dataset's seed (``seeded_s3`` seeds with the default); ``--seed`` drives orders and faults."""
FIELDS = ("bin", "cls")
REPLICAS = 2
WORKERS = 2
"""Service workers per replica."""
LOADER_WORKERS = 4
"""DataLoader workers per loader."""
CLIENT_OPTIONS = {"timeout": 30.0, "connect_timeout": 2.0, "backoff": Backoff(attempts=100, base=0.1, cap=2.0),
                  "down_for": 2.0}
"""Retries for about two minutes (503s ask for 1 s, so each try waits 1-1.5 s): more than any fault lasts."""
BLOCK_SIZE = 256 << 10
SERVE_ARGS = ("--memory-cache", "0", "--block-size", str(BLOCK_SIZE), "--store-timeout", "5", "--log-level", "warning")
KINDS = ("worker-kill", "replica-kill", "s3-outage", "enospc", "cache-damage", "overwrite")
PERIODS = {"worker-kill": 20.0, "replica-kill": 60.0, "s3-outage": 150.0, "enospc": 120.0, "cache-damage": 15.0,
           "overwrite": 120.0}
FIRST = {"worker-kill": 0.5, "replica-kill": 0.75, "s3-outage": 0.35, "enospc": 0.55, "cache-damage": 0.3,
         "overwrite": 0.85}
"""When each kind first strikes, as a fraction of its period."""
LAST_START = 5.0
"""No fault begins later than this many seconds before the end (its recovery would not show)."""
PRE_FAULT = 10.0
"""Seconds before a fault whose rate it must recover to (90% of it)."""
RECOVERED = 0.9
HANG_GRACE = 180.0
"""Seconds the loaders have, after the end, to finish their batch before the run counts as hung."""
GAP = 1.0
"""Seconds between two batches of one loader past which the gap is kept, as a stall a fault may
have caused."""
AFTER = 2.0
"""Seconds after a fault's end within which a stall that begins still overlaps it."""
CACHE_SLACK = 4 << 20
"""Room on a cache filesystem beyond the cache's size (lock files, a block being written)."""


def _as_list(batch: list) -> list:
    """The DataLoader's ``collate_fn``: the batch as the dataset made it (a list of sample dicts)."""
    return batch


@dataclass
class Fault:
    kind: str
    began: float
    """Seconds since the start of the load."""
    ended: float
    """When the fault was over (the moment of a kill or a damage): recovery is timed from here."""
    note: str
    recovery: float | None = None
    """Seconds from ``ended`` to the start of the first window at 90% of the pre-fault rate."""
    stall: float = 0.0
    """The longest gap between two batches of one loader that overlaps the fault (``Chaos.stalls``)."""
    past: float = 0.0
    """How long past the fault's end a loader stalled during it stayed stalled."""


class Tally:
    """What the loaders saw, shared by their threads."""

    def __init__(self, sizes: tuple[int, int]):
        self.seed, self.sizes = DATA_SEED, sizes
        self.counts: Counter = Counter()
        self.arrivals: list[tuple[float, int]] = []
        """``(time, samples)`` of every batch delivered, both loaders."""
        self.stall = (0.0, "", 0.0)
        """The longest gap between two batches of one loader: ``(seconds, loader, when it ended)``."""
        self.gaps: list[tuple[float, float]] = []
        """``(start, end)`` of every gap of more than ``GAP`` s between two batches of one loader:
        the stalls each fault is charged with (``Chaos.stalls``)."""
        self.errors: list[str] = []
        self.began = time.monotonic()
        self._lock = threading.Lock()

    def now(self) -> float:
        return time.monotonic() - self.began

    def note(self, line: str) -> None:
        with self._lock:
            if len(self.errors) < 20:
                self.errors.append(line)

    def check(self, loader: str, expected: np.ndarray, got: list[dict], last: float) -> float:
        """Check a delivered batch against the indices the order puts there; returns its arrival time."""
        wrong = lost = duplicate = 0
        for want, sample in zip(expected.tolist(), got):
            if not self._exact(want, sample):
                wrong += 1
                if wrong == 1:
                    self.note(f"{loader}: wrong sample at {self.now():.1f} s: expected {want}, got "
                              f"__index__ {sample.get('__index__')} __key__ {sample.get('__key__')} "
                              f"({self._how(want, sample)})")
        if len(got) < len(expected):
            lost = len(expected) - len(got)
            self.note(f"{loader}: a batch of {len(expected)} came back with {len(got)} samples")
        extra = [s.get("__index__") for s in got[len(expected):]]
        duplicate = sum(1 for i in extra if i in set(expected.tolist()))
        wrong += len(extra) - duplicate
        t = self.now()
        with self._lock:
            self.counts.update({"verified": len(got), "wrong": wrong, "lost": lost, "duplicate": duplicate,
                                "batches": 1, f"{loader}_samples": len(got)})
            self.arrivals.append((t, len(got)))
            if t - last > self.stall[0]:
                self.stall = (t - last, loader, t)
            if t - last > GAP:
                self.gaps.append((last, t))
        return t

    def _exact(self, want: int, sample: dict) -> bool:
        if sample.get("__index__") != want or sample.get("__key__") != sample_key(want):
            return False
        if set(sample) != {"__index__", "__key__", *FIELDS}:
            return False
        return all(sample[f] == member_bytes(self.seed, want, f, self.sizes) for f in FIELDS)

    def _how(self, want: int, sample: dict) -> str:
        fields = sorted(set(sample) - {"__index__", "__key__"})
        if fields != sorted(FIELDS):
            return f"fields {fields}"
        return ", ".join(f"{f} {'ok' if sample[f] == member_bytes(self.seed, want, f, self.sizes) else 'differs'}"
                         for f in FIELDS)

    def add(self, **deltas: int) -> None:
        with self._lock:
            self.counts.update(deltas)

    def failed(self, loader: str, err: BaseException, lost: int) -> None:
        self.add(failed=1, lost=lost)
        self.note(f"{loader}: failed batch at {self.now():.1f} s: {type(err).__name__}: {str(err)[:300]}")


class Stack:
    """The S3 server, the proxy and the replicas, with the means to break them."""

    def __init__(self, s3: S3Server, proxy_url: str, root: Path, cache_size: int, tmpfs: bool):
        self.s3, self.proxy_url, self.root = s3, proxy_url, root
        self.cache_size, self.tmpfs = cache_size, tmpfs
        self.ports = [free_port() for _ in range(REPLICAS)]
        self.urls = [f"http://127.0.0.1:{p}" for p in self.ports]
        self.peers = ",".join(f"r{i}={url}" for i, url in enumerate(self.urls))
        self.replicas: list[ServiceProcess | None] = [None] * REPLICAS
        self.down: set[int] = set()
        """Replicas the harness is killing or restarting: no other fault touches them."""
        self.dead: list[str] = []
        """Replicas that could not be started again."""
        self.restarts = [0] * REPLICAS
        self.lock = threading.Lock()

    def cache_dir(self, i: int) -> Path:
        return self.root / f"r{i}" / "cache"

    def mount(self, stack: ExitStack) -> None:
        """Each replica's cache directory on a tmpfs of its own, the cache's size and a little more."""
        for i in range(REPLICAS):
            path = self.cache_dir(i)
            path.mkdir(parents=True)
            subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={self.cache_size + CACHE_SLACK}", "tmpfs",
                            str(path)], check=True, capture_output=True)
            stack.callback(subprocess.run, ["umount", "-l", str(path)], capture_output=True)

    def _start(self, i: int) -> ServiceProcess:
        return start_service({DATASET: BENCH_DATA}, cache_dir=self.cache_dir(i), cache_size=str(self.cache_size),
                             port=self.ports[i], workers=WORKERS, timeout=90,
                             env={**self.s3.env(), "AWS_ENDPOINT_URL": self.proxy_url},
                             args=["--node-id", f"r{i}", "--peers", self.peers, *SERVE_ARGS])

    def start(self) -> None:
        self.replicas = start_all([partial(self._start, i) for i in range(REPLICAS)])

    def stop(self) -> None:
        stop_all([r for r in self.replicas if r is not None])

    def up(self) -> list[int]:
        with self.lock:
            return [i for i in range(REPLICAS) if i not in self.down and self.replicas[i] is not None]

    def kill_worker(self, rng: random.Random) -> str:
        with self.lock:
            choices = [i for i in range(REPLICAS) if i not in self.down and self.replicas[i] is not None]
            if not choices:
                return "no replica up: nothing killed"
            i = rng.choice(choices)
            workers = child_pids(self.replicas[i].process.pid)
            if not workers:
                return f"r{i} has no worker up: nothing killed"
            pid = rng.choice(workers)
            os.kill(pid, signal.SIGKILL)
        return f"r{i} worker pid {pid}"

    def kill_replica(self, i: int) -> str:
        """SIGKILL replica ``i`` (supervisor and workers) and start it again; what happened."""
        with self.lock:
            if i in self.down or self.replicas[i] is None:
                return f"r{i} is down already"
            self.down.add(i)
            service = self.replicas[i]
        began = time.monotonic()
        pids = [service.process.pid, *child_pids(service.process.pid)]
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        service.process.wait()
        while any(map(_running, pids[1:])) and time.monotonic() - began < 10:
            time.sleep(0.05)
        return self._restart(i, began, service.log_path)

    def _restart(self, i: int, began: float, log: Path) -> str:
        """Start replica ``i`` again (its old ``log`` kept beside the new one); what happened."""
        self.restarts[i] += 1
        if log.exists():
            log.rename(log.with_name(f"{log.name}.{self.restarts[i]}"))
        last = ""
        for attempt in range(3):
            try:
                started = self._start(i)
            except RuntimeError as err:
                last = str(err).strip().splitlines()[0]
                time.sleep(2)
                continue
            with self.lock:
                self.replicas[i] = started
                self.down.discard(i)
            return (f"r{i} down {time.monotonic() - began:.1f} s" + (f" ({attempt + 1} starts)" if attempt else "")
                    + f", now {_described(started.url)}")
        with self.lock:
            self.replicas[i] = None
            self.dead.append(f"r{i}")
        return f"r{i} did not start again: {last}"

    def watch(self, note: Callable[[str], None]) -> None:
        """A replica that exited without the harness's doing: noted and started again."""
        for i in self.up():
            service = self.replicas[i]
            if service.process.poll() is not None:
                with self.lock:
                    if i in self.down:
                        continue
                    self.down.add(i)
                note(f"r{i} exited on its own with status {service.process.returncode} (log: "
                     f"{service.log_path}.{self.restarts[i] + 1})")
                self._restart(i, time.monotonic(), service.log_path)

    def cached_blocks(self) -> list[SlotLocation]:
        """Where the blocks of every live replica's workers are (each worker's catalogue on disk)."""
        return [where for i in self.up() for catalog in self.cache_dir(i).rglob(CATALOG)
                for where in cached_blocks(catalog.parent).values()]

    def fill(self, seconds: float) -> str:
        """Fill every cache filesystem to ENOSPC, hold it ``seconds``, free it again."""
        fillers, filled = [], 0
        try:
            for i in range(REPLICAS):
                path = self.cache_dir(i) / "chaos-filler"
                fillers.append(path)
                with open(path, "wb", buffering=0) as f:
                    filled += _write_until_full(f, 1 << 20) + _write_until_full(f, 4096)  # MiBs, then pages
            time.sleep(seconds)
        finally:
            for path in fillers:
                path.unlink(missing_ok=True)
        return f"{filled / 2**20:.1f} MiB of filler held {seconds:g} s"


def _described(url: str) -> str:
    """``url`` and its workers' own ports (``GET /v1/cluster``), to match with the services' logs."""
    try:
        workers = httpx.get(f"{url}/v1/cluster", timeout=10).json()["workers"]
    except (httpx.HTTPError, ValueError, KeyError) as err:
        return f"{url} (workers unknown: {err})"
    return f"{url} (workers {' '.join(':' + w['url'].rsplit(':', 1)[1] for w in workers)})"


def _running(pid: int) -> bool:
    """Whether process ``pid`` exists and is no zombie (a container's init may never reap one)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _write_until_full(f, size: int) -> int:
    """Write zeros to ``f``, ``size`` bytes at a time, until the filesystem refuses; bytes written."""
    written = 0
    chunk = bytes(size)
    try:
        while True:
            written += f.write(chunk)
    except OSError as err:
        if err.errno != errno.ENOSPC:
            raise
    return written


def overwrite_shard(s3: S3Server, rng: random.Random, sizes: tuple[int, int], version: int) -> str:
    """Write a new version of a random shard with the same samples in another byte layout, then a
    new ``index.parquet`` that agrees with it (straight to S3, not through the proxy); which shard."""
    client = s3.client()
    bucket, _, prefix = BENCH_DATA.removeprefix("s3://").partition("/")
    index = index_from_parquet(client.get_object(Bucket=bucket, Key=f"{prefix}/{INDEX_FILE}")["Body"].read())
    table = index.to_table()
    shard = rng.choice(index.shards)
    mine = table.filter(pc.equal(table["shard"], shard))
    samples = sorted(set(mine["sample"].to_pylist()))
    fields = FIELDS[::-1] if version % 2 else FIELDS
    parts = frame("padding", bytes(300 + 700 * version))  # no extension: not a member of any sample
    for i in samples:
        for f in fields:
            parts += frame(f"{sample_key(i)}.{f}", member_bytes(DATA_SEED, i, f, sizes))
    data = b"".join(parts) + END_OF_ARCHIVE
    scan = ShardScan(shard, len(data))
    if scan.feed(data, 0) != 0:
        raise RuntimeError(f"the new {shard} does not scan as a whole tar")
    rows = scan.table()
    rows = rows.set_column(0, "sample", pa.array(rows["sample"].to_numpy() + samples[0]))
    rest = table.filter(pc.not_equal(table["shard"], shard))
    new = Index.from_table(pa.concat_tables([rest.cast(rows.schema), rows]))
    if len(new) != len(index) or new.keys(np.array(samples)) != index.keys(np.array(samples)):
        raise RuntimeError(f"the new index of {shard} does not number its samples as the old one")
    client.put_object(Bucket=bucket, Key=f"{prefix}/{shard}", Body=data)
    client.put_object(Bucket=bucket, Key=f"{prefix}/{INDEX_FILE}", Body=parquet_bytes(new.to_table()))
    return f"{shard} v{version} ({len(samples)} samples)"


def reload_all(urls: list[str], note: Callable[[str], None], give_up: float = 60.0) -> str:
    """``POST /v1/datasets/chaos/reload`` on each URL; each replica's version, or what went wrong.
    A 404 (no such route yet) is noted at once; 5xx and refused connections are tried again."""
    out = []
    with httpx.Client(timeout=30) as http:
        for url in urls:
            deadline = time.monotonic() + give_up
            while True:
                try:
                    response = http.post(f"{url}/v1/datasets/{DATASET}/reload")
                    if response.status_code == 200:
                        out.append(f"{url.rsplit(':', 1)[1]}: {response.json()['dataset'].get('version')}")
                        break
                    problem = f"{response.status_code} {response.text[:200]}"
                    retry = response.status_code >= 500
                except (httpx.HTTPError, ValueError, KeyError, TypeError) as err:
                    problem, retry = f"{type(err).__name__}: {err}", isinstance(err, httpx.TransportError)
                if not retry or time.monotonic() > deadline:
                    note(f"reload on {url} failed: {problem}")
                    out.append(f"{url.rsplit(':', 1)[1]}: failed")
                    break
                time.sleep(1)
    return "reload " + ", ".join(out)


class Chaos:
    """One run: the stack, the loaders, the faults and what they did."""

    def __init__(self, args: argparse.Namespace, stack: Stack, tally: Tally, proxy_url: str):
        self.args, self.stack, self.tally, self.proxy_url = args, stack, tally, proxy_url
        self.sizes = parse_sizes(args.size)
        self.rng = random.Random(args.seed)
        self.faults: list[Fault] = []
        self.skipped: list[str] = []
        self.stop = threading.Event()
        self.versions = 0
        self._lock = threading.Lock()

    # -- the load ------------------------------------------------------------------------

    def map_loop(self) -> None:
        dataset = ShardfeedDataset(self.stack.urls, DATASET, fields=FIELDS, **CLIENT_OPTIONS)
        sampler = ShardfeedSampler(dataset, shuffle=True, seed=self.args.seed)
        loader = DataLoader(dataset, batch_size=self.args.batch, sampler=sampler, num_workers=LOADER_WORKERS,
                            collate_fn=_as_list, persistent_workers=True)
        batch, epoch, last = self.args.batch, 0, self.tally.now()
        while not self.stop.is_set():
            sampler.set_epoch(epoch)
            order = epoch_order(len(dataset), seed=self.args.seed, epoch=epoch, shuffle=True)
            batches = iter(loader)
            for k in range(0, len(order), batch):
                if self.stop.is_set():
                    break
                expected = order[k:k + batch]
                try:
                    got = next(batches)
                except StopIteration:
                    self.tally.note(f"map: epoch {epoch} ended {len(order) - k} samples early")
                    self.tally.add(lost=len(order) - k)
                    break
                except Exception as err:  # noqa: BLE001 - the training loop's view: count it, go on
                    self.tally.failed("map", err, len(expected))
                    continue
                last = self.tally.check("map", expected, got, last)
            else:
                self.tally.add(map_epochs=1)
            epoch += 1

    def iterable_loop(self) -> None:
        batch = self.args.batch
        # No plan: the service would read most of the blocks of a planned order as uncached ranges
        # (service/read/ranges.py); this loader's reads keep the block cache in use.
        dataset = ShardfeedIterableDataset(self.stack.urls, DATASET, batch_size=batch, seed=self.args.seed + 1,
                                           shuffle=True, fields=FIELDS, collate_fn=None, plan=False,
                                           **CLIENT_OPTIONS)
        loader = ShardfeedLoader(dataset, num_workers=LOADER_WORKERS)
        last = self.tally.now()
        while not self.stop.is_set():
            epoch = loader.epoch
            stream = dataset.sampler.stream()
            fruitless = 0
            while loader.epoch == epoch and fruitless < 3 and not self.stop.is_set():
                k = dataset.sampler.consumed // batch
                start = k
                try:
                    for got in loader:  # resumes after the last batch taken
                        last = self.tally.check("iterable", stream[k * batch:(k + 1) * batch], got, last)
                        k += 1
                        if self.stop.is_set():
                            break
                except Exception as err:  # noqa: BLE001 - the training loop's view: count it, resume
                    self.tally.failed("iterable", err, 0)
                    fruitless = fruitless + 1 if k == start else 0
            if fruitless == 3:  # the same batch failed three times over: give the epoch up
                self.tally.note(f"iterable: epoch {epoch} given up at batch {k}")
                self.tally.add(lost=len(stream) - k * batch)
                dataset.set_epoch(epoch + 1)
            elif loader.epoch != epoch:
                self.tally.add(iterable_epochs=1)

    def guarded(self, loop: Callable[[], None]) -> None:
        """Run a loader's loop; an error that ends it is noted (and fails the run)."""
        try:
            loop()
        except BaseException as err:  # noqa: BLE001 - reported in the summary
            self.tally.add(crashed=1)
            self.tally.note(f"{loop.__name__} crashed at {self.tally.now():.1f} s: {type(err).__name__}: {err}")

    # -- the faults ----------------------------------------------------------------------

    def inject(self, kind: str) -> None:
        began = self.tally.now()
        try:
            note = self._inject(kind)
        except Exception as err:  # noqa: BLE001 - a harness error is reported, the run goes on
            note = f"harness error: {type(err).__name__}: {err}"
            self.tally.note(f"{kind} at {began:.1f} s: {note}")
        if note is None:
            return
        fault = Fault(kind, began, self.tally.now() if kind in ("s3-outage", "enospc", "overwrite") else began,
                      note)
        with self._lock:
            self.faults.append(fault)
        until = f" to {fault.ended:.1f} s" if fault.ended - began >= 0.1 else ""
        print(f"chaos: [{began:6.1f} s{until}] {kind}: {note}", file=sys.stderr, flush=True)

    def _inject(self, kind: str) -> str | None:
        args = self.args
        if kind == "worker-kill":
            return self.stack.kill_worker(self.rng)
        if kind == "replica-kill":
            with self._lock:
                turn = sum(f.kind == "replica-kill" for f in self.faults) % REPLICAS
            return self.stack.kill_replica(turn)
        if kind == "s3-outage":
            httpx.post(f"{self.proxy_url}/_proxy/outage", json={"down": True}, timeout=10).raise_for_status()
            try:
                time.sleep(args.s3_outage_for)
            finally:
                httpx.post(f"{self.proxy_url}/_proxy/outage", json={"down": False}, timeout=10).raise_for_status()
            return f"S3 unreachable {args.s3_outage_for:g} s"
        if kind == "enospc":
            if not self.stack.tmpfs:
                return None
            return self.stack.fill(args.enospc_for)
        if kind == "cache-damage":
            blocks = self.stack.cached_blocks()
            picked = self.rng.sample(blocks, min(args.damage_blocks, len(blocks)))
            hows = [self.rng.choice(DAMAGE) for _ in picked]
            for where, how in zip(picked, hows):
                damage_block(where, how, self.rng)
            return f"{len(picked)} cached blocks of {len(blocks)}: {', '.join(sorted(hows))}"
        if kind == "overwrite":
            with self._lock:
                self.versions += 1
                version = self.versions
            what = overwrite_shard(self.stack.s3, self.rng, self.sizes, version)
            urls = [self.stack.urls[i] for i in self.stack.up()]
            return f"{what}; {reload_all(urls, self.tally.note)}"
        raise ValueError(f"unknown fault kind {kind!r}")

    def schedule(self, duration: float) -> None:
        """Start each fault in a thread of its own when due, until ``duration``; wait for them all."""
        periods = {kind: getattr(self.args, kind.replace("-", "_") + "_every") for kind in KINDS}
        length = {"s3-outage": self.args.s3_outage_for, "enospc": self.args.enospc_for}
        due = {kind: period * FIRST[kind] for kind, period in periods.items() if period > 0}
        running: list[threading.Thread] = []
        while due:
            kind = min(due, key=due.get)
            at = due[kind]
            if at + length.get(kind, 0) > duration - LAST_START:
                del due[kind]
                continue
            if self.stop.wait(max(0.0, at - self.tally.now())):
                break
            thread = threading.Thread(target=self.inject, args=(kind,), name=f"chaos-{kind}", daemon=True)
            thread.start()
            running.append(thread)
            due[kind] = at + periods[kind]
        for thread in running:
            thread.join()

    def progress(self) -> None:
        every = self.args.progress_every
        before = (0.0, 0)
        while not self.stop.wait(every):
            self.stack.watch(self.tally.note)
            t, counts = self.tally.now(), self.tally.counts
            rate = (counts["verified"] - before[1]) / max(t - before[0], 1e-9)
            before = (t, counts["verified"])
            with self._lock:
                done = Counter(f.kind for f in self.faults)
            print(f"chaos: {t:6.1f} s, {counts['verified']:,} samples verified, {rate:,.0f}/s; wrong "
                  f"{counts['wrong']}, lost {counts['lost']}, failed batches {counts['failed']}; faults "
                  + (", ".join(f"{k} {n}" for k, n in done.items()) or "none yet"), file=sys.stderr, flush=True)

    # -- the figures ---------------------------------------------------------------------

    def recoveries(self, end: float) -> None:
        """Each fault's time to recover to 90% of the rate of the ``PRE_FAULT`` s before it."""
        if not self.tally.arrivals:
            return
        times = np.array([t for t, _ in self.tally.arrivals])
        order = np.argsort(times, kind="stable")
        times = times[order]
        total = np.concatenate(([0], np.cumsum(np.array([n for _, n in self.tally.arrivals])[order])))

        def delivered(a: float, b: float) -> int:
            return int(total[np.searchsorted(times, b, "right")] - total[np.searchsorted(times, a, "right")])

        window = self.args.window
        for fault in self.faults:
            since = max(0.0, fault.began - PRE_FAULT)
            if fault.began - since < window:
                continue
            target = RECOVERED * delivered(since, fault.began) / (fault.began - since)
            for start in np.arange(fault.ended, end - window, 0.1):
                if delivered(start, start + window) >= target * window:
                    fault.recovery = float(start - fault.ended)
                    break

    def stalls(self) -> None:
        """Each fault's longest stall (the longest gap of a loader that overlaps it, to ``AFTER`` s
        past its end) and how long past the fault's end that loader stayed stalled. Faults close
        together share their gaps: the JSON's ``gaps`` tell which."""
        for fault in self.faults:
            overlapping = [(start, end) for start, end in self.tally.gaps
                           if start <= fault.ended + AFTER and end >= fault.began]
            fault.stall = max((end - start for start, end in overlapping), default=0.0)
            fault.past = max((end - fault.ended for _, end in overlapping), default=0.0)

    def summary(self, seconds: float, hung: bool) -> dict:
        counts = self.tally.counts
        per_kind = {}
        for kind in KINDS:
            mine = [f for f in self.faults if f.kind == kind]
            times = [f.recovery for f in mine if f.recovery is not None]
            per_kind[kind] = {"count": len(mine), "recovered": len(times), "never": len(mine) - len(times),
                              "min_s": min(times, default=None), "max_s": max(times, default=None),
                              "median_s": statistics.median(times) if times else None,
                              "longest_fault_s": max((f.ended - f.began for f in mine), default=None),
                              "longest_stall_s": max((f.stall for f in mine), default=None),
                              "stall_past_fault_s": max((f.past for f in mine), default=None)}
        stall = self.tally.stall
        return {
            "seconds": seconds, "samples": self.args.samples, "size": self.args.size, "s3": self.args.s3,
            "verified": counts["verified"], "rate": counts["verified"] / seconds if seconds else 0.0,
            "map_samples": counts["map_samples"], "iterable_samples": counts["iterable_samples"],
            "map_epochs": counts["map_epochs"], "iterable_epochs": counts["iterable_epochs"],
            "wrong": counts["wrong"], "lost": counts["lost"], "duplicate": counts["duplicate"],
            "failed_batches": counts["failed"], "longest_stall_s": stall[0], "longest_stall_loader": stall[1],
            "longest_stall_at_s": stall[2], "gaps": sorted(self.tally.gaps, key=lambda g: g[0] - g[1])[:20],
            "faults": per_kind, "skipped": self.skipped,
            "events": [vars(f) for f in self.faults], "harness_errors": self.tally.errors,
            "dead": self.stack.dead, "hung": hung, "crashed": counts["crashed"],
            "up": [i for i in range(REPLICAS) if self.stack.replicas[i] is not None
                   and healthy(self.stack.urls[i])],
        }


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def report(s: dict, out) -> None:
    print(f"\nchaos: {s['seconds']:.0f} s, {s['samples']} samples of {s['size']} on {s['s3']}, {REPLICAS} replicas "
          f"x {WORKERS} workers, map-style and iterable loaders x {LOADER_WORKERS} workers at once", file=out)
    print(f"verified {s['verified']:,} samples ({s['rate']:,.0f}/s): map-style {s['map_samples']:,} in "
          f"{s['map_epochs']} whole epochs, iterable {s['iterable_samples']:,} in {s['iterable_epochs']}", file=out)
    print(f"wrong samples {s['wrong']}, lost {s['lost']}, duplicate {s['duplicate']}, failed batches "
          f"{s['failed_batches']}; longest stall {s['longest_stall_s']:.1f} s ({s['longest_stall_loader'] or '-'}, "
          f"ending at {s['longest_stall_at_s']:.1f} s)", file=out)
    print("\n| fault | injected | recovered to 90% | min s | median s | max s | longest fault s | longest stall s "
          "| stall past fault s |", file=out)
    print("|---|---|---|---|---|---|---|---|---|", file=out)
    for kind, row in s["faults"].items():
        late = f" ({row['never']} not by the end)" if row["never"] else ""
        spread = " | ".join(_seconds(row[k]) for k in ("min_s", "median_s", "max_s", "longest_fault_s",
                                                       "longest_stall_s", "stall_past_fault_s"))
        print(f"| {kind} | {row['count']} | {row['recovered']}{late} | {spread} |", file=out)
    for line in s["skipped"]:
        print(f"skipped: {line}", file=out)
    for line in s["harness_errors"]:
        print(f"  error: {line}", file=out)
    if s["hung"]:
        print("the loaders HUNG: they did not finish their last batch (stacks above, on stderr)", file=out)
    print(f"replicas up at the end: {', '.join(f'r{i}' for i in s['up']) or 'none'}"
          + (f"; DIED for good: {', '.join(s['dead'])}" if s["dead"] else ""), file=out)


def run_chaos(args: argparse.Namespace, out=sys.stdout) -> dict:
    """Run the chaos for ``args.duration`` seconds; print and return the summary."""
    sizes = parse_sizes(args.size)
    total = sum(sample_size(DATA_SEED, i, sizes) for i in range(args.samples))
    cache_size = max(total // (2 * REPLICAS), 4 * BLOCK_SIZE * WORKERS)
    tmpfs = os.geteuid() == 0 and shutil.which("mount") is not None
    with tempfile.TemporaryDirectory(prefix="shardfeed-chaos-") as tmp, ExitStack() as stack:
        root = Path(tmp)
        s3 = stack.enter_context(seeded_s3(args.s3, args.samples, args.size, args.shard_size))
        proxy_url, proxy = start_proxy_process(s3.endpoint, 0, root / "s3proxy.log")
        stack.callback(stop_process, proxy)
        services = Stack(s3, proxy_url, root, cache_size, tmpfs)
        if tmpfs:
            try:
                services.mount(stack)
            except subprocess.CalledProcessError as err:
                tmpfs = services.tmpfs = False
                why = err.stderr.decode(errors="replace").strip()
        else:
            why = "not root"
        for i in range(REPLICAS):
            services.cache_dir(i).mkdir(parents=True, exist_ok=True)
        services.start()
        stack.callback(services.stop)
        tally = Tally(sizes)
        # 4 DataLoader workers per loader, as asked, whatever the cores: torch's warning says so twice.
        warnings.filterwarnings("ignore", message="This DataLoader will create")
        chaos = Chaos(args, services, tally, proxy_url)
        if not tmpfs and args.enospc_every > 0:
            chaos.skipped.append(f"enospc: the cache cannot be put on a filesystem of its own size ({why})")
            print(f"chaos: {chaos.skipped[-1]}", file=sys.stderr, flush=True)
        print(f"chaos: {args.samples} samples of {args.size} ({total / 2**20:.0f} MiB of payload), cache "
              f"{cache_size / 2**20:.1f} MiB per replica, replicas {', '.join(map(_described, services.urls))}, "
              f"S3 {args.s3} behind {proxy_url}", file=sys.stderr, flush=True)
        loaders = [threading.Thread(target=chaos.guarded, args=(loop,), name=f"chaos-{loop.__name__}", daemon=True)
                   for loop in (chaos.map_loop, chaos.iterable_loop)]
        tally.began = time.monotonic()
        for thread in loaders:
            thread.start()
        watcher = threading.Thread(target=chaos.progress, daemon=True)
        watcher.start()
        chaos.schedule(args.duration)
        chaos.stop.wait(max(0.0, args.duration - tally.now()))
        chaos.stop.set()
        end = tally.now()
        deadline = time.monotonic() + HANG_GRACE
        for thread in loaders:
            thread.join(max(0.0, deadline - time.monotonic()))
        hung = any(thread.is_alive() for thread in loaders)
        if hung:
            faulthandler.dump_traceback(file=sys.stderr)
        chaos.recoveries(end)
        chaos.stalls()
        summary = chaos.summary(end, hung)
        if args.logs:
            services.stop()  # their last words too
            args.logs.mkdir(parents=True, exist_ok=True)
            for log in root.glob("**/*.log*"):
                shutil.copy(log, args.logs / log.name)
    report(summary, out)
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m shardfeed.benchmarks.chaos", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    seeded_s3_arguments(parser, samples=8000, shard_size="4MiB")
    parser.set_defaults(size="1KiB-16KiB")
    parser.add_argument("--duration", type=float, default=600, help="seconds of load (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="orders and faults (default: %(default)s)")
    parser.add_argument("--batch", type=int, default=64, help="samples per batch (default: %(default)s)")
    for kind in KINDS:
        parser.add_argument(f"--{kind}-every", type=float, default=PERIODS[kind],
                            help=f"seconds between faults of kind {kind}; 0: none (default: %(default)s)")
    parser.add_argument("--s3-outage-for", type=float, default=30,
                        help="seconds S3 is unreachable (default: %(default)s)")
    parser.add_argument("--enospc-for", type=float, default=10, help="seconds the cache's disk stays full "
                                                                     "(default: %(default)s)")
    parser.add_argument("--damage-blocks", type=int, default=4, help="cached blocks damaged each time "
                                                                     "(default: %(default)s)")
    parser.add_argument("--window", type=float, default=2, help="seconds of the sliding window of rates "
                                                                "(default: %(default)s)")
    parser.add_argument("--progress-every", type=float, default=5, help="seconds between progress lines "
                                                                        "(default: %(default)s)")
    parser.add_argument("--json", help="also write the figures to this file, as JSON")
    parser.add_argument("--logs", type=Path, help="keep the services' and the proxy's logs in this directory")
    args = parser.parse_args(argv)
    if args.duration <= 0 or args.samples < 1 or args.batch < 1 or args.seed < 0 or args.window <= 0:
        parser.error("--duration, --samples, --batch and --window must be positive, --seed not negative")
    if any(getattr(args, k.replace("-", "_") + "_every") < 0 for k in KINDS) or args.damage_blocks < 0:
        parser.error("fault periods and --damage-blocks must not be negative")
    summary = run_chaos(args)
    failed = summary["wrong"] or summary["lost"] or summary["dead"] or summary["hung"] or summary["crashed"]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
