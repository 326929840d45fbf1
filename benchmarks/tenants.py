"""Two tenants on one service (``--tokens FILE``): the batch latency of a light tenant alone,
then while a heavy tenant keeps ``--heavy-inflight`` batches in flight.

The service serves a ``file://`` dataset warm (one pass reads it first), with a token file of
two tenants: ``heavy``, whose own bound on batches in flight is ``--heavy-bound`` (default:
``--heavy-inflight``), and ``light``. The light tenant posts ``--batches`` random batches one
after another, alone and then beside ``--heavy-inflight`` threads of the heavy tenant posting
without pause; printed: its P50 and P99 both times and their ratio (issue 26's target: P99
within 2x of solo), the heavy tenant's batches/s and its 429s. Every batch either tenant
counts is checked, sample by sample, against the seeded bytes (``common.Digests``). The light
tenant's timing starts once every heavy thread has had an answer (on a loaded machine the heavy
process takes seconds to start; a fixed wait measured the light tenant beside nobody).

``--pin SERVICE:HEAVY:LIGHT`` puts each on its own CPUs (``taskset -a``, every thread; e.g.
``0:1:1``): what the light tenant's P99 gains from it is CPU the three were taking from each
other, not the service's order of answers. Also printed: how long the service's event loop and
the light tenant's client waited for a CPU while the light tenant was timed (``schedstat``).

    python -m shardfeed.benchmarks.tenants [--samples 4000] [--size 10KiB] [--heavy-inflight 64] [--pin 0:1:1]
"""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from shardfeed.benchmarks.common import Digests, WrongBytes, benchmark_parser, dataset_arguments, load_note, seed_by_cli
from shardfeed.client import Client
from shardfeed.client.errors import ShardfeedHTTPError
from shardfeed.process import child_pids, start_service
from shardfeed.retry import Backoff
from shardfeed.seeds.synthetic import DEFAULT_FIELDS, parse_sizes

HEAVY, LIGHT = "heavy-secret-token", "light-secret-token"


def token_file(path: Path, heavy_bound: int) -> Path:
    path.write_text(f'[heavy]\nsecret = "{HEAVY}"\nscopes = ["dataset:bench"]\nmax_inflight_batches = {heavy_bound}\n\n'
                    f'[light]\nsecret = "{LIGHT}"\nscopes = ["dataset:bench"]\nmax_inflight_batches = 8\n')
    return path


def latencies(url: str, digests: Digests, batch: int, batches: int, seed: int) -> np.ndarray:
    """Seconds per batch of the light tenant, ``batches`` random batches one after another."""
    rng = np.random.default_rng(seed)
    out = []
    with Client(url, token=LIGHT) as client:
        for _ in range(batches):
            indices = rng.integers(0, digests.samples, batch).tolist()
            began = time.perf_counter()
            got = client.get_batch("bench", indices)
            out.append(time.perf_counter() - began)
            digests.check_batch(indices, got)
    return np.array(out)


def flood(url: str, samples: int, size: str, batch: int, threads: int, stop, counts, began, ready) -> None:
    """``threads`` heavy-tenant threads posting random batches until ``stop`` (a process's
    ``Event``), then their answers counted into ``counts`` (a queue) from ``began`` on (an
    ``Event``: the light tenant's measurement starts); ``ready`` is set once every thread has
    had an answer. A process of its own: its threads parsing answers would otherwise hold the
    GIL the light tenant's timing needs."""
    lock = threading.Lock()
    tally: dict[str, int] = {}
    answered: set[int] = set()
    digests = Digests(samples, parse_sizes(size), DEFAULT_FIELDS)

    def work(seed: int) -> None:
        rng = np.random.default_rng(1000 + seed)
        with Client(url, token=HEAVY, backoff=Backoff(attempts=1)) as client:
            while not stop.is_set():
                indices = rng.integers(0, samples, batch).tolist()
                try:
                    digests.check_batch(indices, client.get_batch("bench", indices))
                    key = "served"
                except ShardfeedHTTPError as err:
                    key = str(err.status)
                except WrongBytes as err:
                    key = f"wrong bytes ({err})"
                with lock:
                    if began.is_set():
                        tally[key] = tally.get(key, 0) + 1
                    answered.add(seed)
                    if len(answered) == threads:
                        ready.set()

    workers = [threading.Thread(target=work, args=(n,), daemon=True) for n in range(threads)]
    for worker in workers:
        worker.start()
    stop.wait()
    for worker in workers:
        worker.join(60)
    counts.put(tally)


def pin(pid: int, cpus: str) -> None:
    """Every thread of process ``pid`` on ``cpus`` (a ``taskset`` list: ``0``, ``0,1``, ``0-1``)."""
    subprocess.run(["taskset", "-a", "-cp", cpus, str(pid)], check=True, stdout=subprocess.DEVNULL)


def runqueue_seconds(pid: int) -> float:
    """Seconds process ``pid``'s main thread (the service's event loop; the light tenant's
    client) has so far spent ready to run but waiting for a CPU (``/proc/.../schedstat``)."""
    return int(Path(f"/proc/{pid}/task/{pid}/schedstat").read_text().split()[1]) / 1e9


def main(argv=None) -> int:
    parser = benchmark_parser(__doc__, __spec__.name)
    dataset_arguments(parser, samples=4000, batch=64)
    parser.add_argument("--batches", type=int, default=200, help="the light tenant's batches, each time")
    parser.add_argument("--heavy-inflight", type=int, default=64, help="the heavy tenant's threads")
    parser.add_argument("--heavy-bound", type=int, help="its max_inflight_batches (default: --heavy-inflight)")
    parser.add_argument("--workers", type=int, default=1, help="shardfeed serve --workers")
    parser.add_argument("--pin", metavar="SERVICE:HEAVY:LIGHT",
                        help="CPUs (taskset lists) of the service, the heavy tenant's process and the light tenant's")
    args = parser.parse_args(argv)
    cpus = args.pin.split(":") if args.pin else None
    if cpus is not None and len(cpus) != 3:
        parser.error(f"--pin {args.pin!r}: three taskset CPU lists expected, SERVICE:HEAVY:LIGHT (e.g. 0:1:1)")
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        data = tmp / "data"
        seed_by_cli(data.as_uri(), args.samples, args.size)
        digests = Digests(args.samples, parse_sizes(args.size), DEFAULT_FIELDS)
        tokens = token_file(tmp / "tokens.toml", args.heavy_bound or args.heavy_inflight)
        with start_service({"bench": data.as_uri()}, cache_dir=tmp / "cache", workers=args.workers,
                           args=["--tokens", str(tokens)]) as service:
            if cpus is not None:  # its workers (--workers N) are its children: pinned alike
                for pid in [service.process.pid, *child_pids(service.process.pid)]:
                    pin(pid, cpus[0])
                pin(os.getpid(), cpus[2])
            with Client(service.url, token=LIGHT) as client:  # warm: every sample once
                for start in range(0, args.samples, 256):
                    client.get_batch("bench", list(range(start, min(start + 256, args.samples))))
            solo = latencies(service.url, digests, args.batch, args.batches, 0)
            spawn = multiprocessing.get_context("spawn")
            stop, began, ready, counts = spawn.Event(), spawn.Event(), spawn.Event(), spawn.Queue()
            heavy = spawn.Process(target=flood, args=(service.url, args.samples, args.size, args.batch, args.heavy_inflight,
                                                      stop, counts, began, ready))
            heavy.start()
            if cpus is not None:
                pin(heavy.pid, cpus[1])
            if not ready.wait(180):
                stop.set()
                raise SystemExit("the heavy tenant's threads had no answer within 180 s")
            if cpus is not None:  # its threads started after the first pin
                pin(heavy.pid, cpus[1])
            time.sleep(1.0)  # at full load
            began.set()
            started = time.perf_counter()
            pids = (service.process.pid, os.getpid())
            queued = [runqueue_seconds(pid) for pid in pids]
            loaded = latencies(service.url, digests, args.batch, args.batches, 1)
            queued = [runqueue_seconds(pid) - before for pid, before in zip(pids, queued)]
            seconds = time.perf_counter() - started
            stop.set()
            during = counts.get(timeout=120)
            heavy.join(60)
    wrong = [key for key in during if key.startswith("wrong bytes")]
    if wrong:
        raise SystemExit(f"the heavy tenant got other bytes than were seeded: {wrong[0]}")
    p = {name: (np.percentile(v, 50) * 1e3, np.percentile(v, 99) * 1e3) for name, v in (("solo", solo),
                                                                                          ("loaded", loaded))}
    print(f"{args.samples} x {args.size}, batches of {args.batch}, shardfeed serve --workers {args.workers}"
          f"{f', pinned {args.pin} (service:heavy:light)' if args.pin else ''}; {load_note()}")
    print(f"light tenant alone:            P50 {p['solo'][0]:7.1f} ms   P99 {p['solo'][1]:7.1f} ms")
    print(f"beside {args.heavy_inflight} heavy batches in flight: P50 {p['loaded'][0]:7.1f} ms   "
          f"P99 {p['loaded'][1]:7.1f} ms   ({p['loaded'][1] / p['solo'][1]:.2f}x the solo P99)")
    print(f"heavy tenant meanwhile: {during.get('served', 0) / seconds:.0f} batches/s served, "
          f"{during.get('429', 0) / seconds:.0f}/s refused (429), "
          f"other errors {sum(v for k, v in during.items() if k not in ('served', '429'))}")
    print(f"waiting for a CPU meanwhile, per light batch: the service's event loop {queued[0] / args.batches * 1e3:.1f} ms, "
          f"the light client {queued[1] / args.batches * 1e3:.1f} ms (of {loaded.mean() * 1e3:.1f} ms on average)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
