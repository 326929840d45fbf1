"""Mixtures (issue 41): shardfeed's ``streams=`` beside MosaicML Streaming's, and a mixture four times the cache.

    python -m shardfeed.benchmarks.mixture --samples 6144 --cache-samples 12288 --rounds 3

A mixture here is three datasets of synthetic samples (``bin`` bytes and a ``cls`` label; each
dataset its own seed, so its own bytes), the first ``--big`` (10) times the size of each other,
weighed ``--weights`` (0.5, 0.3, 0.2), on one S3 server on loopback (SeaweedFS, or moto with
``--s3 moto``). An epoch holds as many samples as its datasets (Streaming's default too);
``--samples`` is rounded down so that it is whole batches of 64, no batch padded, and the counts
are exact.

**Side by side with Streaming** (``--samples``, ``--size``, ``--shard-size``). The datasets as
shardfeed tar shards, served by ``shardfeed serve``, and as Streaming's MDS shards (a column
``stream`` beside ``index``, ``bin`` and ``cls``), each loader through ``DataLoader``, batch 64,
4 workers, for two epochs: the first cold (a fresh service cache; empty local directories), the
second warm.

    streaming          StreamingDataset(streams=[Stream(remote=..., local=..., proportion=w), ...],
                       shuffle=True, batch_size=64)
    shardfeed-samples  ShardfeedIterableDataset(url, streams=[Stream(name, weight=w), ...], batch_size=64)
                       through ShardfeedLoader: lists of sample dicts of ``bytes``
    shardfeed-tensors  the same with output="tensors": one ``Batch`` a batch

Each loader's round runs in a fresh process, the loaders in turn (the order reversed every
other round, ``--rounds``); the medians of samples/s are printed with the ratios to Streaming
(issue 41's target: 1.5x cold and warm), and each loader's per-stream counts.

**A mixture four times the cache** (``--cache-samples``, ``--cache-shard-size``,
``--cache-share``). Three more datasets of the same shape and a single dataset of as many
samples as the three; a service whose block cache is ``--cache-share`` of the mixture's shard
bytes (``--memory-cache 0``). The plain iterable recipe, ``ShardfeedIterableDataset(url,
streams=..., batch_size=64)`` through ``ShardfeedLoader`` with its default shuffle, reads two
epochs, then the single dataset the same way on a fresh service. Per epoch: the bytes the
service read from S3 (``shardfeed_store_bytes_total``) per byte of the datasets' shards, and per
byte of the samples the epoch read, each once (by weight, an epoch reads only part of the big
dataset: the fairer unit), target 1.2x at most; and samples/s, the mixture's against the single
dataset's (target: 0.9x at least).

**Checks.** The training process reads every byte of every sample once: an xxh3 of each
seeded member is made before the clock starts (``common.Digests``), and a sample's stream and
index name the bytes it must hold (for shardfeed its key too). Each shardfeed epoch must hold
every stream's count exactly as ``client/mixing.py`` documents it (the epoch split by weight,
remainders by largest remainder), in whole passes over the stream's dataset; Streaming's counts
are printed beside. A wrong byte or count ends the run with exit status 1; a Streaming round
that fails otherwise is printed and left out of the medians.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
from torch.utils.data import DataLoader

from shardfeed.benchmarks.common import Digests, WrongBytes, benchmark_parser, load_note, seed_by_cli, table
from shardfeed.benchmarks.loaders import (
    BATCH,
    LOADER_WORKERS,
    _collate,
    _quiet,
    chosen_loaders,
    import_streaming,
    in_fresh_process,
    paired_ratios,
    peer_round,
    streaming_dataset,
    write_mds,
)
from shardfeed.client.mixing import Stream
from shardfeed.client.tensors import Batch
from shardfeed.client.torch import ShardfeedIterableDataset, ShardfeedLoader
from shardfeed.process import scrape_metrics, start_service
from shardfeed.s3server import S3_SERVERS, S3Server, default_server, start_s3
from shardfeed.seeds.synthetic import parse_sizes
from shardfeed.sizes import parse_size

FIELDS = ("bin", "cls")
LOADERS = ("streaming", "shardfeed-samples", "shardfeed-tensors")
OUTPUTS = {"shardfeed-samples": "samples", "shardfeed-tensors": "tensors"}
"""Each shardfeed loader's ``output``."""
COLD_WARM = ("cold", "warm")


class WrongCount(AssertionError):
    """An epoch held other per-stream counts than the mixture documents: the run's figures count nothing."""


@dataclass(frozen=True)
class Seeded:
    """One dataset of the run: its name on the service, the seed of its bytes, its samples, where
    its tar shards lie and (for Streaming) its MDS shards."""

    name: str
    seed: int
    samples: int
    url: str
    mds: str = ""


@dataclass
class Epoch:
    """One epoch as a loader read it: samples/s, seconds to its first batch, each stream's indices
    in the order read, and (metered) the bytes the service read from S3 meanwhile."""

    rate: float
    first: float
    seen: list[list[int]]
    store_bytes: float | None = None

    @property
    def counts(self) -> list[int]:
        return [len(s) for s in self.seen]


# -- the datasets and what an epoch must hold ---------------------------------------------------

def stream_samples(total: int, streams: int, big: int) -> list[int]:
    """Each stream's samples, the first ``big`` times each other's, ``total`` in all at most: as
    many as make the epoch (their sum) whole batches."""
    parts = big + streams - 1
    unit = BATCH // math.gcd(parts, BATCH)
    small = total // parts // unit * unit
    return [big * small] + [small] * (streams - 1)


def documented_counts(weights: Sequence[float], total: int) -> list[int]:
    """Each stream's samples in an epoch of ``total``, as ``client/mixing.py`` documents them:
    ``total`` split by weight, the remainders by largest remainder, ties to the earlier stream
    (worked out here apart from the client's code, which it checks)."""
    exact = [w / sum(weights) * total for w in weights]
    counts = [math.floor(x) for x in exact]
    for s in sorted(range(len(counts)), key=lambda s: counts[s] - exact[s])[:total - sum(counts)]:
        counts[s] += 1
    return counts


def check_counts(kind: str, epochs: Sequence[Epoch], datasets: Sequence[Seeded], expected: Sequence[int]) -> None:
    """``WrongCount`` unless every epoch holds each stream's ``expected`` count, in whole passes
    over its dataset (each sample ``count // samples`` or one more times)."""
    for when, epoch in zip(COLD_WARM, epochs):
        for d, seen, count in zip(datasets, epoch.seen, expected):
            if len(seen) != count:
                raise WrongCount(f"{kind}, {when} epoch: stream {d.name!r} gave {len(seen)} samples, "
                                 f"the mixture's count is {count}")
            times = np.bincount(np.asarray(seen, dtype=np.int64), minlength=d.samples)
            if times.min() < count // d.samples or times.max() > -(-count // d.samples):
                raise WrongCount(f"{kind}, {when} epoch: stream {d.name!r} gave some samples {times.max()} times, "
                                 f"others {times.min()}: not whole passes over its {d.samples}")


def seed_datasets(server: S3Server, prefix: str, names: Sequence[str], samples: Sequence[int], size: str,
                  shard_size: str, first_seed: int) -> list[Seeded]:
    """``shardfeed seed`` each dataset at ``s3://bench/<prefix>/<name>``, its seed the next from ``first_seed``."""
    datasets = [Seeded(name, first_seed + k, n, f"s3://bench/{prefix}/{name}")
                for k, (name, n) in enumerate(zip(names, samples))]
    for d in datasets:
        seed_by_cli(d.url, d.samples, size, shard_size=shard_size, fields=FIELDS, seed=d.seed, env=server.env())
    return datasets


def shard_bytes(server: S3Server, url: str) -> int:
    """The bytes of the tar shards at ``url``."""
    bucket, _, prefix = url.removeprefix("s3://").partition("/")
    pages = server.client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=f"{prefix}/")
    return sum(o["Size"] for page in pages for o in page.get("Contents", []) if o["Key"].endswith(".tar"))


# -- one epoch, every byte checked ------------------------------------------------------------

def rows(batch, names: Sequence[str]) -> Iterator[tuple[int, int, Mapping]]:
    """Each sample of a batch as (its stream's number, its index, a mapping of its fields' bytes,
    and ``__key__`` where the loader gives one): a tensor batch's fields as slices of its buffer
    (a torch view per sample costs more than reading its 10 KiB)."""
    if isinstance(batch, Batch):
        buffer = memoryview(batch.buffer.numpy())
        views = {f: [buffer[o:o + n] for o, n in zip(batch[f].offsets.tolist(), batch[f].lengths.tolist())]
                 for f in FIELDS}
        for n, (s, i, key) in enumerate(zip(batch.streams.tolist(), batch.indices.tolist(), batch.keys)):
            yield s, i, {"__key__": key, **{f: views[f][n] for f in FIELDS}}
        return
    for sample in batch:
        if "__index__" in sample:  # shardfeed's: a mixture's names its stream
            yield names.index(sample["__stream__"]) if len(names) > 1 else 0, int(sample["__index__"]), sample
        else:  # Streaming's: its MDS columns
            yield int(sample["stream"]), int(sample["index"]), sample


def run_epoch(loader, digests: Sequence[Digests], names: Sequence[str], keyed: bool,
              metered: str | None = None) -> Epoch:
    """One epoch of ``loader``, each sample checked against its stream's digests (its key too,
    ``keyed``); with ``metered``, a service's URL, the S3 bytes it read meanwhile."""
    seen: list[list[int]] = [[] for _ in digests]
    before = scrape_metrics(metered)["shardfeed_store_bytes_total"] if metered else None
    began, first = time.perf_counter(), 0.0
    for batch in loader:
        first = first or time.perf_counter() - began
        for s, i, sample in rows(batch, names):
            if not 0 <= i < digests[s].samples:
                raise WrongBytes(f"stream {names[s]!r}: index {i}, outside its {digests[s].samples} samples")
            if keyed:
                digests[s].check_sample(i, sample)
            else:
                for field in FIELDS:
                    digests[s].check(i, field, sample[field])
            seen[s].append(i)
    rate = sum(map(len, seen)) / (time.perf_counter() - began)
    read = scrape_metrics(metered)["shardfeed_store_bytes_total"] - before if metered else None
    return Epoch(rate, first, seen, read)


def _digests(datasets: Sequence[Seeded], sizes: tuple[int, int]) -> list[Digests]:
    return [Digests(d.samples, sizes, FIELDS, d.seed) for d in datasets]


def streaming_round(datasets: Sequence[Seeded], weights: Sequence[float], local: str, sizes: tuple[int, int],
                    seed: int) -> list[Epoch]:
    """Streaming's mixture, a cold epoch then a warm one, in a fresh process."""
    _quiet()
    digests, streaming = _digests(datasets, sizes), import_streaming()
    streams = [streaming.Stream(remote=d.mds, local=f"{local}/{d.name}", proportion=w)
               for d, w in zip(datasets, weights)]
    dataset = streaming_dataset(streaming, clean=True, streams=streams, shuffle=True, shuffle_seed=seed,
                                batch_size=BATCH)
    loader = DataLoader(dataset, batch_size=BATCH, num_workers=LOADER_WORKERS, collate_fn=_collate)
    names = [d.name for d in datasets]
    return [run_epoch(loader, digests, names, keyed=False) for _ in COLD_WARM]


def shardfeed_round(url: str, datasets: Sequence[Seeded], weights: Sequence[float] | None, output: str,
                    sizes: tuple[int, int], seed: int, metered: bool = False) -> list[Epoch]:
    """Two epochs of ``ShardfeedIterableDataset`` through ``ShardfeedLoader``, in a fresh process:
    the mixture of ``datasets`` by ``weights``, or (``None``) the one dataset alone."""
    _quiet()
    digests = _digests(datasets, sizes)
    if weights is None:
        (single,) = datasets
        dataset = ShardfeedIterableDataset(url, single.name, batch_size=BATCH, seed=seed, output=output,
                                           collate_fn=None)
    else:
        dataset = ShardfeedIterableDataset(url, streams=[Stream(d.name, weight=w) for d, w in zip(datasets, weights)],
                                           batch_size=BATCH, seed=seed, output=output, collate_fn=None)
    loader = ShardfeedLoader(dataset, num_workers=LOADER_WORKERS)
    names = [d.name for d in datasets]
    return [run_epoch(loader, digests, names, keyed=True, metered=url if metered else None) for _ in COLD_WARM]


# -- the two parts ------------------------------------------------------------------------------

def side_by_side(args, server: S3Server, kinds: list[str], streaming, tmp: Path) -> None:
    """Part 1: each loader's rounds on the same mixture; the medians, the ratios and the counts."""
    sizes, weights = parse_sizes(args.size), args.weights
    names = [chr(ord("a") + k) for k in range(len(weights))]
    datasets = seed_datasets(server, "peers", names, stream_samples(args.samples, len(weights), args.big),
                             args.size, args.shard_size, first_seed=1)
    if streaming is not None:
        datasets = [replace(d, mds=write_mds(streaming, server, d.samples, sizes, parse_size(args.shard_size), tmp,
                                             seed=d.seed, url=f"s3://bench/peers-mds/{d.name}", stream=k))
                    for k, d in enumerate(datasets)]
    total = sum(d.samples for d in datasets)
    expected = documented_counts(weights, total)
    streams = ", ".join(f"{d.name} ({d.samples} samples, weight {w:g})" for d, w in zip(datasets, weights))
    print(f"\nmixture of {streams}"
          f": {total} x {args.size} samples an epoch, {args.shard_size} shards, {server.kind} S3; "
          f"DataLoader(batch_size={BATCH}, num_workers={LOADER_WORKERS}); shardfeed serve --workers "
          f"{args.service_workers}", flush=True)
    results: dict[str, list[list[Epoch] | None]] = {k: [] for k in kinds}
    for r in range(args.rounds):
        for kind in kinds if r % 2 == 0 else kinds[::-1]:
            scratch = tmp / f"{kind}-{r}"  # Streaming's local directories, or the service's cache
            if kind == "streaming":
                epochs = peer_round(f"round {r + 1} {kind:18s}", streaming_round, datasets, weights, str(scratch),
                                    sizes, r)
            else:
                with start_service({d.name: d.url for d in datasets}, cache_dir=scratch, env=server.env(),
                                   workers=args.service_workers) as svc:
                    epochs = in_fresh_process(shardfeed_round, svc.url, datasets, weights, OUTPUTS[kind], sizes, r)
                check_counts(kind, epochs, datasets, expected)
            shutil.rmtree(scratch, ignore_errors=True)
            results[kind].append(epochs)
            if epochs is not None:
                print(f"round {r + 1} {kind:18s} " + "   ".join(
                    f"{when} {e.rate:8.0f} samples/s, {'/'.join(map(str, e.counts))}"
                    for when, e in zip(COLD_WARM, epochs)), flush=True)
    print_side_by_side(results, names, expected)


def print_side_by_side(results: dict[str, list[list[Epoch] | None]], names: Sequence[str],
                       expected: Sequence[int]) -> None:
    """Part 1's tables: the medians and ratios to Streaming, each loader's counts, the target."""
    done = {k: [r for r in v if r is not None] for k, v in results.items()}
    done = {k: v for k, v in done.items() if v}  # a loader with no round left has no median
    medians = {k: [statistics.median(r[e].rate for r in v) for e in range(len(COLD_WARM))] for k, v in done.items()}
    base = medians.get("streaming")
    print(f"\nsamples/s, medians of {max(map(len, results.values()))} rounds; ratios to Streaming of the medians "
          "and per round (median, range):")
    print(table(["loader", "cold", "warm", "first batch (s)", "x Streaming cold / warm", "per round"],
                [(kind, f"{cold:,.0f}", f"{warm:,.0f}",
                  " / ".join(f"{statistics.median(r[e].first for r in done[kind]):.2f}" for e in range(2)),
                  f"{cold / base[0]:.2f}x / {warm / base[1]:.2f}x" if base and kind != "streaming" else "",
                  paired_ratios(results[kind], results["streaming"]) if base and kind != "streaming" else "")
                 for kind, (cold, warm) in medians.items()]))
    print("\nsamples of each stream per epoch (round 1 of each loader; shardfeed's checked equal to the "
          "documented counts in every epoch of every round):")
    counts = [(kind, when, *e.counts, sum(e.counts)) for kind, rounds in done.items()
              for when, e in zip(COLD_WARM, rounds[0])]
    print(table(["loader", "epoch", *names, "total"],
                [*counts, ("documented (client/mixing.py)", "each", *expected, sum(expected))]))
    if base:
        for kind, (cold, warm) in medians.items():
            if kind != "streaming":
                met = "met" if min(cold / base[0], warm / base[1]) >= 1.5 else "missed"
                print(f"target: {kind} >= 1.5x Streaming cold and warm: {met}")


def through_small_cache(args, server: S3Server, tmp: Path) -> None:
    """Part 2: the mixture and a single dataset as large, each through a cache a quarter of it."""
    sizes, weights = parse_sizes(args.size), args.weights
    names = [chr(ord("a") + k) for k in range(len(weights))]
    datasets = seed_datasets(server, "cache", names, stream_samples(args.cache_samples, len(weights), args.big),
                             args.size, args.cache_shard_size, first_seed=len(weights) + 1)
    total = sum(d.samples for d in datasets)
    (single,) = seed_datasets(server, "cache", ["single"], [total], args.size, args.cache_shard_size,
                              first_seed=2 * len(weights) + 1)
    read = {"mixture": (datasets, weights, documented_counts(weights, total)), "single": ([single], None, [total])}
    shards = {d.name: shard_bytes(server, d.url) for d in [*datasets, single]}
    cache = max(1 << 20, int(args.cache_share * sum(shards[d.name] for d in datasets)))
    print(f"\na mixture of {'/'.join(str(d.samples) for d in datasets)} samples "
          f"({sum(shards[d.name] for d in datasets) / 2**20:.1f} MiB of {args.cache_shard_size} shards) against one "
          f"dataset of {total} ({shards['single'] / 2**20:.1f} MiB); block cache {cache / 2**20:.1f} MiB, "
          f"--memory-cache 0; ShardfeedLoader(num_workers={LOADER_WORKERS}), default shuffle", flush=True)
    results: dict[str, list[list[Epoch]]] = {k: [] for k in read}
    for r in range(args.rounds):
        for reader in list(read) if r % 2 == 0 else list(read)[::-1]:
            parts, weighed, expected = read[reader]
            with start_service({d.name: d.url for d in [*datasets, single]}, cache_dir=tmp / f"cache-{reader}-{r}",
                               cache_size=str(cache), env=server.env(), workers=args.service_workers,
                               args=["--memory-cache", "0"]) as svc:
                epochs = in_fresh_process(shardfeed_round, svc.url, parts, weighed, "samples", sizes, r, True)
            shutil.rmtree(tmp / f"cache-{reader}-{r}", ignore_errors=True)
            check_counts(reader, epochs, parts, expected)
            results[reader].append(epochs)
            print(f"round {r + 1} {reader:8s} " + "   ".join(
                f"{when} {e.rate:8.0f} samples/s, S3 {e.store_bytes / _held(e, parts, shards, False):.2f}x its "
                f"shards, {e.store_bytes / _held(e, parts, shards, True):.2f}x its samples read"
                for when, e in zip(COLD_WARM, epochs)), flush=True)
    print_small_cache(results, {k: v[0] for k, v in read.items()}, shards, args.cache_share)


def _held(epoch: Epoch, datasets: Sequence[Seeded], shards: Mapping[str, int], distinct: bool) -> float:
    """The bytes of the datasets' shards, or (``distinct``) the part of them that the samples the
    epoch read hold, each sample once (synthetic samples of one size: a sample's share of its
    dataset's shards is one over its samples)."""
    return sum(shards[d.name] * (len(set(seen)) / d.samples if distinct else 1)
               for d, seen in zip(datasets, epoch.seen))


def print_small_cache(results: dict[str, list[list[Epoch]]], datasets: Mapping[str, Sequence[Seeded]],
                      shards: Mapping[str, int], cache_share: float) -> None:
    """Part 2's table (medians) and its two targets."""
    rate = {k: [statistics.median(r[e].rate for r in v) for e in range(2)] for k, v in results.items()}
    share = {(k, distinct): [statistics.median(r[e].store_bytes / _held(r[e], datasets[k], shards, distinct)
                                               for r in v) for e in range(2)]
             for k, v in results.items() for distinct in (False, True)}
    print(f"\nthrough a cache of {cache_share:g} of the mixture's shards, medians of "
          f"{len(results['mixture'])} rounds:")
    print(table(["reader", "epoch", "S3 bytes / its shards'", "S3 bytes / its samples read", "samples/s",
                 "x the single dataset"],
                [(reader, when, f"{share[reader, False][e]:.2f}", f"{share[reader, True][e]:.2f}",
                  f"{rate[reader][e]:,.0f}",
                  f"{rate[reader][e] / rate['single'][e]:.2f}x" if reader == "mixture" else "")
                 for reader in results for e, when in enumerate(COLD_WARM)]))
    print(f"target: the mixture's S3 bytes <= 1.2x its bytes every epoch: "
          f"{'met' if max(share['mixture', False]) <= 1.2 else 'missed'} against its shards, "
          f"{'met' if max(share['mixture', True]) <= 1.2 else 'missed'} against its samples read")
    print(f"target: the mixture >= 0.9x the single dataset's samples/s every epoch: "
          f"{'met' if min(m / s for m, s in zip(rate['mixture'], rate['single'])) >= 0.9 else 'missed'}")


def checked_runs(prog: str, s3: str, runs: Callable[[S3Server, Path], None],
                 failed_checks: tuple[type[Exception], ...] = (WrongBytes,)) -> int:
    """``runs(server, tmp)`` on an S3 server ``s3`` with a bucket ``bench`` (``bucket_on``) and a
    temporary directory; the exit status: 1 with the failed check printed, else 0 after the
    machine's load (the figures' context)."""
    try:
        with bucket_on(s3) as server, tempfile.TemporaryDirectory() as tmp:
            runs(server, Path(tmp))
    except failed_checks as err:
        print(f"{prog}: {type(err).__name__}: {err}", file=sys.stderr)
        return 1
    print(load_note())
    return 0


@contextmanager
def bucket_on(kind: str) -> Iterator[S3Server]:
    """An S3 server ``kind`` with a bucket ``bench``, its settings in this process's environment
    (Streaming's and the spawned rounds' too); stopped on exit."""
    server = start_s3(kind)
    try:
        server.create_bucket("bench")
        os.environ.update(server.env())
        os.environ["S3_ENDPOINT_URL"] = server.endpoint  # Streaming's name for a custom endpoint
        yield server
    finally:
        server.stop()


def stream_weights(text: str) -> list[float]:
    """``--weights``: 2 to 26 positive numbers, comma-separated."""
    try:
        weights = [float(w) for w in text.split(",")]
    except ValueError:
        weights = []
    if not 2 <= len(weights) <= 26 or not all(math.isfinite(w) and w > 0 for w in weights):
        raise argparse.ArgumentTypeError(f"2 to 26 positive numbers, comma-separated, not {text!r}")
    return weights


def main(argv=None) -> int:
    parser = benchmark_parser(__doc__, __spec__.name)
    parser.add_argument("--samples", type=int, default=6144,
                        help="samples of the side-by-side mixture, all streams (0: leave that part out)")
    parser.add_argument("--size", default="10KiB", help="each sample's bin (default: %(default)s)")
    parser.add_argument("--shard-size", default="4MiB", help="side by side: the shards' size (default: %(default)s)")
    parser.add_argument("--weights", type=stream_weights, default=[0.5, 0.3, 0.2],
                        help="the streams' weights, comma-separated, the first the big stream's (default: 0.5,0.3,0.2)")
    parser.add_argument("--big", type=int, default=10, help="the first stream's size, in the others' (default: 10)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--loaders", default=",".join(LOADERS), help=f"some of {', '.join(LOADERS)}")
    parser.add_argument("--cache-samples", type=int, default=12288,
                        help="samples of the mixture read through a small cache (0: leave that part out)")
    parser.add_argument("--cache-shard-size", default="1MiB", help="its shards' size (default: %(default)s)")
    parser.add_argument("--cache-share", type=float, default=0.25,
                        help="the block cache, as a share of that mixture's shards (default: %(default)s)")
    parser.add_argument("--s3", choices=S3_SERVERS, default=default_server(),
                        help="the S3 server to start on loopback (default here: %(default)s)")
    parser.add_argument("--service-workers", type=int, default=len(os.sched_getaffinity(0)),
                        help="shardfeed serve --workers (default: the usable cores)")
    args = parser.parse_args(argv)
    kinds, streaming = chosen_loaders(parser, args.loaders, LOADERS)
    for flag, samples in (("--samples", args.samples), ("--cache-samples", args.cache_samples)):
        if samples and not stream_samples(samples, len(args.weights), args.big)[-1]:
            parser.error(f"{flag} {samples}: too few for {len(args.weights)} streams, the first {args.big}x the "
                         f"others', in whole batches of {BATCH}")
    if args.rounds < 1 or args.big < 1:
        parser.error("--rounds and --big must be at least 1")
    _quiet()

    def runs(server: S3Server, tmp: Path) -> None:
        if args.samples:
            side_by_side(args, server, kinds, streaming, tmp)
        if args.cache_samples:
            through_small_cache(args, server, tmp)

    return checked_runs(parser.prog, args.s3, runs, (WrongBytes, WrongCount))


if __name__ == "__main__":
    raise SystemExit(main())
