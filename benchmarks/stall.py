"""Data stalls: a training loop with a simulated step, fed by each loader, cold then warm.

A GPU step leaves the training process's CPU idle while it waits; what matters is whether
the next batch is there when the step ends. Each loader feeds the same loop,
``DataLoader(batch_size=64, num_workers=4, shuffle=True)`` over the same samples (``bin``
bytes and a ``cls`` label; SeaweedFS, or moto with ``--s3 moto``):

    ram                the samples held in the training process as ``bytes``, handed out by
                       a map-style dataset: the DataLoader's own ceiling for ``bytes``
    streaming          MosaicML Streaming (when installed), from its local directory
    shardfeed-bytes    ShardfeedDataset, sample dicts of ``bytes``
    shardfeed-tensors  ShardfeedDataset(output="tensors"): one shared-memory buffer a batch,
                       read from an Arrow answer (its layout sent first, nothing parsed per member)
    shardfeed-tensors-tar  the same from a tar answer, parsed member by member (``batch_format="tar"``):
                       the tensor output as it was before the Arrow format
    shardfeed-mds-bytes    ShardfeedDataset over Streaming's very MDS shards, served in place (layout
                       ``mds``: the prefix registered as it is, its columns the fields), sample dicts
    shardfeed-mds-tensors  the same, ``output="tensors"``

Streaming and the ``shardfeed-mds-*`` loaders read the same MDS shards (``index``, ``bin`` and
``cls`` columns, written by ``streaming.MDSWriter`` beside the tar shards, as large); with
Streaming in the run, the summary gives each shardfeed loader against it too, cold and warm
(issue 42's target: 1.5x over the MDS shards).

For each sample size, each loader runs in a fresh process: a cold epoch flat out (a service
started on an empty cache, Streaming with an empty local directory: the reads reach S3), then
warm, one epoch per step time, the loop sleeping ``step`` after each batch (a GPU step: no CPU
spent). Every epoch is reported, the cold one on a row of its own beside the warm ones, and
in the summary too. Per epoch: samples/s, the stall (the fraction of the wall time,
after the first batch, spent waiting for the next batch), the seconds to the first batch,
and CPU per sample, in microseconds, of the training process and of the DataLoader workers
(with the service's beside them; with a step it also counts what the processes spend per
second while they wait, so compare CPU flat out). The step times are 0 (the loader flat
out, a whole epoch) and by default 2x and 30x the time the ``ram`` loader took per batch
flat out (``--step-batches`` batches each); ``--steps-ms`` fixes them instead. With
``--rounds N`` the loaders run in turn N times (the order reversed every other round) and
the medians are compared: the machine's load drifts. With CUDA present
the training loop also moves each tensor batch to the GPU (pinned, ``non_blocking``) and
reports the copy's time per batch (the GPU decode is not timed: the samples are random
bytes, not images); ``--cuda`` insists on it, refusing to run without CUDA (``make
gpu-check`` runs it so, at small sizes).

    python -m shardfeed.benchmarks.stall --sizes 10KiB,100KiB,1MiB --plot stall.png
    python -m shardfeed.benchmarks.stall --cuda --sizes 10KiB,1MiB --samples 256 --loaders ram,shardfeed-tensors
    python -m shardfeed.benchmarks.stall --sizes 10KiB,100KiB --loaders streaming,shardfeed-mds-bytes,shardfeed-bytes

The plot (matplotlib, from the ``demo`` extra) shows the stall of each loader at each size
and step time. Every sample of every epoch is checked against the seeded bytes (an xxh3 per
sample, made before the loader starts: ``common.Digests``), and each full epoch must hold
every sample once.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from statistics import median

import torch
from torch.utils.data import DataLoader

from shardfeed.benchmarks.common import BENCH_DATA, Digests, benchmark_parser, load_note, seeded_s3
from shardfeed.benchmarks.loaders import (
    BATCH,
    LOADER_WORKERS,
    PARTIES,
    RamDataset,
    _collate,
    _cpu,
    _quiet,
    import_streaming,
    in_fresh_process,
    peer_round,
    sample_bins,
    streaming_dataset,
    write_mds,
)
from shardfeed.client.tensors import Batch
from shardfeed.client.torch import ShardfeedDataset
from shardfeed.process import start_service
from shardfeed.s3server import S3_SERVERS, default_server
from shardfeed.seeds.synthetic import parse_sizes
from shardfeed.sizes import parse_size

LOADERS = ("ram", "streaming", "shardfeed-bytes", "shardfeed-tensors", "shardfeed-tensors-tar",
           "shardfeed-mds-bytes", "shardfeed-mds-tensors")
OUTPUTS = {"shardfeed-bytes": ("samples", {}), "shardfeed-tensors": ("tensors", {}),
           "shardfeed-tensors-tar": ("tensors", {"batch_format": "tar"}),
           "shardfeed-mds-bytes": ("samples", {}), "shardfeed-mds-tensors": ("tensors", {})}
"""The ``output`` and client options of each shardfeed loader's ``ShardfeedDataset``."""
MDS_LOADERS = ("streaming", "shardfeed-mds-bytes", "shardfeed-mds-tensors")
"""The loaders that read the MDS shards (the others: the tar shards, or RAM)."""
STEP_MULTIPLES = (2, 30)
"""Default step times, as multiples of the ram loader's time per batch flat out. Its own
stall stays well above 5% at 2x: each batch is unpickled in the training process, inside
``next``; at 20x it was still 6.9% at 1 MiB here, at 30x below 5% at every size."""
DEFAULT_SAMPLES = {"10KiB": 20000, "100KiB": 6000, "1MiB": 800}
"""Samples per size by default: 200-800 MB, within the service's RAM tier but for 1 MiB."""


@dataclass
class Epoch:
    """One epoch of the loop: samples/s, stall, seconds to the first batch, CPU us per
    sample by party (``PARTIES``) and, with CUDA, ms per batch moving it to the GPU."""

    step: float
    rate: float
    stall: float
    first: float
    cpu: dict[str, float]
    to_gpu_ms: float | None = None


@dataclass
class Result:
    """One loader at one size: its cold epoch and its warm ones (flat out, then one per step)."""

    kind: str
    size: str
    cold: Epoch
    warm: list[Epoch]

    @classmethod
    def of(cls, kind: str, size: str, epochs: list[Epoch]) -> Result:
        """From the epochs as a round runs them, the cold one first."""
        return cls(kind, size, epochs[0], epochs[1:])

    def rows(self) -> list[tuple[str, Epoch]]:
        return [("cold", self.cold)] + [("warm", e) for e in self.warm]


def _epoch(loader, step: float, digests: Digests, service_pid: int | None, limit: int | None = None) -> Epoch:
    """One epoch of the training loop, or its first ``limit`` batches, every sample checked;
    each tensor batch moved to the GPU too, where there is one."""
    gpu = torch.cuda.is_available()
    cpu = _cpu(service_pid)
    began = time.perf_counter()
    waited, first, seen, copy = 0.0, 0.0, [], 0.0
    batches = iter(loader)
    while True:
        asked = time.perf_counter()
        try:
            batch = next(batches)
        except StopIteration:
            break
        got = time.perf_counter()
        if first:
            waited += got - asked
        else:
            first = got
        indices, bins = sample_bins(batch)
        seen += indices
        for i, data in zip(indices, bins, strict=True):
            digests.check(i, "bin", data)
        if gpu and isinstance(batch, Batch):
            copying = time.perf_counter()  # the checks above are not the copy's
            batch.pin_memory().to("cuda", non_blocking=True)  # pinned already by the DataLoader: no copy
            torch.cuda.synchronize()
            copy += time.perf_counter() - copying
        if step:
            time.sleep(step)
        if limit is not None and len(seen) >= limit * BATCH:
            break
    end = time.perf_counter()
    del batches  # the DataLoader's workers are joined: their CPU is counted
    if limit is None:
        assert sorted(seen) == list(range(digests.samples)), "the epoch did not hold every sample once"
    assert len(set(seen)) == len(seen), "a sample came twice in one epoch"
    spent = {party: (now - cpu[party]) * 1e6 / len(seen) for party, now in _cpu(service_pid).items()}
    return Epoch(step, len(seen) / (end - began), waited / max(end - first, 1e-9), first - began, spent,
                 copy * 1e3 * BATCH / len(seen) if gpu else None)


def stall_round(kind: str, source: str, local: str, samples: int, sizes, steps: list[float],
                service_pid: int | None, limit: int | None = None) -> list[Epoch]:
    """A fresh process's epochs for one loader: the cold one (flat out, warming the cache),
    then one per step (flat out the whole epoch; with a step, its first ``limit`` batches)."""
    _quiet()
    digests = Digests(samples, sizes)
    options = {"collate_fn": _collate}  # batches as lists of sample dicts
    if kind == "ram":
        dataset = RamDataset(samples, sizes)
    elif kind == "streaming":
        dataset = streaming_dataset(import_streaming(), clean=True, remote=source, local=local, shuffle=True,
                                    batch_size=BATCH)
    else:
        output, client_options = OUTPUTS[kind]
        dataset = ShardfeedDataset(source, "bench", output=output, **client_options)
        if output == "tensors":
            options = {}  # the default collate_fn hands the Batch on
    loader = DataLoader(dataset, batch_size=BATCH, shuffle=kind != "streaming",  # Streaming shuffles itself
                        num_workers=LOADER_WORKERS,
                        pin_memory=torch.cuda.is_available(), **options)
    out = [_epoch(loader, 0.0, digests, service_pid)]
    for step in steps:
        out.append(_epoch(loader, step, digests, service_pid, limit=limit if step else None))
    return out


def run_size(size: str, samples: int, kinds: list[str], steps_ms: list[float] | None, s3: str,
             service_workers: int, limit: int, rounds: int, tmp: Path) -> list[Result]:
    """Every loader at one sample size, on one seeded S3 server, ``rounds`` times (the
    loaders in turn, the order reversed every other round): the medians."""
    sizes = parse_sizes(size)
    streaming = import_streaming() if set(kinds) & set(MDS_LOADERS) else None
    shard_size = "4MiB" if parse_size(size) < (1 << 20) else "64MiB"
    runs: dict[str, list[list[Epoch]]] = {kind: [] for kind in kinds}
    with seeded_s3(s3, samples, size, shard_size, fields="bin,cls") as server:
        os.environ.update(server.env())
        os.environ["S3_ENDPOINT_URL"] = server.endpoint  # Streaming's name for a custom endpoint
        remote = write_mds(streaming, server, samples, sizes, parse_size(shard_size), tmp / size) if streaming else ""
        if steps_ms is None:  # multiples of the ram loader's time per batch, flat out
            period = BATCH / in_fresh_process(stall_round, "ram", "", "", samples, sizes, [0.0], None)[1].rate
            steps = [0.0] + [m * period for m in STEP_MULTIPLES]
        else:
            steps = [0.0] + [ms / 1e3 for ms in steps_ms]
        for r in range(rounds):
            for kind in kinds if r % 2 == 0 else kinds[::-1]:
                if kind in OUTPUTS:
                    served = remote if kind in MDS_LOADERS else BENCH_DATA
                    with start_service({"bench": served}, cache_dir=tmp / f"cache-{size}-{kind}-{r}",
                                       env=server.env(), workers=service_workers) as svc:
                        epochs = in_fresh_process(stall_round, kind, svc.url, "", samples, sizes, steps,
                                                  svc.process.pid, limit)
                else:  # its own local directory each round: its first epoch is cold too
                    local = tmp / f"local-{size}-{r}"
                    epochs = peer_round(f"round {r + 1} {size:>7} {kind}:", stall_round, kind, remote, str(local),
                                        samples, sizes, steps, None, limit)
                    shutil.rmtree(local, ignore_errors=True)
                    if epochs is None:
                        continue
                runs[kind].append(epochs)
                _report(Result.of(kind, size, epochs), f"round {r + 1}")
    return [Result.of(kind, size, _medians(done)) for kind, done in runs.items() if done]


def _medians(rounds: list[list[Epoch]]) -> list[Epoch]:
    """Each epoch (the cold one, then each step's), its figures the medians of the rounds'."""
    out = []
    for epochs in zip(*rounds):
        gpu = [e.to_gpu_ms for e in epochs if e.to_gpu_ms is not None]
        out.append(Epoch(epochs[0].step, median(e.rate for e in epochs), median(e.stall for e in epochs),
                         median(e.first for e in epochs), {p: median(e.cpu[p] for e in epochs) for p in PARTIES},
                         median(gpu) if gpu else None))
    return out


def _to_gpu(e: Epoch) -> str:
    return f"   to GPU {e.to_gpu_ms:.2f} ms/batch" if e.to_gpu_ms is not None else ""


def _report(result: Result, label: str) -> None:
    for when, e in result.rows():
        cpu = " + ".join(f"{e.cpu[p]:.0f}" for p in PARTIES)
        print(f"{label:8s} {result.size:>7} {result.kind:21s} {when} step {e.step * 1e3:6.1f} ms  {e.rate:8.0f} "
              f"samples/s  stall {e.stall:6.1%}  first batch {e.first:5.2f} s  CPU us/sample {cpu} "
              f"({' + '.join(PARTIES)}){_to_gpu(e)}", flush=True)


def _loader_cpu(e: Epoch) -> float:
    """CPU per sample of the training process and its DataLoader workers (the service's apart)."""
    return e.cpu["main"] + e.cpu["workers"]


SUMMARIES = {"ram": ("", "the ram loader (the DataLoader's ceiling for bytes)"),
             "streaming": ("shardfeed", "Streaming over the same MDS shards (issue 42's target: 1.5x cold and warm)")}
"""Each loader the summary holds others against: the loaders held (by prefix), and what it is."""


def summary(results: list[Result]) -> None:
    """Side by side: each loader against the ram ceiling, then each shardfeed loader against
    Streaming, cold and warm flat out, and warm at the steps (medians)."""
    for base_kind, (held, title) in SUMMARIES.items():
        bases = {r.size: r for r in results if r.kind == base_kind}
        if not bases:
            continue
        print(f"\nagainst {title}, same size, same epoch, medians:")
        for r in results:
            base = bases.get(r.size)
            if base is None or r.kind == base_kind or not r.kind.startswith(held):
                continue
            for when, e, b in (("cold", r.cold, base.cold), ("warm", r.warm[0], base.warm[0])):
                stalls = "" if when == "cold" else "; stall at " + ", ".join(
                    f"{s.step * 1e3:.1f} ms: {s.stall:.1%} ({base_kind} {t.stall:.1%})"
                    for s, t in zip(r.warm[1:], base.warm[1:]))
                print(f"{r.size:>7} {r.kind:21s} {when} {e.rate / b.rate:5.2f}x the samples/s ({e.rate:.0f}), "
                      f"loader CPU per sample {_loader_cpu(e) / _loader_cpu(b):5.2f}x ({_loader_cpu(e):.0f} us)"
                      f"{stalls}{_to_gpu(e)}")


def plot(results: list[Result], path: Path) -> None:
    """The stall of each loader, one group of bars per size and step (flat out left out), as
    ``report.py`` plots (matplotlib; the format follows ``path``'s suffix)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({(r.size, k) for r in results for k in range(1, len(r.warm))},
                    key=lambda g: (parse_size(g[0]), g[1]))
    kinds = [k for k in LOADERS if any(r.kind == k for r in results)]
    width = 0.8 / len(kinds)
    fig, ax = plt.subplots(figsize=(1.4 * len(groups) + 2, 4))
    for b, kind in enumerate(kinds):
        stalls = [next((r.warm[k].stall for r in results if r.size == size and r.kind == kind), 0.0)
                  for size, k in groups]
        ax.bar([g + b * width for g in range(len(groups))], stalls, width, label=kind)
    steps = [next(r.warm[k].step for r in results if r.size == size) * 1e3 for size, k in groups]
    ax.set_xticks([g + 0.4 - width / 2 for g in range(len(groups))],
                  [f"{size}\n{step:.0f} ms step" for (size, _), step in zip(groups, steps)])
    ax.axhline(0.05, color="grey", linewidth=1, linestyle=":", label="5%")
    ax.yaxis.set_major_formatter(matplotlib.ticker.PercentFormatter(1.0))
    ax.set_ylabel("time waiting for data")
    ax.set_title(f"Data stall, warm: DataLoader(batch_size={BATCH}, num_workers={LOADER_WORKERS})")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    parser = benchmark_parser(__doc__, __spec__.name)
    parser.add_argument("--sizes", default="10KiB,100KiB,1MiB")
    parser.add_argument("--samples", type=int, help="samples per size (default: %s)" % DEFAULT_SAMPLES)
    parser.add_argument("--loaders", default=",".join(LOADERS),
                        help=f"some of {', '.join(LOADERS)}")
    parser.add_argument("--steps-ms", help="step times to run at besides 0, comma-separated (default: "
                                           f"{' and '.join(f'{m}x' for m in STEP_MULTIPLES)} the ram loader's "
                                           "time per batch, per size)")
    parser.add_argument("--step-batches", type=int, default=16,
                        help="batches per epoch with a step (flat out: the whole epoch); default %(default)s")
    parser.add_argument("--s3", choices=S3_SERVERS, default=default_server(),
                        help="the S3 server (default here: %(default)s)")
    parser.add_argument("--service-workers", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--rounds", type=int, default=1, help="runs of every loader, in turn (medians)")
    parser.add_argument("--plot", type=Path, help="write a chart of the stalls here (.png, .svg)")
    parser.add_argument("--cuda", action="store_true",
                        help="time the tensor batches' copy to the GPU; refuse to run without CUDA")
    args = parser.parse_args(argv)
    if args.cuda and not torch.cuda.is_available():
        why = "sees no device" if torch.version.cuda else "is a build without CUDA"
        parser.exit(2, f"{parser.prog}: --cuda needs a CUDA device, and torch {torch.__version__} here {why}: "
                       "run it on a CUDA machine\n")
    kinds = [k.strip() for k in args.loaders.split(",") if k.strip()]
    if not kinds or set(kinds) - set(LOADERS):
        parser.error(f"--loaders takes some of {', '.join(LOADERS)}, not {args.loaders!r}")
    if args.cuda and "shardfeed-tensors" not in kinds:
        parser.error("--cuda times the copy of tensor batches: --loaders must include shardfeed-tensors")
    if set(kinds) & set(MDS_LOADERS) and import_streaming() is None:  # its MDSWriter writes the MDS shards
        print(f"MosaicML Streaming is not installed (pip install mosaicml-streaming): "
              f"{', '.join(k for k in kinds if k in MDS_LOADERS)} left out")
        kinds = [k for k in kinds if k not in MDS_LOADERS]
        if not kinds:
            parser.exit(2, "no loader left to run\n")
    steps_ms = [float(s) for s in args.steps_ms.split(",")] if args.steps_ms else None
    _quiet()
    results: list[Result] = []
    with tempfile.TemporaryDirectory() as tmp:
        for size in [s.strip() for s in args.sizes.split(",") if s.strip()]:
            samples = args.samples or DEFAULT_SAMPLES.get(size, max(200, (200 << 20) // parse_size(size)))
            print(f"\n{samples} x {size}, DataLoader(batch_size={BATCH}, num_workers={LOADER_WORKERS}), cold then "
                  f"warm; {args.s3} S3; shardfeed serve --workers {args.service_workers}", flush=True)
            results += run_size(size, samples, kinds, steps_ms, args.s3, args.service_workers, args.step_batches,
                                args.rounds, Path(tmp))
            for result in results[-len(kinds):]:
                _report(result, "median")
    summary(results)
    if args.plot:
        plot(results, args.plot)
        print(f"\nplot: {args.plot}")
    print(load_note())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
