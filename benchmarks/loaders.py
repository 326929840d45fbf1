"""DataLoader epochs on one node: shardfeed against MosaicML Streaming, over the same S3.

The loader a user would otherwise pick, tried as a new user would: the same samples
(``bin`` bytes and a ``cls`` label) on one S3 server on loopback (SeaweedFS, or moto with
``--s3 moto``), as shardfeed
shards for ``shardfeed serve`` and as Streaming's MDS shards. Each loader runs
``DataLoader(batch_size=64, num_workers=4)``, shuffled, for two epochs: the first on
cold caches (a fresh service cache; a fresh Streaming local directory), the second warm.
Rounds alternate the loaders; the medians are printed with the shardfeed/Streaming
ratios, and the median and range of the ratios within each round. Each loader's round runs
in a fresh Python process, as a training job would start: Streaming, run round after round
in one process, got slower from round to round (a cold epoch from 15.5k down to 4.8k
samples/s). Its cold epoch still stalls for about 60 s in some rounds; the medians and
per-round ratios show how often. Every batch is
checked: each sample's ``bin`` is compared with the bytes seeded. A Streaming round that
raises (its reader once failed here with "Relative sample index ... is not present" on a
cold local directory) is printed and left out of the medians; the run goes on.
Each epoch also reports the seconds to its first batch (cold / warm: the DataLoader's
workers starting, then the first reads) and the CPU it cost per sample, in microseconds, by party: the
training process (which checks the samples), the DataLoader workers and, for shardfeed,
the service. On a shared machine, these move less with the load than samples/s do.

    python -m shardfeed.benchmarks.loaders --samples 20000 --size 10KiB --rounds 5

The ``ram`` loader hands out the same samples held in the training process as ``bytes``
(a map-style dataset): the DataLoader's own ceiling for that output, against which the
other loaders' medians are also given.

``--size 10KiB,100KiB,1MiB`` runs each size in turn, each on its own S3 server and with
the same bytes of samples (``--samples`` is the first size's count).

``--loaders`` picks some of the four; ``--serve-arg`` passes a knob to ``shardfeed serve``.
``--baseline-serve-arg`` adds the map-style loader against a second configuration in the
same rounds, e.g. the cold path as it was before fetch windows and direct cache writes:
``--baseline-serve-arg=--fetch-window=0 --baseline-serve-arg=--cache-writes=buffered``.

Streaming is optional: the Makefile's venv has it (installed without its dependencies;
``import_streaming`` stands in for torchvision and transformers). Without it, shardfeed alone
is measured and the script says so.
"""

from __future__ import annotations

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

import torch
from torch.utils.data import DataLoader, Dataset

from shardfeed.benchmarks.common import (
    BENCH_DATA,
    WrongBytes,
    benchmark_parser,
    load_note,
    seeded_s3,
    seeded_s3_arguments,
    upload,
)
from shardfeed.benchmarks.serverside import tree_cpu
from shardfeed.client.torch import ShardfeedDataset, ShardfeedIterableDataset, ShardfeedLoader
from shardfeed.process import scrape_metrics, start_service
from shardfeed.seeds.synthetic import member_bytes, parse_sizes
from shardfeed.sizes import parse_size

BATCH, LOADER_WORKERS = 64, 4
LOADERS = ("ram", "shardfeed-map", "shardfeed-iterable", "streaming")
BASELINE = "shardfeed-map-baseline"  # the map-style loader against --baseline-serve-arg's service


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
    ``"streaming"`` is among them: left out, and the run says so, where it is not installed."""
    kinds = [kind.strip() for kind in text.split(",") if kind.strip()]
    if not kinds or set(kinds) - set(loaders):
        parser.error(f"--loaders takes some of {', '.join(loaders)}, not {text!r}")
    streaming = import_streaming() if "streaming" in kinds else None
    if "streaming" in kinds and streaming is None:
        print("MosaicML Streaming is not installed (pip install mosaicml-streaming): measuring shardfeed alone")
        kinds.remove("streaming")
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


def _check(batch: list, seed_sizes: tuple[int, int], key: str) -> int:
    for sample in batch:
        i = int(sample[key])
        assert bytes(sample["bin"]) == member_bytes(0, i, "bin", seed_sizes), f"sample {i}: wrong bytes"
    return len(batch)


PARTIES = ("main", "workers", "service")


@dataclass
class Epoch:
    """One epoch: samples/s, microseconds of CPU per sample for each of ``PARTIES``, and the
    seconds from the loader's first ``next`` to its first batch (workers started, first reads)."""

    rate: float
    cpu: dict[str, float]
    first: float = 0.0


def _cpu(service_pid: int | None) -> dict[str, float]:
    """CPU seconds so far of this process, of its children waited for (the DataLoader workers
    of finished epochs: a DataLoader joins its workers at the end of an epoch), and of the service."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return {"main": own.ru_utime + own.ru_stime, "workers": children.ru_utime + children.ru_stime,
            "service": tree_cpu(service_pid) if service_pid is not None else 0.0}


def _epochs(loader, sizes, key: str, service_pid: int | None = None, epochs: int = 2) -> list[Epoch]:
    """Each epoch's samples/s and CPU per sample, every sample checked."""
    out = []
    for _ in range(epochs):
        cpu, began, n, first = _cpu(service_pid), time.perf_counter(), 0, 0.0
        for batch in loader:
            first = first or time.perf_counter() - began
            n += _check(batch, sizes, key)
        rate = n / (time.perf_counter() - began)
        cpu = {party: (spent - cpu[party]) * 1e6 / n for party, spent in _cpu(service_pid).items()}
        out.append(Epoch(rate, cpu, first))
    return out


def shardfeed_round(kind: str, url: str, sizes, seed: int, service_pid: int | None = None) -> list[Epoch]:
    if kind in ("shardfeed-map", BASELINE):
        loader = DataLoader(ShardfeedDataset(url, "bench"), batch_size=BATCH, shuffle=True,
                            num_workers=LOADER_WORKERS, collate_fn=_collate, persistent_workers=False)
        return _epochs(loader, sizes, "__index__", service_pid)
    dataset = ShardfeedIterableDataset(url, "bench", batch_size=BATCH, seed=seed, collate_fn=None)
    return _epochs(ShardfeedLoader(dataset, num_workers=LOADER_WORKERS), sizes, "__index__", service_pid)


def ram_round(samples: int, sizes, seed: int) -> list[Epoch]:
    """The same samples from RAM through the same DataLoader: its ceiling for ``bytes``."""
    loader = DataLoader(RamDataset(samples, sizes), batch_size=BATCH, shuffle=True, num_workers=LOADER_WORKERS,
                        collate_fn=_collate, generator=torch.Generator().manual_seed(seed))
    return _epochs(loader, sizes, "__index__")


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


def streaming_round(remote: str, local: Path, sizes, seed: int) -> list[Epoch]:
    dataset = streaming_dataset(import_streaming(), clean=True, remote=remote, local=str(local), shuffle=True,
                                shuffle_seed=seed, batch_size=BATCH)
    loader = DataLoader(dataset, batch_size=BATCH, num_workers=LOADER_WORKERS, collate_fn=_collate)
    return _epochs(loader, sizes, "index")


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
                        s3_help="the S3 server both loaders read from (default: SeaweedFS when installed)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--service-workers", type=int, default=len(os.sched_getaffinity(0)),
                        help="shardfeed serve --workers (default: the usable cores)")
    parser.add_argument("--loaders", default=",".join(LOADERS),
                        help=f"which loaders to run, comma-separated (default: all of {', '.join(LOADERS)}; "
                             "Streaming only where installed)")
    parser.add_argument("--serve-arg", action="append", default=[],
                        help="a further argument for shardfeed serve, e.g. --serve-arg=--fetch-window=0")
    parser.add_argument("--baseline-serve-arg", action="append", default=[],
                        help="also run the map-style loader, as 'shardfeed-map-baseline', against a service "
                             "with these arguments instead, in the same rounds: two configurations side by side")
    args = parser.parse_args(argv)
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


def run_size(args, size: str, samples: int, kinds: list[str], streaming) -> None:
    """The rounds of every loader at one sample size, on its own seeded S3 server, and their medians."""
    sizes = parse_sizes(size)
    shard_size = parse_size(args.shard_size)
    with tempfile.TemporaryDirectory() as tmp_name, \
            seeded_s3(args.s3, samples, size, args.shard_size, fields="bin,cls") as server:
        tmp = Path(tmp_name)
        os.environ.update(server.env())
        os.environ["S3_ENDPOINT_URL"] = server.endpoint  # Streaming's name for a custom endpoint
        remote = write_mds(streaming, server, samples, sizes, shard_size, tmp) if streaming else None
        bucket, _, prefix = BENCH_DATA.removeprefix("s3://").partition("/")
        shard_bytes = sum(o["Size"] for o in server.client().list_objects_v2(Bucket=bucket, Prefix=prefix)["Contents"]
                          if o["Key"].endswith(".tar"))
        results: dict[str, list[list[Epoch] | None]] = {k: [] for k in kinds}
        for r in range(args.rounds):
            for kind in (kinds if r % 2 == 0 else kinds[::-1]):
                scratch = tmp / f"{kind}-{r}"  # Streaming's local directory, or the service's cache
                try:
                    if kind == "streaming":
                        rates = in_fresh_process(streaming_round, remote, scratch, sizes, r)
                    elif kind == "ram":
                        rates = in_fresh_process(ram_round, samples, sizes, r)
                    else:
                        with start_service({"bench": BENCH_DATA}, cache_dir=scratch, env=server.env(),
                                           workers=args.service_workers,
                                           args=args.baseline_serve_arg if kind == BASELINE else args.serve_arg) as svc:
                            rates = in_fresh_process(shardfeed_round, kind, svc.url, sizes, r, svc.process.pid)
                            read = scrape_metrics(svc.url)["shardfeed_store_bytes_total"] / shard_bytes
                except Exception as err:  # noqa: BLE001 - Streaming's fault ends its round, not the run
                    if kind != "streaming":
                        raise
                    results[kind].append(None)
                    print(f"round {r + 1} {kind:20s} failed, left out of the medians: "
                          f"{type(err).__name__}: {err}", flush=True)
                    continue
                finally:  # the next rounds start with as much free memory as this one did
                    shutil.rmtree(scratch, ignore_errors=True)
                results[kind].append(rates)
                store = f"S3 {read:.2f}x the shards   " if kind not in ("streaming", "ram") else ""
                print(f"round {r + 1} {kind:20s} cold {rates[0].rate:8.0f}  warm {rates[1].rate:8.0f} samples/s   "
                      f"{store}"
                      f"first batch {rates[0].first:5.2f} / {rates[1].first:5.2f} s   "
                      f"CPU us/sample cold {_parts(rates[0].cpu)}, warm {_parts(rates[1].cpu)}", flush=True)
    print(f"\n{samples} x {size} samples, DataLoader(batch_size={BATCH}, num_workers={LOADER_WORKERS}), "
          f"shuffled, medians of {args.rounds} rounds, {server.kind} S3; shardfeed serve --workers "
          f"{' '.join([str(args.service_workers), *args.serve_arg])}"
          f"{'; baseline: ' + ' '.join(args.baseline_serve_arg) if args.baseline_serve_arg else ''}; "
          f"{load_note()}")
    done = {k: [r for r in v if r is not None] for k, v in results.items()}
    done = {k: v for k, v in done.items() if v}  # a loader with no round left has no median
    medians = {k: [statistics.median(r[e].rate for r in v) for e in range(2)] for k, v in done.items()}
    for kind, (cold, warm) in medians.items():
        ratio = ""
        if "streaming" in medians and kind != "streaming":
            base = medians["streaming"]
            ratio = (f"   {cold / base[0]:.2f}x / {warm / base[1]:.2f}x Streaming "
                     f"(per round {paired_ratios(results[kind], results['streaming'])})")
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
