"""One service versus three replicas, through the real client, over one S3 server
(SeaweedFS, or moto with ``--s3 moto``).

The same random epochs (one cold, on empty caches, then ``--warm-epochs`` warm ones) go
through ``shardfeed.client.Client`` (``--threads`` batches in flight) against:

- ``1 service``: one ``shardfeed serve --workers 1``;
- ``3 replicas, routed``: three ``serve --workers 1`` that are each other's ``--peers`` (as
  ``shardfeed stack`` runs them), the client splitting each batch by owner from the
  routing table (``Client(urls)``, the default);
- ``3 replicas, unrouted``: three fresh replicas, each batch sent whole to the next URL
  (``Client(urls, route=False)``), so about 2/3 of it hops to its owners.

For each: samples/s in all and per replica, store requests, cache hit ratio (disk and RAM
tier), replica-to-replica sub-batches (``shardfeed_peer_requests_total{kind="replica"}``:
0 when routed), and service CPU per served sample per replica (user + system time of the
replica's process from ``/proc`` over the epochs, divided by the samples it served, the
work its hops cause included).

The target (issue 10) is samples/s per replica at least 0.9x a single service's: each
replica with a host of its own. Here the three replicas, the client and the S3 server
share the machine's cores, so the concurrent figures cannot show it. What can: warm, in
``--rounds`` alternating rounds, the single service, then each replica alone with the
parts of the same batches that the routed client sends it (the others idle), each with
the machine to itself; per replica, the median ratio of its samples/s to the single
service's, and its efficiency: the single service's CPU per sample over the replica's
(1.0: a replica spends on each sample what the lone service does), also against the
single service sent batches of a routed part's size (``--batch`` / 3), which tells the
cost of smaller requests from the cost of being a replica; and the single service's CPU per
request fitted from those two batch sizes as a fixed cost plus a cost per sample, with the
most fixed cost at which a part would cost 0.9x per sample of a whole batch (the target
seen from the cost of a request). Last, the latency of a warm
per-sample GET to one replica for a sample it owns versus one a peer owns: one hop.

    python -m shardfeed.benchmarks.replicas --samples 8000 --size 10KiB
"""

from __future__ import annotations

import math
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import httpx
import numpy as np

from shardfeed.benchmarks.common import BENCH_DATA, Digests, benchmark_parser, load_note, seeded_s3, seeded_s3_arguments
from shardfeed.benchmarks.serverside import tree_cpu
from shardfeed.client import Client
from shardfeed.process import ServiceProcess, free_port, hops, scrape_metrics, start_all, start_service, stop_all
from shardfeed.seeds.synthetic import DEFAULT_FIELDS, parse_sizes

DATASET = "bench"
COUNTERS = ("shardfeed_samples_served_total", "shardfeed_store_requests_total", "shardfeed_cache_hits_total",
            "shardfeed_memory_cache_hits_total", "shardfeed_cache_misses_total")


@dataclass
class Figures:
    """One node's share of an epoch (or of all the warm epochs)."""

    served: float = 0.0
    cpu: float = 0.0
    store_requests: float = 0.0
    cache_hits: float = 0.0
    """Block reads served from the disk cache or its RAM tier."""
    cache_misses: float = 0.0
    replica_hops: float = 0.0

    @property
    def cpu_us_per_sample(self) -> float | None:
        return 1e6 * self.cpu / self.served if self.served else None


def _reading(service: ServiceProcess) -> tuple[dict[str, float], float, float]:
    return scrape_metrics(service.url), tree_cpu(service.process.pid), hops(service.url, "replica")


def _batches(orders: list[np.ndarray], batch: int) -> list[list[int]]:
    return [order[i:i + batch].tolist() for order in orders for i in range(0, len(order), batch)]


def _epochs(client: Client, services: list[ServiceProcess], batches: list[list[int]], threads: int,
            digests: Digests) -> tuple[float, list[Figures]]:
    """Seconds ``batches`` took through ``client``, every sample checked, and each service's figures."""
    before = [_reading(s) for s in services]
    began = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        for asked, got in zip(batches, pool.map(lambda b: client.get_batch(DATASET, b), batches)):
            digests.check_batch(asked, got)
    seconds = time.perf_counter() - began
    out = []
    for service, (metrics, cpu, replica_hops) in zip(services, before):
        now, cpu_now, hops_now = _reading(service)
        grew = {name: now.get(name, 0.0) - metrics.get(name, 0.0) for name in COUNTERS}
        out.append(Figures(grew["shardfeed_samples_served_total"], cpu_now - cpu,
                           grew["shardfeed_store_requests_total"],
                           grew["shardfeed_cache_hits_total"] + grew["shardfeed_memory_cache_hits_total"],
                           grew["shardfeed_cache_misses_total"], hops_now - replica_hops))
    return seconds, out


@dataclass
class Phase:
    """One topology's cold or warm epochs."""

    samples: int
    seconds: float
    nodes: list[Figures]

    @property
    def rate(self) -> float:
        return self.samples / self.seconds

    @property
    def cpu_us_per_sample(self) -> float:
        return 1e6 * sum(n.cpu for n in self.nodes) / self.samples

    def per_node_rates(self, single: Phase) -> list[float]:
        """Each node's samples/s over ``single``'s."""
        return [n.served / self.seconds / single.rate for n in self.nodes]

    def efficiencies(self, single: Phase) -> list[float]:
        """Each node's CPU per served sample against ``single``'s (1.0: as cheap; NaN where a
        run, this one or ``single``'s, was too short for /proc's 10 ms ticks to see any CPU)."""
        return [single.cpu_us_per_sample / n.cpu_us_per_sample if n.cpu_us_per_sample and single.cpu_us_per_sample
                else math.nan for n in self.nodes]


def _report(label: str, phase: Phase, single: Phase | None) -> None:
    """Print one phase's figures, with ratios to ``single`` (the lone service's same phase)."""
    print(f"{label}: {phase.rate:8,.0f} samples/s in all, service CPU {phase.cpu_us_per_sample:6.1f} us/sample "
          f"in all, replica-to-replica sub-batches {sum(n.replica_hops for n in phase.nodes):.0f}")
    for i, node in enumerate(phase.nodes):
        hits, misses = node.cache_hits, node.cache_misses
        line = (f"  node {i}: {node.served / phase.seconds:8,.0f} samples/s ({node.served:6.0f} served), "
                f"CPU {node.cpu_us_per_sample or 0:6.1f} us/sample, store requests {node.store_requests:5.0f}, "
                f"cache hit ratio {hits / max(1.0, hits + misses):.3f}, sub-batches to replicas {node.replica_hops:4.0f}")
        if single is not None:
            line += f"; vs 1 service: samples/s {node.served / phase.seconds / single.rate:.2f}x"
            if node.cpu_us_per_sample and single.cpu_us_per_sample:
                line += f", efficiency {single.cpu_us_per_sample / node.cpu_us_per_sample:.2f}x"
        print(line)


def _span(values: list[float]) -> str:
    return f"{min(values):.2f}-{max(values):.2f}x" if values else "unknown"


def _replicas(url: str, root: Path, env: dict[str, str]) -> list[ServiceProcess]:
    ports = [free_port() for _ in range(3)]
    peers = ",".join(f"r{i}=http://127.0.0.1:{p}" for i, p in enumerate(ports))
    started = start_all([partial(start_service, {DATASET: url}, cache_dir=root / f"r{i}", port=port, env=env,
                                 args=["--node-id", f"r{i}", "--peers", peers]) for i, port in enumerate(ports)])
    try:
        deadline = time.monotonic() + 30  # until each sees the others up: the routing tables agree
        while any(scrape_metrics(s.url)["shardfeed_peers_up"] < 3 for s in started):
            if time.monotonic() > deadline:
                raise RuntimeError("the replicas did not see each other up within 30 s")
            time.sleep(0.1)
    except BaseException:
        stop_all(started)
        raise
    return started


def _owned_parts(services: list[ServiceProcess], batches: list[list[int]]) -> list[list[list[int]]]:
    """Per service, the parts of ``batches`` it owns, as the routed client sends them."""
    table = httpx.get(f"{services[0].url}/v1/datasets/{DATASET}/routing", timeout=10).json()
    starts, owner, urls = np.asarray(table["starts"]), np.asarray(table["owner"]), table["urls"]
    out = []
    for service in services:
        node = urls.index(service.url)
        parts = [[i for i in b if owner[np.searchsorted(starts, i, "right") - 1] == node] for b in batches]
        out.append([part for part in parts if part])
    return out


@dataclass
class RequestCost:
    """The single service's CPU per warm request, fitted as ``fixed + per_sample * samples``
    from the medians at two batch sizes."""

    sizes: tuple[int, int]
    fixed_us: float
    per_sample_us: float

    @classmethod
    def fit(cls, sizes: tuple[int, int], us_per_request: tuple[float, float]) -> RequestCost:
        (small, large), (at_small, at_large) = sizes, us_per_request
        per_sample = (at_large - at_small) / (large - small)
        return cls(sizes, at_small - per_sample * small, per_sample)

    def fixed_for(self, ratio: float) -> float:
        """The most fixed cost at which requests of the smaller size get ``ratio`` times the
        samples per CPU-second of the larger, at this per-sample cost."""
        small, large = self.sizes
        return self.per_sample_us * (1 - ratio) / (ratio / small - 1 / large)


def _alternating(single: ServiceProcess, replicas: list[ServiceProcess], orders: list[np.ndarray], batch: int,
                 part: int, threads: int, rounds: int, digests: Digests) -> tuple[list[float], list[float], list[float], RequestCost]:
    """Warm, in alternating rounds: the single service (batches of ``batch``, then of ``part``),
    then each replica in turn, alone, with the parts of the same batches it owns while the
    others idle: a replica with the machine's cores to itself, as the single service has them.
    Per replica, the medians over the rounds of: its samples/s over the single service's, its
    efficiency, and its efficiency against the single service at batches of ``part``; and the
    single service's cost of a request, fitted from its two batch sizes."""
    batches = _batches(orders, batch)
    small_batches = _batches(orders, part)
    owned = _owned_parts(replicas, batches)
    ratios: list[list[tuple[float, float, float]]] = [[] for _ in replicas]
    per_request: list[tuple[float, float]] = []
    with Client(single.url) as client:
        for r in range(rounds):
            whole = Phase(sum(map(len, batches)), *_epochs(client, [single], batches, threads, digests))
            small = Phase(whole.samples, *_epochs(client, [single], small_batches, threads, digests))
            per_request.append((1e6 * small.nodes[0].cpu / len(small_batches), 1e6 * whole.nodes[0].cpu / len(batches)))
            _report(f"round {r}: 1 service, warm", whole, None)
            _report(f"round {r}: 1 service, warm, batch {part} (a routed part's size)", small, None)
            for i, (replica, parts) in enumerate(zip(replicas, owned)):
                with Client(replica.url, route=False) as own:
                    alone = Phase(sum(map(len, parts)), *_epochs(own, [replica], parts, threads, digests))
                _report(f"round {r}: 3 replicas, routed, warm, node {i} alone", alone, whole)
                ratios[i].append((alone.per_node_rates(whole)[0], *alone.efficiencies(whole),
                                  *alone.efficiencies(small)))
    medians = [tuple(statistics.median(column) for column in zip(*node)) for node in ratios]
    cost = RequestCost.fit((part, batch), tuple(statistics.median(column) for column in zip(*per_request)))
    return [m[0] for m in medians], [m[1] for m in medians], [m[2] for m in medians], cost


def _hop_latency(urls: list[str], repeat: int = 3) -> tuple[float, float]:
    """P50 ms of warm per-sample GETs to ``urls[0]``: samples it owns, samples a peer owns."""
    table = httpx.get(f"{urls[0]}/v1/datasets/{DATASET}/routing", timeout=10).json()
    starts, owner = table["starts"], [table["urls"][o] for o in table["owner"]]
    own = [s for s, o in zip(starts, owner) if o == urls[0]][:20]
    other = [s for s, o in zip(starts, owner) if o != urls[0]][:20]
    out = []
    with httpx.Client(base_url=urls[0]) as http:
        for samples in (own, other):
            times = []
            for _ in range(repeat):
                for i in samples:
                    began = time.perf_counter()
                    http.get(f"/v1/datasets/{DATASET}/samples/{i}").raise_for_status()
                    times.append(time.perf_counter() - began)
            out.append(1e3 * statistics.median(times))
    return out[0], out[1]


def main(argv=None) -> int:
    parser = benchmark_parser(__doc__, __spec__.name)
    seeded_s3_arguments(parser, samples=8000, shard_size="4MiB")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--threads", type=int, default=4, help="batches in flight (default: %(default)s)")
    parser.add_argument("--warm-epochs", type=int, default=3, help="warm epochs measured together (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="alternating rounds of the single service and each replica alone (default: %(default)s)")
    args = parser.parse_args(argv)
    for flag, value in (("--samples", args.samples), ("--batch", args.batch), ("--threads", args.threads),
                        ("--warm-epochs", args.warm_epochs), ("--rounds", args.rounds)):
        if value < 1:
            parser.error(f"{flag} must be at least 1, not {value}")

    cold_order = np.random.default_rng(0).permutation(args.samples)
    warm_orders = [np.random.default_rng(1 + e).permutation(args.samples) for e in range(args.warm_epochs)]
    print(f"{args.samples} samples of {args.size} in shards of {args.shard_size}, batch {args.batch}, {args.threads} in flight, "
          f"{args.warm_epochs} warm epochs; {load_note()}")
    digests = Digests(args.samples, parse_sizes(args.size), DEFAULT_FIELDS)
    with ExitStack() as stack, tempfile.TemporaryDirectory() as tmp:
        s3 = stack.enter_context(seeded_s3(args.s3, args.samples, args.size, args.shard_size))
        url = BENCH_DATA

        def run(label: str, services: list[ServiceProcess], route: bool, single: dict[str, Phase] | None,
                batch: int = args.batch, phases=(("cold", [cold_order]), ("warm", warm_orders))) -> dict[str, Phase]:
            out = {}
            with Client([s.url for s in services], route=route) as client:
                for name, orders in phases:
                    seconds, nodes = _epochs(client, services, _batches(orders, batch), args.threads, digests)
                    out[name] = Phase(len(orders) * args.samples, seconds, nodes)
                    _report(f"{label}, {name}", out[name], single and single[name])
            return out

        part = max(1, round(args.batch / 3))  # what a routed batch sends each replica
        service = stack.enter_context(start_service({DATASET: url}, cache_dir=Path(tmp) / "single", env=s3.env()))
        single = run("1 service", [service], True, None)
        replicas, alone = {}, []
        for route in (True, False):
            label = "routed" if route else "unrouted"
            nodes = _replicas(url, Path(tmp) / label, s3.env())
            try:
                replicas[label] = run(f"3 replicas, {label}", nodes, route, single)
                if route:
                    alone = _alternating(service, nodes, warm_orders, args.batch, part, args.threads, args.rounds,
                                             digests)
                    local, remote = _hop_latency([r.url for r in nodes])
                    print(f"warm per-sample GET to node 0, P50: a sample it owns {local:.2f} ms, one a peer "
                          f"owns {remote:.2f} ms (a hop: +{remote - local:.2f} ms)")
            finally:
                stop_all(nodes)

        print(f"\nsummary (per replica against 1 service; efficiency = the single service's CPU per sample over "
              f"the replica's; {load_note()}):")
        for label, phases in replicas.items():
            for name, phase in phases.items():
                print(f"  {label:8s} {name}: samples/s per replica {_span(phase.per_node_rates(single[name]))}, "
                      f"efficiency {_span(phase.efficiencies(single[name]))}, replica-to-replica sub-batches "
                      f"{sum(n.replica_hops for n in phase.nodes):.0f}")
                if label == "routed" and name == "warm":
                    print(f"  routed   warm, each replica alone (median of {args.rounds} rounds): samples/s "
                          f"{_span(alone[0])}, efficiency {_span(alone[1])} ({_span(alone[2])} against the "
                          f"single service at batch {part})")
                    cost = alone[3]
                    if part < args.batch:
                        print(f"  1 service, warm, CPU per request (fit over batches of {part} and {args.batch}): "
                              f"{cost.fixed_us:.0f} us + {cost.per_sample_us:.2f} us per sample; parts get 0.9x "
                              f"a whole batch's samples per CPU-second with a fixed cost under "
                              f"{cost.fixed_for(0.9):.0f} us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
