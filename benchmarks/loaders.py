"""DataLoader epochs on one node: shardfeed against MosaicML Streaming and s3torchconnector, over the same S3.

The loaders a user would otherwise pick, tried as a new user would: the same samples
(``bin`` bytes and a ``cls`` label) on one S3 server on loopback (SeaweedFS, or moto with
``--s3 moto``), as shardfeed shards for ``shardfeed serve``, as Streaming's MDS shards and as
one object per sample for s3torchconnector. Each loader runs
``DataLoader(batch_size=64, num_workers=4)``, shuffled, for two epochs: the first on
cold caches (a fresh service cache; a fresh Streaming local directory), the second warm.
The loaders (``--loaders`` picks some of them; all by default):

    ram                 the samples held in the training process as ``bytes`` (a map-style
                        dataset): the DataLoader's own ceiling for that output, against which
                        the other loaders' medians are also given
    shardfeed-map       ShardfeedDataset, sample dicts of ``bytes``
    shardfeed-iterable  ShardfeedIterableDataset through ShardfeedLoader, the same dicts
    shardfeed-tensors   ShardfeedDataset(output="tensors"): a batch is one ``Batch``, its bytes in
                        one shared-memory uint8 tensor
    streaming           MosaicML Streaming's StreamingDataset over the MDS shards
    s3torchconnector    s3torchconnector's S3MapDataset: one GET per sample, of an object holding
                        the sample's ``bin`` bytes (``s3://bench/objects/<index>.<label>``, its
                        label in its key), with ``force_path_style`` to the loopback endpoint. It
                        keeps no cache: its warm epoch is a second cold one.

Each loader's training process uses every batch alike (``consume``): each sample's ``bin``
is checked against an xxh3 of the bytes seeded (a wrong byte ends the run), then every byte
of the batch is read once more, as a copy to the GPU would read it: copied into one reusable
uint8 tensor, sample by sample for the dicts, the batch's one buffer for a ``Batch``.

Rounds alternate the loaders; the medians are printed with the ratios of each loader to
Streaming and to s3torchconnector (side by side), and the median and range of the ratios
within each round. Each loader's round runs in a fresh Python process, as a training job
would start: Streaming, run round after round in one process, got slower from round to round
(a cold epoch from 15.5k down to 4.8k samples/s). Its cold epoch still stalls for about 60 s
in some rounds; the medians and per-round ratios show how often. A peer's round that raises
(Streaming's reader once failed here with "Relative sample index ... is not present" on a
cold local directory) is printed and left out of the medians; the run goes on.
Each epoch also reports the seconds to its first batch (cold / warm: the DataLoader's
workers starting, then the first reads) and the CPU it cost per sample, in microseconds, by party: the
training process (which checks and copies the samples), the DataLoader workers and, for shardfeed,
the service. On a shared machine, these move less with the load than samples/s do. For
shardfeed each round also gives the service's S3 reads against the tar shards' bytes.

    python -m shardfeed.benchmarks.loaders --samples 20000 --size 10KiB --rounds 5
    python -m shardfeed.benchmarks.loaders --samples 2000 --size 100KiB,1MiB --rounds 3 --latency-ms 20

``--size 10KiB,100KiB,1MiB`` runs each size in turn, each on its own S3 server and with
the same bytes of samples (``--samples`` is the first size's count), every loader at each.

``--latency-ms N`` puts the counting proxy (``s3proxy.py``, a process of its own) in front of
the S3 server for every loader alike (the service, Streaming and s3torchconnector all read
through it), adding N ms to every S3 request (cloud S3's time to first byte; 0 counts
without delay). Each epoch then also reports the bytes its loader read from S3 (the bodies of
the GETs, the proxy's ``read_bytes``), against the loader's own copy of the dataset on S3 (the tar shards, the MDS
shards, the objects).

``--rounds`` (5) sets the rounds, ``--service-workers`` the service's ``--workers`` (default: the
usable cores), ``--shard-size`` the tar and MDS shards' size (4 MiB), ``--s3`` the server.
``--serve-arg`` passes a knob to ``shardfeed serve``.
``--baseline-serve-arg`` adds the map-style loader against a second configuration in the
same rounds, e.g. the cold path as it was before fetch windows and direct cache writes:
``--baseline-serve-arg=--fetch-window=0 --baseline-serve-arg=--cache-writes=buffered``.

Streaming and s3torchconnector are optional: the Makefile's venv has both (installed without
their dependencies; ``import_streaming`` stands in for torchvision and transformers). Without
one, the others are measured and the script says so.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib
import importlib.machinery
import importlib.util
import multiprocessing
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
import types
import warnings
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from shardfeed.benchmarks.common import (
    BENCH_DATA,
    Digests,
    WrongBytes,
    benchmark_parser,
    load_note,
    seeded_s3,
    seeded_s3_arguments,
    upload,
)
from shardfeed.benchmarks.s3proxy import control, start_proxy_process
from shardfeed.benchmarks.serverside import tree_cpu
from shardfeed.client.tensors import Batch
from shardfeed.client.torch import ShardfeedDataset, ShardfeedIterableDataset, ShardfeedLoader
from shardfeed.process import scrape_metrics, start_service, stop_process
from shardfeed.seeds.synthetic import member_bytes, parse_sizes, sample_key
from shardfeed.sizes import parse_size

BATCH, LOADER_WORKERS = 64, 4
LOADERS = ("ram", "shardfeed-map", "shardfeed-iterable", "shardfeed-tensors", "streaming", "s3torchconnector")
BASELINE = "shardfeed-map-baseline"  # the map-style loader against --baseline-serve-arg's service
PEERS = ("streaming", "s3torchconnector")  # every other loader's medians are also given against each
OBJECTS = "s3://bench/objects"  # s3torchconnector's dataset: one object per sample
NO_CACHE = "s3torchconnector"  # its warm epoch reads S3 again, as its cold one did


class _StandIn(types.ModuleType):
    """An empty module: any name in it is a placeholder class."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return type(name, (), {})


# The modules Streaming imports at import time from packages that the Makefile leaves out
# (it installs Streaming with --no-deps): no torchvision wheel works with the CPU torch build,
# and transformers (Streaming wants < 5) would pull a tokenizer stack for two isinstance checks
# in its StreamingDataLoader and the tokenizers of its C4 and Pile datasets.
_STANDING_IN = {
    "torchvision": ("torchvision", "torchvision.datasets", "torchvision.transforms",
                    "torchvision.transforms.functional"),
    "transformers": ("transformers", "transformers.feature_extraction_utils", "transformers.tokenization_utils_base",
                     "transformers.models", "transformers.models.auto", "transformers.models.auto.tokenization_auto"),
}


def import_streaming() -> types.ModuleType | None:
    """MosaicML Streaming, or ``None`` when it is not installed.

    Each package of ``_STANDING_IN`` that is not installed gets empty stand-ins: no vision or
    tokenizer code runs here.
    """
    if importlib.util.find_spec("streaming") is None:
        return None
    for package, names in _STANDING_IN.items():
        if importlib.util.find_spec(package) is None:
            for name in names:
                module = sys.modules[name] = _StandIn(name)
                module.__spec__ = importlib.machinery.ModuleSpec(name, None)
    return importlib.import_module("streaming")


def chosen_loaders(parser, text: str, loaders: Sequence[str]) -> tuple[list[str], types.ModuleType | None]:
    """``--loaders`` (comma-separated, some of ``loaders``: else a usage error) and Streaming where
    ``"streaming"`` is among them: left out, and the run says so, where it is not installed (as is
    ``"s3torchconnector"``)."""
    kinds = [kind.strip() for kind in text.split(",") if kind.strip()]
    if not kinds or set(kinds) - set(loaders):
        parser.error(f"--loaders takes some of {', '.join(loaders)}, not {text!r}")
    streaming = import_streaming() if "streaming" in kinds else None
    if "streaming" in kinds and streaming is None:
        print("MosaicML Streaming is not installed (pip install mosaicml-streaming): measuring the others")
        kinds.remove("streaming")
    if "s3torchconnector" in kinds and importlib.util.find_spec("s3torchconnector") is None:
        print("s3torchconnector is not installed (pip install s3torchconnector): measuring the others")
        kinds.remove("s3torchconnector")
    return kinds, streaming


class RamDataset(Dataset):
    """The seeded samples, held in this process as ``bytes`` (the DataLoader's workers get
    them by ``fork``): what any loader hands the DataLoader at best."""

    def __init__(self, samples: int, sizes: tuple[int, int]):
        self.bins = [member_bytes(0, i, "bin", sizes) for i in range(samples)]
        self.labels = [member_bytes(0, i, "cls", sizes) for i in range(samples)]

    def __len__(self) -> int:
        return len(self.bins)

    def __getitem__(self, i: int) -> dict:
        return {"__index__": i, "bin": self.bins[i], "cls": self.labels[i]}


def _collate(samples: list) -> list:
    return samples


def sample_bins(batch) -> tuple[list[int], list]:
    """A batch's sample indices and each sample's ``bin`` bytes, as the loader hands them: a
    ``Batch``'s as slices of its buffer (memoryviews: a torch view per sample costs more than
    reading its 10 KiB), a list of sample dicts' (``__index__``, or Streaming's ``index``) as they are."""
    if isinstance(batch, Batch):
        field, data = batch["bin"], memoryview(batch.buffer.numpy())
        return batch.indices.tolist(), [data[o:o + n] for o, n in zip(field.offsets.tolist(), field.lengths.tolist())]
    return [int(s["__index__"] if "__index__" in s else s["index"]) for s in batch], [s["bin"] for s in batch]


class Consumer:
    """The training process's use of each batch, the same for every loader: each sample's ``bin``
    checked against the seeded bytes (``WrongBytes`` where it differs), then every byte of the
    batch read once, as a copy to the GPU would: into one uint8 tensor, kept from batch to batch
    (grown where a batch is larger), the samples one after another, or a ``Batch``'s buffer whole."""

    def __init__(self, digests: Digests):
        self.digests = digests
        self.staging = torch.empty(0, dtype=torch.uint8)

    def __call__(self, batch) -> int:
        """Check and copy ``batch``; its number of samples."""
        indices, bins = sample_bins(batch)
        for i, data in zip(indices, bins, strict=True):
            self.digests.check(i, "bin", data)
        if isinstance(batch, Batch):
            self._room(batch.buffer.numel()).copy_(batch.buffer)
        else:
            room, at = self._room(sum(len(data) for data in bins)).numpy(), 0
            for data in bins:
                room[at:at + len(data)] = np.frombuffer(data, np.uint8)
                at += len(data)
        return len(indices)

    def _room(self, size: int) -> torch.Tensor:
        if size > self.staging.numel():
            self.staging = torch.empty(size, dtype=torch.uint8)
        return self.staging[:size]


PARTIES = ("main", "workers", "service")


@dataclass
class Epoch:
    """One epoch: samples/s, microseconds of CPU per sample for each of ``PARTIES``, the seconds
    from the loader's first ``next`` to its first batch (workers started, first reads) and, behind
    the counting proxy, the bytes read from S3 over it (``None`` without the proxy)."""

    rate: float
    cpu: dict[str, float]
    first: float = 0.0
    s3: int | None = None


def _cpu(service_pid: int | None) -> dict[str, float]:
    """CPU seconds so far of this process, of its children waited for (the DataLoader workers
    of finished epochs: a DataLoader joins its workers at the end of an epoch), and of the service."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return {"main": own.ru_utime + own.ru_stime, "workers": children.ru_utime + children.ru_stime,
            "service": tree_cpu(service_pid) if service_pid is not None else 0.0}


def _s3_bytes(proxy: str | None) -> int | None:
    return control(proxy, "bytes")["read"] if proxy else None


def epochs(loader, consume: Consumer, service_pid: int | None = None, proxy: str | None = None,
           count: int = 2) -> list[Epoch]:
    """``count`` epochs of ``loader``, each batch given to ``consume``: each one's samples/s, CPU
    per sample and, with the counting ``proxy``'s URL, bytes read from S3."""
    out = []
    for _ in range(count):
        cpu, read, began, n, first = _cpu(service_pid), _s3_bytes(proxy), time.perf_counter(), 0, 0.0
        for batch in loader:
            first = first or time.perf_counter() - began
            n += consume(batch)
        rate = n / (time.perf_counter() - began)
        cpu = {party: (spent - cpu[party]) * 1e6 / n for party, spent in _cpu(service_pid).items()}
        out.append(Epoch(rate, cpu, first, None if proxy is None else _s3_bytes(proxy) - read))
    return out


def shardfeed_round(kind: str, url: str, samples: int, sizes, seed: int, service_pid: int | None = None,
                    proxy: str | None = None) -> list[Epoch]:
    consume = Consumer(Digests(samples, sizes))
    if kind == "shardfeed-iterable":
        dataset = ShardfeedIterableDataset(url, "bench", batch_size=BATCH, seed=seed, collate_fn=None)
        return epochs(ShardfeedLoader(dataset, num_workers=LOADER_WORKERS), consume, service_pid, proxy)
    tensors = kind == "shardfeed-tensors"
    loader = DataLoader(ShardfeedDataset(url, "bench", output="tensors" if tensors else "samples"),
                        batch_size=BATCH, shuffle=True, num_workers=LOADER_WORKERS,
                        generator=torch.Generator().manual_seed(seed),
                        # The default collate_fn hands a Batch on; sample dicts stay a list.
                        **({} if tensors else {"collate_fn": _collate}))
    return epochs(loader, consume, service_pid, proxy)


def ram_round(samples: int, sizes, seed: int) -> list[Epoch]:
    """The same samples from RAM through the same DataLoader: its ceiling for ``bytes``."""
    loader = DataLoader(RamDataset(samples, sizes), batch_size=BATCH, shuffle=True, num_workers=LOADER_WORKERS,
                        collate_fn=_collate, generator=torch.Generator().manual_seed(seed))
    return epochs(loader, Consumer(Digests(samples, sizes)))


STREAMING_LOCK = Path(tempfile.gettempdir()) / "shardfeed-streaming-shm.lock"


def streaming_dataset(streaming, *, clean: bool = False, kind: type | None = None, **options):
    """``streaming.StreamingDataset(**options)`` (or ``kind``, a subclass of it), after Streaming's
    leaked shared memory is removed (with ``clean``), under a lock every process of the host takes:
    Streaming names its shared memory by a prefix it finds free by trying names, and cleans by
    creating and removing each, so two processes at it at once (tests on several workers, a
    benchmark beside them) collide on a name (``FileExistsError``)."""
    with open(STREAMING_LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if clean:
            streaming.base.util.clean_stale_shared_memory()
        return (kind or streaming.StreamingDataset)(**options)


def streaming_round(remote: str, local: Path, samples: int, sizes, seed: int, proxy: str | None = None) -> list[Epoch]:
    """Streaming from ``remote`` (its endpoint: ``S3_ENDPOINT_URL`` in the environment)."""
    dataset = streaming_dataset(import_streaming(), clean=True, remote=remote, local=str(local), shuffle=True,
                                shuffle_seed=seed, batch_size=BATCH)
    loader = DataLoader(dataset, batch_size=BATCH, num_workers=LOADER_WORKERS, collate_fn=_collate)
    return epochs(loader, Consumer(Digests(samples, sizes)), proxy=proxy)


def object_sample(reader) -> dict:
    """An object of ``OBJECTS`` (an ``S3Reader``) as a sample dict: its bytes, index and label from its key."""
    index, _, label = reader.key.rpartition("/")[2].partition(".")
    return {"__index__": int(index), "bin": reader.read(), "cls": label.encode()}


def s3torchconnector_round(endpoint: str, region: str, samples: int, sizes, seed: int,
                           proxy: str | None = None) -> list[Epoch]:
    """s3torchconnector's ``S3MapDataset`` over ``OBJECTS`` at ``endpoint`` (credentials from the
    environment), one GET per sample, shuffled by the DataLoader."""
    from s3torchconnector import S3ClientConfig, S3MapDataset  # optional: chosen_loaders checked it is there

    dataset = S3MapDataset.from_prefix(f"{OBJECTS}/", region=region, endpoint=endpoint, transform=object_sample,
                                       # the loopback endpoint has no bucket subdomains
                                       s3client_config=S3ClientConfig(force_path_style=True))
    loader = DataLoader(dataset, batch_size=BATCH, shuffle=True, num_workers=LOADER_WORKERS, collate_fn=_collate,
                        generator=torch.Generator().manual_seed(seed))
    return epochs(loader, Consumer(Digests(samples, sizes)), proxy=proxy)


def write_objects(server, samples: int, sizes, tmp: Path) -> None:
    """The synthetic samples as one object each at ``OBJECTS``: ``<index>.<label>``, its ``bin`` bytes."""
    out = tmp / "objects"
    out.mkdir()
    for i in range(samples):
        label = member_bytes(0, i, "cls", sizes).decode()
        (out / f"{sample_key(i)}.{label}").write_bytes(member_bytes(0, i, "bin", sizes))
    upload(server, out, OBJECTS)
    shutil.rmtree(out)


def in_fresh_process(round_, *args) -> list[Epoch]:
    """``round_(*args)`` in a new Python process (spawned: nothing inherited but the
    environment), which it has to itself; its exception, if any, is raised here."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"),
                             initializer=_platform_start_method) as process:
        return process.submit(round_, *args).result()


def peer_round(label: str, round_, *args) -> list | None:
    """``in_fresh_process(round_, *args)`` for a peer's round, or ``None`` where the peer failed on
    its own: a finding, not the end of the run (printed after ``label``, left out of the medians).
    A wrong byte still ends the run."""
    try:
        return in_fresh_process(round_, *args)
    except WrongBytes:
        raise
    except Exception as exc:  # noqa: BLE001 - the peer's own failure
        last = str(exc).strip().splitlines()[-1][:200] if str(exc).strip() else ""
        print(f"{label} failed, left out of the medians: {type(exc).__name__}: {last}", flush=True)
        return None


def _platform_start_method() -> None:
    """A spawned process would spawn its own children too (the DataLoader workers, each then
    importing torch anew): give it the platform's default, as a training script has."""
    multiprocessing.set_start_method(None, force=True)
    _quiet()


def _quiet() -> None:
    # 4 DataLoader workers on fewer cores is the setting compared, not a mistake to warn about.
    warnings.filterwarnings("ignore", message="This DataLoader will create")


def write_mds(streaming, server, samples: int, sizes, shard_size: int, tmp: Path, *, seed: int = 0,
              url: str = "s3://bench/mds", stream: int | None = None) -> str:
    """The synthetic dataset ``seed`` as Streaming's MDS shards (``index``, ``bin``, ``cls``), at ``url``;
    with ``stream``, a column ``stream`` holding it in every sample (a mixture's, ``mixture.py``)."""
    out = tmp / url.removeprefix("s3://").replace("/", "-")
    tagged = {"stream": stream} if stream is not None else {}
    columns = {"index": "int", "bin": "bytes", "cls": "bytes", **{column: "int" for column in tagged}}
    with streaming.MDSWriter(out=str(out), columns=columns, size_limit=shard_size) as writer:
        for i in range(samples):
            writer.write({"index": i, "bin": member_bytes(seed, i, "bin", sizes),
                          "cls": member_bytes(seed, i, "cls", sizes), **tagged})
    upload(server, out, url)
    return url


def main(argv=None) -> int:
    parser = benchmark_parser(__doc__, __spec__.name)
    seeded_s3_arguments(parser, samples=20000, shard_size="4MiB",
                        s3_help="the S3 server every loader reads from (default: SeaweedFS when installed)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--service-workers", type=int, default=len(os.sched_getaffinity(0)),
                        help="shardfeed serve --workers (default: the usable cores)")
    parser.add_argument("--loaders", default=",".join(LOADERS),
                        help=f"which loaders to run, comma-separated (default: all of {', '.join(LOADERS)}; "
                             "Streaming and s3torchconnector only where installed)")
    parser.add_argument("--latency-ms", type=float, default=None,
                        help="read S3 through the counting proxy, which adds this many ms to every request, "
                             "for every loader; each epoch's S3 bytes are then printed (default: no proxy)")
    parser.add_argument("--serve-arg", action="append", default=[],
                        help="a further argument for shardfeed serve, e.g. --serve-arg=--fetch-window=0")
    parser.add_argument("--baseline-serve-arg", action="append", default=[],
                        help="also run the map-style loader, as 'shardfeed-map-baseline', against a service "
                             "with these arguments instead, in the same rounds: two configurations side by side")
    args = parser.parse_args(argv)
    if args.latency_ms is not None and args.latency_ms < 0:
        parser.error(f"--latency-ms must not be negative, not {args.latency_ms:g}")
    kinds, streaming = chosen_loaders(parser, args.loaders, LOADERS)
    _quiet()
    if args.baseline_serve_arg:
        kinds.insert(1, BASELINE)
    for size, samples in sample_counts(args.size, args.samples):
        run_size(args, size, samples, kinds, streaming)
    return 0


def sample_counts(sizes: str, samples: int) -> list[tuple[str, int]]:
    """Each of the comma-separated ``sizes`` with its samples: the same bytes at every size,
    the first taking ``samples``, none fewer than ten batches."""
    each = [size.strip() for size in sizes.split(",") if size.strip()]
    first = parse_sizes(each[0])[1]
    return [(size, samples if number == 0 else max(BATCH * 10, samples * first // parse_sizes(size)[1]))
            for number, size in enumerate(each)]


def _stored(server, url: str, suffix: str = "") -> int:
    """The bytes of the objects under ``url`` whose keys end in ``suffix``."""
    bucket, _, prefix = url.removeprefix("s3://").partition("/")
    pages = server.client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=f"{prefix}/")
    return sum(o["Size"] for page in pages for o in page.get("Contents", ()) if o["Key"].endswith(suffix))


def run_size(args, size: str, samples: int, kinds: list[str], streaming) -> None:
    """The rounds of every loader at one sample size, on its own seeded S3 server (behind the
    counting proxy with ``--latency-ms``), and their medians."""
    sizes = parse_sizes(size)
    with tempfile.TemporaryDirectory() as tmp_name, contextlib.ExitStack() as stack:
        server = stack.enter_context(seeded_s3(args.s3, samples, size, args.shard_size, fields="bin,cls"))
        tmp = Path(tmp_name)
        proxy = None
        if args.latency_ms is not None:
            proxy, process = start_proxy_process(server.endpoint, args.latency_ms, tmp / "proxy.log")
            stack.callback(stop_process, process)
        endpoint = proxy or server.endpoint
        env = {**server.env(), "AWS_ENDPOINT_URL": endpoint}  # the service's and s3torchconnector's credentials
        os.environ.update(env)
        os.environ["S3_ENDPOINT_URL"] = endpoint  # Streaming's name for a custom endpoint
        remote = write_mds(streaming, server, samples, sizes, parse_size(args.shard_size), tmp) if streaming else None
        if "s3torchconnector" in kinds:
            write_objects(server, samples, sizes, tmp)
        shard_bytes = _stored(server, BENCH_DATA, ".tar")
        copies = {kind: _copy(server, kind, remote, shard_bytes) for kind in kinds if kind != "ram"}
        results: dict[str, list[list[Epoch] | None]] = {k: [] for k in kinds}
        for r in range(args.rounds):
            for kind in (kinds if r % 2 == 0 else kinds[::-1]):
                scratch = tmp / f"{kind}-{r}"  # Streaming's local directory, or the service's cache
                label = f"round {r + 1} {kind:20s}"
                store = ""
                try:
                    if kind == "streaming":
                        rates = peer_round(label, streaming_round, remote, scratch, samples, sizes, r, proxy)
                    elif kind == "s3torchconnector":
                        rates = peer_round(label, s3torchconnector_round, endpoint, server.region, samples, sizes, r,
                                           proxy)
                    elif kind == "ram":
                        rates = in_fresh_process(ram_round, samples, sizes, r)
                    else:
                        with start_service({"bench": BENCH_DATA}, cache_dir=scratch, env=env,
                                           workers=args.service_workers,
                                           args=args.baseline_serve_arg if kind == BASELINE else args.serve_arg) as svc:
                            rates = in_fresh_process(shardfeed_round, kind, svc.url, samples, sizes, r,
                                                     svc.process.pid, proxy)
                            read = scrape_metrics(svc.url)["shardfeed_store_bytes_total"] / shard_bytes
                            store = f"S3 {read:.2f}x the shards   "
                finally:  # the next rounds start with as much free memory as this one did
                    shutil.rmtree(scratch, ignore_errors=True)
                results[kind].append(rates)
                if rates is None:
                    continue
                through = (f"   S3 read {_megabytes(rates[0].s3)} / {_megabytes(rates[1].s3)} MB"
                           if proxy and kind != "ram" else "")
                print(f"{label} cold {rates[0].rate:8.0f}  warm {rates[1].rate:8.0f} samples/s   {store}"
                      f"first batch {rates[0].first:5.2f} / {rates[1].first:5.2f} s   "
                      f"CPU us/sample cold {_parts(rates[0].cpu)}, warm {_parts(rates[1].cpu)}{through}", flush=True)
    print(f"\n{samples} x {size} samples, DataLoader(batch_size={BATCH}, num_workers={LOADER_WORKERS}), "
          f"shuffled, medians of {args.rounds} rounds, {server.kind} S3"
          f"{f' behind the counting proxy (+{args.latency_ms:g} ms a request)' if proxy else ''}; "
          f"shardfeed serve --workers {' '.join([str(args.service_workers), *args.serve_arg])}"
          f"{'; baseline: ' + ' '.join(args.baseline_serve_arg) if args.baseline_serve_arg else ''}; "
          f"{load_note()}")
    if NO_CACHE in kinds:
        print(f"{NO_CACHE} keeps no cache: its warm epoch is a second cold one")
    report(results, copies if proxy else None)


def _copy(server, kind: str, remote: str | None, shard_bytes: int) -> tuple[int, str]:
    """The bytes of ``kind``'s copy of the dataset on S3, and what it is."""
    if kind == "streaming":
        return _stored(server, remote, ".mds"), "MDS shards"
    if kind == "s3torchconnector":
        return _stored(server, OBJECTS), "objects"
    return shard_bytes, "tar shards"


def report(results: dict[str, list[list[Epoch] | None]], copies: dict[str, tuple[int, str]] | None) -> None:
    """The medians of each loader, its ratios to each peer and to the in-RAM ceiling, its CPU per
    sample and, with ``copies`` (each loader's copy on S3: ``_copy``), its S3 reads per epoch."""
    done = {k: [r for r in v if r is not None] for k, v in results.items()}
    done = {k: v for k, v in done.items() if v}  # a loader with no round left has no median
    medians = {k: [statistics.median(r[e].rate for r in v) for e in range(2)] for k, v in done.items()}
    for kind, (cold, warm) in medians.items():
        ratio = ""
        for peer in PEERS:
            if peer in medians and kind != peer:
                base = medians[peer]
                ratio += (f"   {cold / base[0]:.2f}x / {warm / base[1]:.2f}x {peer} "
                          f"(per round {paired_ratios(results[kind], results[peer])})")
        if "ram" in medians and kind != "ram":
            base = medians["ram"]
            ratio += f"   {cold / base[0]:.2f}x / {warm / base[1]:.2f}x the in-RAM ceiling"
        if kind == "shardfeed-map" and BASELINE in medians:
            base = medians[BASELINE]
            ratio += f"   {cold / base[0]:.2f}x / {warm / base[1]:.2f}x the baseline"
        firsts = [statistics.median(r[e].first for r in done[kind]) for e in range(2)]
        print(f"{kind:20s} cold {cold:8.0f}  warm {warm:8.0f} samples/s   first batch {firsts[0]:.2f} / "
              f"{firsts[1]:.2f} s{ratio}")
    print(f"\nCPU per sample, us ({' + '.join(PARTIES)}), medians:")
    for kind, rounds in done.items():
        cpu = [{p: statistics.median(r[e].cpu[p] for r in rounds) for p in PARTIES} for e in range(2)]
        print(f"{kind:20s} cold {_parts(cpu[0])}   warm {_parts(cpu[1])}")
    if copies is None:
        return
    print("\nS3 bytes read per epoch through the proxy, medians, against the loader's own copy on S3:")
    for kind, rounds in done.items():
        if kind == "ram":
            continue
        copy, name = copies[kind]
        read = [statistics.median(r[e].s3 for r in rounds) for e in range(2)]
        print(f"{kind:20s} cold {read[0] / copy:5.2f}x  warm {read[1] / copy:5.2f}x  of {copy / 1e6:,.1f} MB "
              f"of {name} ({_megabytes(read[0])} / {_megabytes(read[1])} MB)")


def _megabytes(count: float) -> str:
    return f"{count / 1e6:,.1f}"


def paired_ratios(rounds: list[list[Epoch] | None], base: list[list[Epoch] | None]) -> str:
    """The median and range of the ratios within each round, cold / warm: a round's loaders run
    one after the other, so load that drifts over the whole run moves them alike. A round
    that failed (``None``) has no ratio."""
    pairs = [(r, b) for r, b in zip(rounds, base) if r is not None and b is not None]
    spans = []
    for e in range(2):
        ratios = [r[e].rate / b[e].rate for r, b in pairs]
        spans.append(f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})")
    return " / ".join(spans)


def _parts(cpu: dict[str, float]) -> str:
    """``main + workers + service = total`` microseconds per sample."""
    return f"{' + '.join(f'{cpu[p]:.0f}' for p in PARTIES)} = {sum(cpu.values()):.0f}"


if __name__ == "__main__":
    raise SystemExit(main())
