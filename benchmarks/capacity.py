"""How many shardfeed nodes a training job needs, from costs measured on the machine at hand,
and a check of that model against the loopback runs this repository makes.

    python -m shardfeed.benchmarks.capacity --calibrate cal.json          # measure, then predict
    python -m shardfeed.benchmarks.capacity --calibration cal.json --gpus 1000 --gpu-rate 3000 \\
        --sample-size 100KiB --dataset-size 200TiB --epochs 3 --nvme 7TiB
    python -m shardfeed.benchmarks.capacity --calibration cal.json --check   # model vs measured
    shardfeed capacity ...                                                 # the same

The model (every figure per second, the job at its full rate ``R = gpus x gpu_rate`` samples/s):

- **Requests.** A DataLoader batch of ``--batch`` samples is one request; the routed client
  splits it by owner, so each of the ``M = nodes x cores`` cluster members (``serve --workers``
  defaults to one per core) gets a part of ``p = max(1, batch / M)`` samples.
- **Service CPU per sample** of ``m`` members (``--fields-per-sample``: ``jpg`` and ``cls`` are
  two) ``c = fixed / p + m x per_member + per_mib x (size - m x small) / MiB``, warm, plus
  ``cold_per_mib x size_MiB`` for the share of samples whose bytes come from the store, plus
  ``disk_per_mib x size_MiB`` for the share of cache hits that miss the RAM tier (a node's
  RAM tier holds ``min(1, ram / (dataset / nodes))`` of its share). ``fixed`` and
  ``per_member`` are fitted from warm passes at two batch sizes of one-member samples of
  ``small`` bytes; ``per_mib`` from two sample sizes; ``cold_per_mib`` and ``disk_per_mib``
  from cold passes and from passes with ``--memory-cache 0`` (``--calibrate``:
  ``servecost.py``'s passes, nothing typed in). Nodes for the CPU: ``R x c / (cores x 1e6
  us)`` in the busiest epoch.
- **Cache.** The cluster's cache is ``nodes x nvme`` (the RAM tier holds copies of disk
  blocks, so it adds speed, not room). Epoch 1 is cold: the store serves the whole dataset
  once (a shuffled epoch reads each block once: the client's ``windows`` shuffle keeps the
  shards in play within the cache when the cache is smaller than the dataset). A cache that
  holds the dataset serves every later epoch: ``h = 1``. A smaller one keeps, for the next
  epoch, what the order leaves it: the plans' next-use eviction keeps the blocks the next
  epoch reads first. In index order (``--shuffle no``) that is the whole cache, ``h = cache /
  dataset``; shuffled, the ``windows`` shuffle's shards in play take ``CACHE_SHARE`` of it
  (``client/shuffles``: 0.75, the rest for read-ahead), and what outlives the epoch is the
  rest, ``h = (1 - CACHE_SHARE) x cache / dataset`` (plain LRU would keep less). The store
  reads ``(1 - h)`` of the dataset per epoch.
- **Store.** Reads are ``ServiceConfig.fetch_window`` long when the dataset fits the cache,
  else ``ServiceConfig.block_size`` (``service/config.py``): requests/s = store bytes/s /
  read size. One connection moves ``read / (latency + read / per_connection_bandwidth)``
  bytes/s; a node has ``--connections``. Nodes for the store bandwidth: store bytes/s over
  that, in the cold epoch (the busiest). ``--store-requests`` is what the store allows for
  the whole dataset (S3 documents 5,500 GETs/s per prefix): no node count lifts it.
- **NIC.** Full duplex: a node sends its share of the samples and receives its share of the
  store reads; the larger one over ``--nic``. Routed clients cause no replica-to-replica hops.
- Nodes needed: the smallest count at which CPU, NIC and store bandwidth all fit in every
  epoch; the resource that needed the most nodes binds first (or the store's requests, when
  the busiest epoch asks more than ``--store-requests``). The cache is reported beside:
  the nodes that would hold the whole dataset, and the hit ratio per epoch at the nodes needed.

``--check`` runs two of the repository's loopback scenarios small and prints the model's
prediction beside the measurement, with the ratio (the target: within 25%):

- ``replicas.py``'s: one ``serve --workers 1`` against three routed replicas, warm, batches of
  ``--check-batch``, in alternating rounds: the median service CPU per sample (what a
  replica's samples/s per core follow);
- an epoch run as ``recipes.py`` makes it (``ShardfeedIterableDataset``, its plan and default
  shuffle, ``--memory-cache 0``), two epochs with a cache of twice the dataset and of a
  quarter of it, and with a quarter in index order: the share of the dataset read from the
  store per epoch.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np

from shardfeed.benchmarks import servecost
from shardfeed.benchmarks.common import BENCH_DATA, Digests, seeded_s3
from shardfeed.benchmarks.replicas import DATASET, Phase, RequestCost, _batches, _epochs, _replicas
from shardfeed.client import Client
from shardfeed.client.shuffles import CACHE_SHARE
from shardfeed.process import scrape_metrics, start_service, stop_all
from shardfeed.s3server import S3_SERVERS, default_server
from shardfeed.seeds.synthetic import DEFAULT_FIELDS, parse_sizes
from shardfeed.service.config import ServiceConfig
from shardfeed.sizes import format_size, parse_size

MiB = 1 << 20


# --- calibration -------------------------------------------------------------------------

@dataclass
class Calibration:
    """Service CPU costs measured on this machine (microseconds), and how they were measured."""

    fixed_us: float
    """Per request, warm (the intercept of the fit over two batch sizes)."""
    per_member_us: float
    """Per member of ``small_size`` bytes, warm, beyond the request's fixed cost."""
    per_mib_us: float
    """Per MiB of sample beyond ``small_size``, warm from the RAM tier."""
    cold_per_mib_us: float
    """Added per MiB read from the store (a cold pass over a warm one, large samples)."""
    disk_per_mib_us: float
    """Added per MiB read from the slabs instead of the RAM tier (``--memory-cache 0``)."""
    small_size: int
    large_size: int
    batches: tuple[int, int]
    passes: dict
    """Each pass measured: configuration -> per round, its passes' {mib, seconds, service_cpu}."""
    machine: dict

    def cpu_us(self, size: int, members: int, part: float, cold_share: float, disk_share: float) -> float:
        """Service CPU per sample of ``size`` bytes in ``members`` members, in requests of ``part``
        samples, with ``cold_share`` of the samples read from the store and ``disk_share`` from
        the slabs."""
        mib = size / MiB
        warm = (self.fixed_us / part + members * self.per_member_us
                + self.per_mib_us * (size - members * self.small_size) / MiB)
        return max(0.0, warm) + self.cold_per_mib_us * mib * cold_share + self.disk_per_mib_us * mib * disk_share

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def load(cls, path: Path) -> Calibration:
        try:
            data = json.loads(Path(path).read_text())
            return cls(**{f.name: data[f.name] for f in fields(cls)})
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise ValueError(f"--calibration {path}: not a calibration file ({err})") from None


def calibrate(kind: str, samples: int, sizes: tuple[int, int], batches: tuple[int, int], passes: int,
              rounds: int) -> Calibration:
    """Run ``servecost.py``'s passes (one cold, then warm) on ``samples`` of the small size at
    two batch sizes, and on as many bytes of the large size from the RAM tier and from disk
    (``--memory-cache 0``) at the larger batch, ``rounds`` times in turn; fit the costs of each
    round, and keep the median of each cost (a shared machine moves one round by a third)."""
    small, large = sizes
    counts = {small: samples, large: max(8, samples * small // large)}
    runs = {small: [("ram", batches[0]), ("ram", batches[1])], large: [("ram", batches[1]), ("disk", batches[1])]}
    measured: dict[tuple[int, str, int], list[list[servecost.Pass]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for size, configurations in runs.items():
            with seeded_s3(kind, counts[size], format_size(size), "4MiB", fields="bin") as server:
                for _ in range(rounds):
                    for configuration, batch in configurations:
                        args = argparse.Namespace(samples=counts[size], bytes=size, clients=4, batch=batch,
                                                  passes=passes, workers=1, serve_arg=[], profile=None)
                        measured.setdefault((size, configuration, batch), []).append(servecost.run(
                            f"{configuration}-{format_size(size)}-b{batch}", servecost.CONFIGURATIONS[configuration],
                            args, server, Path(tmp)))

    def fit(number: int) -> dict[str, float]:
        """The costs from round ``number``'s passes."""
        def warm_us_per_sample(size: int, configuration: str, batch: int) -> float:
            """Over the warm passes together (each alone is a few of /proc's 10 ms ticks)."""
            got = measured[size, configuration, batch][number][1:]
            return 1e6 * sum(p.service_cpu for p in got) / (counts[size] * len(got))

        request = RequestCost.fit(batches, tuple(warm_us_per_sample(small, "ram", b) * b for b in batches))
        small_us, large_us = warm_us_per_sample(small, "ram", batches[1]), warm_us_per_sample(large, "ram", batches[1])
        large_cold_us = 1e6 * measured[large, "ram", batches[1]][number][0].service_cpu / counts[large]
        return {"fixed_us": request.fixed_us, "per_member_us": request.per_sample_us,
                "per_mib_us": (large_us - small_us) / ((large - small) / MiB),
                "cold_per_mib_us": (large_cold_us - large_us) / (large / MiB),
                "disk_per_mib_us": (warm_us_per_sample(large, "disk", batches[1]) - large_us) / (large / MiB)}

    fits = [fit(number) for number in range(rounds)]
    return Calibration(
        **{name: statistics.median(f[name] for f in fits) for name in fits[0]},
        small_size=small, large_size=large, batches=batches,
        passes={f"{configuration} {format_size(size)} batch {batch}":
                [[{"mib": p.mib, "seconds": p.seconds, "service_cpu": p.service_cpu} for p in got] for got in each]
                for (size, configuration, batch), each in measured.items()},
        machine={"cores": os.cpu_count(), "load": os.getloadavg()[0],
                 "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "s3": kind})


# --- the model ---------------------------------------------------------------------------

@dataclass
class Job:
    gpus: int
    gpu_rate: float
    """Samples/s one GPU consumes."""
    sample_size: int
    members: int
    """Fields per sample: members of the shards' tar files."""
    dataset_size: int
    """Bytes of the shards."""
    epochs: int
    shuffle: bool
    batch: int
    """Samples per DataLoader batch: one request."""


@dataclass
class Hardware:
    cores: int
    """Per node; ``serve --workers`` defaults to one worker per core."""
    nic: float
    """Bytes/s each way."""
    nvme: int
    """Block cache per node."""
    ram: int
    """RAM tier per node."""
    latency: float
    """Seconds to the store's first byte."""
    connection_bandwidth: float
    """Bytes/s of one store connection."""
    connections: int
    """Store connections per node (``ServiceConfig.max_store_requests`` by default)."""
    store_requests: float
    """GETs/s the store allows for the dataset."""


@dataclass
class Epoch:
    hit_ratio: float
    """Share of the dataset's bytes served from the cluster's cache."""
    store_bytes_per_s: float
    store_requests_per_s: float
    cpu_us_per_sample: float


@dataclass
class Sizing:
    nodes: int
    needs: dict[str, float]
    """Resource -> nodes it needs (fractional) at ``nodes``."""
    binds: str
    epochs: list[Epoch]
    read_size: int
    cache_nodes: int
    """Nodes whose NVMe together hold the dataset."""


def later_epoch_hit_ratio(cache: float, dataset: float, shuffle: bool) -> float:
    """Share of the dataset an epoch after the first finds in a cache of ``cache`` bytes."""
    if cache >= dataset:
        return 1.0
    return (1 - CACHE_SHARE if shuffle else 1.0) * cache / dataset


def epochs_at(job: Job, hardware: Hardware, calibration: Calibration, nodes: int) -> tuple[list[Epoch], int]:
    """Each epoch's figures for the whole cluster of ``nodes``; and the store's read size."""
    cache = nodes * hardware.nvme
    config = ServiceConfig()
    read = config.fetch_window if cache >= job.dataset_size else config.block_size
    part = max(1.0, job.batch / (nodes * hardware.cores))
    in_ram = min(1.0, nodes * hardware.ram / job.dataset_size)
    rate = job.gpus * job.gpu_rate
    out = []
    for number in range(job.epochs):
        hit = 0.0 if number == 0 else later_epoch_hit_ratio(cache, job.dataset_size, job.shuffle)
        store = rate * job.sample_size * (1 - hit)
        out.append(Epoch(hit, store, store / read,
                         calibration.cpu_us(job.sample_size, job.members, part, 1 - hit, hit * (1 - in_ram))))
    return out, read


def size_cluster(job: Job, hardware: Hardware, calibration: Calibration) -> Sizing:
    """The fewest nodes at which CPU, NIC and store bandwidth fit in every epoch."""
    rate = job.gpus * job.gpu_rate
    nodes = 1
    while True:
        epochs, read = epochs_at(job, hardware, calibration, nodes)
        per_connection = read / (hardware.latency + read / hardware.connection_bandwidth)
        worst_store = max(e.store_bytes_per_s for e in epochs)
        needs = {
            "CPU": max(rate * e.cpu_us_per_sample for e in epochs) / (hardware.cores * 1e6),
            "NIC": max(rate * job.sample_size, worst_store) / hardware.nic,
            "store bandwidth": worst_store / (hardware.connections * per_connection),
        }
        if max(needs.values()) <= nodes:
            break
        nodes = max(nodes + 1, min(math.ceil(max(needs.values())), 2 * nodes))
    binds = max(needs, key=needs.get)
    worst_requests = max(e.store_requests_per_s for e in epochs)
    if worst_requests > hardware.store_requests:
        binds = f"store requests ({worst_requests:,.0f}/s asked, {hardware.store_requests:,.0f}/s allowed)"
    return Sizing(nodes, needs, binds, epochs, read, math.ceil(job.dataset_size / hardware.nvme))


def render(job: Job, hardware: Hardware, result: Sizing) -> str:
    rate = job.gpus * job.gpu_rate
    lines = [f"job: {job.gpus} GPUs x {job.gpu_rate:,.0f} samples/s = {rate:,.0f} samples/s of "
             f"{format_size(job.sample_size)} ({rate * job.sample_size / 1e9:,.2f} GB/s), dataset "
             f"{format_size(job.dataset_size)}, {job.epochs} epochs, shuffle {'yes' if job.shuffle else 'no'}, "
             f"batch {job.batch}",
             f"shardfeed nodes needed: {result.nodes}",
             "resource            nodes it needs"]
    lines += [f"  {name:18s}{need:10.2f}" for name, need in result.needs.items()]
    lines.append(f"  {'cache':18s}{result.cache_nodes:10d}   (to hold the whole dataset; "
                 f"{result.nodes} nodes hold {min(1.0, result.nodes * hardware.nvme / job.dataset_size):.0%})")
    lines.append(f"binds first: {result.binds}")
    members = result.nodes * hardware.cores
    lines.append(f"each batch of {job.batch} goes to {members} members (nodes x cores) in parts of "
                 f"{max(1.0, job.batch / members):.1f} samples")
    lines.append(f"store reads of {format_size(result.read_size)}; per epoch:")
    lines.append("epoch  cache hit ratio  S3 requests/s   S3 bytes/s   service CPU us/sample")
    lines += [f"{n + 1:5d}  {e.hit_ratio:15.2f}  {e.store_requests_per_s:13,.0f}  {e.store_bytes_per_s / 1e9:8.2f} GB/s"
              f"  {e.cpu_us_per_sample:20.1f}" for n, e in enumerate(result.epochs)]
    return "\n".join(lines)


# --- the check ---------------------------------------------------------------------------

@dataclass
class Row:
    scenario: str
    model: float
    measured: float

    @property
    def ratio(self) -> float:
        return self.measured / self.model if self.model else (1.0 if self.measured == 0 else math.inf)


def check_replicas(calibration: Calibration, kind: str, samples: int, batch: int, warm_epochs: int,
                   rounds: int) -> list[Row]:
    """``replicas.py``'s single service and three routed replicas, warm, in ``rounds`` alternating
    rounds of ``warm_epochs`` each: the median service CPU per sample of each."""
    size = "10KiB"
    orders = [np.random.default_rng(e).permutation(samples) for e in range(1 + warm_epochs)]
    cold, warm = _batches(orders[:1], batch), _batches(orders[1:], batch)
    measured: dict[str, list[float]] = {}
    digests = Digests(samples, parse_sizes(size), DEFAULT_FIELDS)
    with ExitStack() as stack, tempfile.TemporaryDirectory() as tmp:
        s3 = stack.enter_context(seeded_s3(kind, samples, size, "4MiB"))
        single = stack.enter_context(start_service({DATASET: BENCH_DATA}, cache_dir=Path(tmp) / "single",
                                                   env=s3.env()))
        topologies = {"1 service": [single], "3 replicas": _replicas(BENCH_DATA, Path(tmp) / "replicas", s3.env())}
        try:
            clients = {label: stack.enter_context(Client([s.url for s in services]))
                       for label, services in topologies.items()}
            for label, services in topologies.items():
                _epochs(clients[label], services, cold, 4, digests)
            for _ in range(rounds):
                for label, services in topologies.items():
                    phase = Phase(warm_epochs * samples, *_epochs(clients[label], services, warm, 4, digests))
                    measured.setdefault(label, []).append(phase.cpu_us_per_sample)
        finally:
            stop_all(topologies["3 replicas"])
    size_bytes, members = parse_size(size), len(DEFAULT_FIELDS)  # replicas.py's samples: bin and cls
    return [Row(f"1 service, warm, batch {batch}: service CPU us/sample",
                calibration.cpu_us(size_bytes, members, batch, 0, 0), statistics.median(measured["1 service"])),
            Row(f"3 replicas routed, warm, parts of {batch / 3:.0f}: service CPU us/sample",
                calibration.cpu_us(size_bytes, members, batch / 3, 0, 0), statistics.median(measured["3 replicas"]))]


def check_cache(kind: str, samples: int, size: str) -> list[Row]:
    """Two epochs of the plain iterable recipe with a cache of twice the dataset and of a
    quarter of it (its default shuffle), and with a quarter in index order (``shuffle=False``):
    the share of the dataset read from the store in each."""
    from shardfeed.client.torch import ShardfeedIterableDataset  # torch: for the check only

    rows = []
    digests = Digests(samples, parse_sizes(size), DEFAULT_FIELDS)
    with seeded_s3(kind, samples, size, "1MiB") as s3, tempfile.TemporaryDirectory() as tmp:
        listed = s3.client().list_objects_v2(Bucket="bench", Prefix="data/")["Contents"]
        dataset_bytes = sum(o["Size"] for o in listed if o["Key"].endswith(".tar"))
        for share, shuffle in ((2.0, True), (0.25, True), (0.25, False)):
            cache = max(MiB, int(share * dataset_bytes))
            with start_service({"data": BENCH_DATA}, cache_dir=Path(tmp) / f"{share}-{shuffle}",
                               cache_size=str(cache), env=s3.env(), args=["--memory-cache", "0"]) as service:
                ds = ShardfeedIterableDataset(service.url, "data", batch_size=64, collate_fn=None,
                                              shuffle=None if shuffle else False)  # None: its default
                for epoch in range(2):
                    ds.set_epoch(epoch)
                    before = scrape_metrics(service.url)["shardfeed_store_bytes_total"]
                    seen = sorted(digests.check_indexed(sample) for batch in ds for sample in batch)
                    assert seen == list(range(samples)), f"epoch {epoch + 1}: not every sample once"
                    read = (scrape_metrics(service.url)["shardfeed_store_bytes_total"] - before) / dataset_bytes
                    model = 1.0 if epoch == 0 else 1 - later_epoch_hit_ratio(cache, dataset_bytes, shuffle)
                    order = "" if shuffle else ", index order"
                    rows.append(Row(f"cache {share:g}x the dataset{order}, epoch {epoch + 1}: store bytes / dataset",
                                    model, read))
    return rows


def render_check(rows: list[Row]) -> str:
    lines = [f"{'scenario':75s} {'model':>9s} {'measured':>9s} {'ratio':>6s}  within 25%"]
    for row in rows:
        within = "yes" if 0.75 <= row.ratio <= 1.25 or (row.model == row.measured == 0) else "NO"
        lines.append(f"{row.scenario:75s} {row.model:9.3f} {row.measured:9.3f} {row.ratio:6.2f}  {within}")
    return "\n".join(lines)


# --- the command line ----------------------------------------------------------------------

def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    config = ServiceConfig()
    source = parser.add_argument_group("calibration (one of them)")
    source.add_argument("--calibration", metavar="FILE", help="the costs measured by an earlier --calibrate")
    source.add_argument("--calibrate", metavar="FILE", help="measure the costs on this machine, write them to FILE")
    source.add_argument("--calibration-samples", type=_positive_int, default=12000,
                        help="samples of --calibration-sizes' first size per pass (default: %(default)s)")
    source.add_argument("--calibration-sizes", default="10KiB,256KiB",
                        help="the small and the large sample size (default: %(default)s)")
    source.add_argument("--calibration-batches", default="16,128", help="two batch sizes (default: %(default)s)")
    source.add_argument("--calibration-passes", type=int, default=8,
                        help="passes per configuration, at least 2: the first cold (default: %(default)s)")
    source.add_argument("--calibration-rounds", type=_positive_int, default=3,
                        help="rounds of every configuration; each cost is the median of its rounds' "
                             "(default: %(default)s)")
    source.add_argument("--s3", choices=S3_SERVERS, default=default_server(),
                        help="the S3 server --calibrate and --check start on loopback (default: %(default)s)")
    job = parser.add_argument_group("the job")
    job.add_argument("--gpus", type=int, default=8)
    job.add_argument("--gpu-rate", type=float, default=2000, help="samples/s one GPU consumes (default: %(default)s)")
    job.add_argument("--sample-size", type=parse_size, default="100KiB")
    job.add_argument("--fields-per-sample", type=int, default=1, help="members per sample (default: %(default)s)")
    job.add_argument("--dataset-size", type=parse_size, default="1TiB", help="bytes of the shards")
    job.add_argument("--epochs", type=int, default=3)
    job.add_argument("--shuffle", choices=("yes", "no"), default="yes")
    job.add_argument("--batch", type=int, default=64, help="samples per DataLoader batch (default: %(default)s)")
    hardware = parser.add_argument_group("the hardware (per node, and the store)")
    hardware.add_argument("--cores", type=int, default=os.cpu_count(), help="(default: this machine's, %(default)s)")
    hardware.add_argument("--nic", type=float, default=25, help="Gb/s each way (default: %(default)s)")
    hardware.add_argument("--nvme", type=parse_size, default="3TiB", help="block cache (default: %(default)s)")
    hardware.add_argument("--ram", type=parse_size, default="64GiB", help="RAM tier (default: %(default)s)")
    hardware.add_argument("--latency-ms", type=float, default=20,
                          help="store's time to first byte (default: %(default)s)")
    hardware.add_argument("--connection-bandwidth", type=float, default=100,
                          help="MB/s of one store connection (default: %(default)s)")
    hardware.add_argument("--connections", type=int, default=config.max_store_requests,
                          help="store connections per node (default: serve's --max-store-requests, %(default)s)")
    hardware.add_argument("--store-requests", type=float, default=5500,
                          help="GETs/s the store allows for the dataset (default: S3's per prefix, %(default)s)")
    check = parser.add_argument_group("the check")
    check.add_argument("--check", action="store_true", help="run the loopback scenarios, print model vs measured")
    check.add_argument("--check-samples", type=_positive_int, default=6000,
                       help="samples of 10 KiB in the check's datasets (default: %(default)s)")
    check.add_argument("--check-batch", type=_positive_int, default=256, help="(default: %(default)s)")
    check.add_argument("--check-warm-epochs", type=_positive_int, default=10,
                       help="warm epochs per round (default: %(default)s)")
    check.add_argument("--check-rounds", type=_positive_int, default=3,
                       help="alternating rounds of the single service and the replicas; the medians count "
                            "(default: %(default)s)")


def _pair(flag: str, text: str, parse) -> tuple:
    try:
        values = tuple(parse(v.strip()) for v in text.split(","))
    except ValueError:
        values = ()
    if len(values) != 2 or not values[0] < values[1] or values[0] <= 0:
        raise ValueError(f"{flag} takes two increasing positive values, not {text!r}")
    return values


def validate(args: argparse.Namespace) -> None:
    """``ValueError`` naming the first input out of range, as it was given."""
    if bool(args.calibration) == bool(args.calibrate):
        raise ValueError("give one of --calibration FILE (costs measured before) and --calibrate FILE (measure now)")
    for name in ("gpus", "gpu_rate", "sample_size", "fields_per_sample", "dataset_size", "epochs", "batch", "cores",
                 "nic", "nvme",
                 "latency_ms", "connection_bandwidth", "connections", "store_requests"):
        value = getattr(args, name)
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"--{name.replace('_', '-')} must be positive, not {value:g}")
    if args.ram < 0:
        raise ValueError(f"--ram must not be negative, not {args.ram}")
    if args.sample_size > args.dataset_size:
        raise ValueError(f"--sample-size {format_size(args.sample_size)} is larger than --dataset-size "
                         f"{format_size(args.dataset_size)}")
    if args.calibration_passes < 2:
        raise ValueError(f"--calibration-passes must be at least 2 (a cold pass, then warm), "
                         f"not {args.calibration_passes}")


def run(args: argparse.Namespace) -> int:
    validate(args)  # before minutes of runs
    job = Job(args.gpus, args.gpu_rate, args.sample_size, args.fields_per_sample, args.dataset_size, args.epochs,
              args.shuffle == "yes", args.batch)
    hardware = Hardware(args.cores, args.nic * 1e9 / 8, args.nvme, args.ram, args.latency_ms / 1e3,
                        args.connection_bandwidth * 1e6, args.connections, args.store_requests)
    if args.calibrate:
        sizes = _pair("--calibration-sizes", args.calibration_sizes, parse_size)
        batches = _pair("--calibration-batches", args.calibration_batches, int)
        calibration = calibrate(args.s3, args.calibration_samples, sizes, batches, args.calibration_passes,
                                args.calibration_rounds)
        calibration.save(Path(args.calibrate))
        print(f"calibration written to {args.calibrate}")
    else:
        calibration = Calibration.load(Path(args.calibration))
    print(f"calibration ({calibration.machine.get('when')}, {calibration.machine.get('cores')} cores, load "
          f"{calibration.machine.get('load', 0):.1f}): a request {calibration.fixed_us:.0f} us + "
          f"{calibration.per_member_us:.2f} us per {format_size(calibration.small_size)} member + "
          f"{calibration.per_mib_us:.0f} us per further MiB warm; cold +{calibration.cold_per_mib_us:.0f} us/MiB, "
          f"from disk +{calibration.disk_per_mib_us:.0f} us/MiB")
    print(render(job, hardware, size_cluster(job, hardware, calibration)))
    if args.check:
        rows = check_replicas(calibration, args.s3, args.check_samples, args.check_batch, args.check_warm_epochs,
                              args.check_rounds)
        rows += check_cache(args.s3, args.check_samples, "10KiB")
        print("\nmodel vs measured (ratio = measured / model):")
        print(render_check(rows))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m shardfeed.benchmarks.capacity", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except ValueError as err:
        parser.error(str(err))


if __name__ == "__main__":
    sys.exit(main())
