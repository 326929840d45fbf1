"""What the service spends per MiB it serves: CPU (user + system) of its whole process tree,
cold, warm from the RAM tier and warm from the disk tier.

One pass reads every sample of the dataset once, in a shuffled order, as ``--batch``-sample
``POST /v1/batch`` requests from ``--clients`` threads at once (each its own client, reading
the answers into tensor batches: the cheapest client there is, so the service has the CPU).
The first pass of a fresh service is cold (every block from the store), the next ones warm.
Each configuration runs on a fresh cache:

- ``ram``: the service's defaults (a block read once stays in the RAM tier);
- ``disk``: ``--memory-cache 0`` (every warm read comes from the slabs).

Service CPU is read from ``/proc`` (the supervisor and its workers) around each pass; the S3
server's CPU over the cold pass is printed beside it for scale. ``--profile DIR`` records the
service's stacks with py-spy (``hotpath.py``) over each pass and prints the top lines.

    python -m shardfeed.benchmarks.servecost --samples 300 --size 1MiB
"""

from __future__ import annotations

import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from shardfeed.benchmarks import hotpath
from shardfeed.benchmarks.common import BENCH_DATA, Digests, benchmark_parser, load_note, seeded_s3, seeded_s3_arguments
from shardfeed.benchmarks.serverside import process_tree, tree_cpu
from shardfeed.client import Client
from shardfeed.process import scrape_metrics, start_service
from shardfeed.sizes import parse_size

CONFIGURATIONS = {"ram": [], "disk": ["--memory-cache", "0"]}
"""Name -> further ``serve`` arguments."""


@dataclass
class Pass:
    mib: float  # payload served
    seconds: float
    service_cpu: float
    store_cpu: float
    store_mib: float  # read from the store

    def row(self, name: str) -> str:
        return (f"{name:14s} {self.service_cpu / self.mib * 1e3:7.2f} ms/MiB   {self.mib / self.seconds:7.1f} MiB/s   "
                f"store read {self.store_mib:7.1f} MiB, S3 server {self.store_cpu / self.mib * 1e3:5.2f} ms/MiB")


def one_pass(url: str, digests: Digests, samples: int, clients: int, batch: int, seed: int) -> float:
    """Every sample once, shuffled, in ``batch``-sample requests from ``clients`` threads, each
    checked byte for byte; the MiB served."""
    order = np.random.default_rng(seed).permutation(samples)
    batches = [order[i:i + batch].tolist() for i in range(0, samples, batch)]
    served = [0] * clients
    errors: list[BaseException] = []

    def work(number: int) -> None:
        try:
            with Client(url) as client:
                for indices in batches[number::clients]:
                    got = client.get_batch_tensors("bench", indices, ["bin"])
                    digests.check_batch(indices, list(got))
                    served[number] += int(got["bin"].lengths.sum())
        except BaseException as err:  # noqa: BLE001 - reported by the caller
            errors.append(err)

    threads = [threading.Thread(target=work, args=(n,)) for n in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return sum(served) / (1 << 20)


def run(name: str, extra: list[str], args, server, tmp: Path) -> list[Pass]:
    out = []
    s3_pids = [server.process.pid]
    digests = Digests(args.samples, (args.bytes, args.bytes))
    with start_service({"bench": BENCH_DATA}, cache_dir=tmp / name, env=server.env(), workers=args.workers,
                       args=[*extra, *args.serve_arg]) as service:
        pid = service.process.pid
        for number in range(args.passes):
            store_before = scrape_metrics(service.url)["shardfeed_store_bytes_total"]
            s3_before = sum(tree_cpu(p) for p in s3_pids)
            before = tree_cpu(pid)
            began = time.perf_counter()
            if args.profile:
                label = f"{name}-{'cold' if number == 0 else f'warm{number}'}"
                pids = {f"{label}-{p}": p for p in process_tree(pid)}
                with hotpath.profiled(pids, Path(args.profile)) as recording:
                    mib = one_pass(service.url, digests, args.samples, args.clients, args.batch, number)
            else:
                mib = one_pass(service.url, digests, args.samples, args.clients, args.batch, number)
            seconds = time.perf_counter() - began
            result = Pass(mib, seconds, tree_cpu(pid) - before, sum(tree_cpu(p) for p in s3_pids) - s3_before,
                          (scrape_metrics(service.url)["shardfeed_store_bytes_total"] - store_before) / (1 << 20))
            out.append(result)
            print(result.row(f"{name} {'cold' if number == 0 else f'warm {number}'}"), flush=True)
            if args.profile:
                for process, path in recording.paths.items():
                    summary = hotpath.summarize(path, recording.cpu[process], args.samples)
                    print(hotpath.render(label, process, summary), flush=True)
    return out


def main(argv=None) -> int:
    parser = benchmark_parser(__doc__, __spec__.name)
    seeded_s3_arguments(parser, samples=300, shard_size="64MiB")
    parser.set_defaults(size="1MiB")
    parser.add_argument("--clients", type=int, default=4, help="threads posting batches at once")
    parser.add_argument("--batch", type=int, default=16, help="samples per request")
    parser.add_argument("--passes", type=int, default=3, help="passes over the dataset (the first is cold)")
    parser.add_argument("--workers", type=int, default=1, help="shardfeed serve --workers")
    parser.add_argument("--configurations", default=",".join(CONFIGURATIONS),
                        help=f"some of {', '.join(CONFIGURATIONS)} (default: all)")
    parser.add_argument("--serve-arg", action="append", default=[],
                        help="a further argument for every shardfeed serve, e.g. --serve-arg=--block-size=4MiB")
    parser.add_argument("--profile", metavar="DIR", help="record the service with py-spy into DIR, print top lines")
    args = parser.parse_args(argv)
    args.bytes = parse_size(args.size)
    names = [n.strip() for n in args.configurations.split(",") if n.strip()]
    if not names or set(names) - set(CONFIGURATIONS):
        parser.error(f"--configurations takes some of {', '.join(CONFIGURATIONS)}, not {args.configurations!r}")
    if args.profile and not hotpath.available():
        parser.error("--profile needs py-spy (pip install py-spy)")
    with tempfile.TemporaryDirectory() as tmp, seeded_s3(args.s3, args.samples, args.size, args.shard_size,
                                                         fields="bin") as server:
        print(f"{args.samples} x {args.size} samples on {server.kind}, {args.clients} clients posting {args.batch}-"
              f"sample batches, shardfeed serve --workers {args.workers} {' '.join(args.serve_arg)}; "
              f"{load_note()}", flush=True)
        results = {name: run(name, CONFIGURATIONS[name], args, server, Path(tmp)) for name in names}
    print("\nservice CPU per MiB served (user + system, every process of the service):")
    for name, passes in results.items():
        warm = sorted(p.service_cpu / p.mib * 1e3 for p in passes[1:])
        warm_text = f"warm {warm[len(warm) // 2]:.2f} ms (median of {len(warm)})" if warm else ""
        print(f"  {name:5s} cold {passes[0].service_cpu / passes[0].mib * 1e3:.2f} ms   {warm_text}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
