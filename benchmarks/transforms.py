"""Transforms in the service (issue 44): the stock ImageNet transform run by the service, in the
DataLoader workers, and in Streaming's, side by side.

    python -m shardfeed.benchmarks.transforms --samples 20000 --rounds 3     # the issue's run

``--samples`` synthetic JPEGs of ImageNet's sizes (``seed --jpegs``: about 500 x 375, 20-250 KiB)
on one S3 server on loopback (SeaweedFS, or moto with ``--s3 moto``), as shardfeed tar shards
and, for Streaming, the same samples as MDS shards (``index``, ``jpg``, ``cls``). Each loader is
``DataLoader(batch_size=64, num_workers=4)`` of the stock ``imagenet_train`` (decode, resize to a
short side of 256, random-resized-crop to 224 x 224 + flip, uint8 CHW, and its label), for two
epochs: the first cold (a fresh service cache, an empty Streaming directory), the second warm.

    service    ShardfeedDataset(url, "bench", transform="imagenet_train") + ShardfeedSampler(seed=S),
               against serve --transform imagenet_train=shardfeed.transforms.image:imagenet_train:
               the service's pool runs it; warm, prepare's output comes from its prepared cache,
               so only the crop and flip run
    standard   ShardfeedDataset(url, "bench", transform=imagenet_train()) + the same sampler: the
               service hands bytes, the DataLoader workers run prepare and augment (the standard
               recipe; the same tensors as the service's, byte for byte)
    streaming  a StreamingDataset over the MDS shards whose ``__getitem__`` runs prepare and
               augment for its sample, default-collated to (64, 3, 224, 224) uint8 and labels

Each loader's round runs in a fresh process, the loaders in turn (the order reversed every
other round, ``--rounds``); the medians of samples/s are printed with the ratios service /
standard and service / Streaming (of the medians, and per round), against the issue's targets:
warm >= 2.5x both, cold >= 1x the standard recipe. Beside them, CPU per sample: the training
process tree's (the main process and its DataLoader workers, from ``getrusage``; target for the
service <= 0.2x the standard recipe's) and the service's (its processes and the pool's, from
/proc), and the prepared cache's hit ratio over the warm epoch (``GET /v1/stats``).

**Checks.** Every output byte is read once by the training process: each sample's image and
label are hashed (xxh3) and compared with the digest of ``apply(t, t.prepare(raw), seed, epoch,
index)`` for its own sample number, made before the clock by a pool of processes (``prepare``
once per sample, ``apply`` per epoch; the digests kept in the run's temporary directory for the
rounds' processes). Every loader uses the same rule, ``(seed, epoch, index)`` with the epoch
numbered 0 and 1, Streaming in its own order. Each epoch must hold every sample exactly once.
A wrong byte or count (a ``WrongBytes``) ends the run with exit status 1; a Streaming round that fails otherwise is
printed and left out of the medians.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import statistics
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np
from torch.utils.data import DataLoader
from xxhash import xxh3_64

from shardfeed.benchmarks.common import WrongBytes, benchmark_parser, seed_by_cli, table, upload
from shardfeed.benchmarks.loaders import (
    BATCH,
    LOADER_WORKERS,
    Epoch,
    _cpu,
    _quiet,
    chosen_loaders,
    import_streaming,
    in_fresh_process,
    paired_ratios,
    peer_round,
    streaming_dataset,
)
from shardfeed.benchmarks.mixture import COLD_WARM, checked_runs, shard_bytes
from shardfeed.client.tensors import Batch
from shardfeed.client.torch import ShardfeedDataset, ShardfeedSampler
from shardfeed.process import start_service
from shardfeed.s3server import S3_SERVERS, default_server
from shardfeed.seeds.jpegs import sample_jpeg, sample_label
from shardfeed.sizes import parse_size
from shardfeed.transforms import apply
from shardfeed.transforms.image import imagenet_train

NAME, SPEC = "imagenet_train", "shardfeed.transforms.image:imagenet_train"
"""The transform served, and its factory."""
LOADERS = ("service", "standard", "streaming")
DATA, MDS = "s3://bench/jpegs", "s3://bench/jpegs-mds"
"""Where the tar shards (``seed --jpegs``) and the MDS shards of the same samples lie."""


@dataclass
class Measured(Epoch):
    """A loader's epoch (``loaders.Epoch``: samples/s, CPU per sample by party, first batch) and,
    for the service, its prepared cache's hit ratio over the epoch."""

    prepared_hit_ratio: float | None = None


# -- the expected outputs, made before the clock -------------------------------------------------

def output_digest(image, label) -> int:
    """The xxh3 of a sample's outputs as the training process holds them: its image's bytes, then
    its label's (numpy arrays, or tensors' ``.numpy()`` views: read in place)."""
    digest = xxh3_64()
    digest.update(image)
    digest.update(label)
    return digest.intdigest()


def _expected(i: int, seed: int) -> tuple[bytes, bytes, list[int]]:
    """Sample ``i``'s raw fields and the digest of its outputs in each epoch: ``prepare`` once."""
    transform = imagenet_train()
    jpg, cls = sample_jpeg(0, i), str(sample_label(0, i)).encode()
    prepared = transform.prepare({"jpg": jpg, "cls": cls})
    return jpg, cls, [output_digest(**apply(transform, prepared, seed, epoch, i)) for epoch in range(len(COLD_WARM))]


def expected_digests(samples: int, seed: int, out: Path, mds=None) -> Path:
    """Each sample's expected output digest per epoch (``(samples, 2)`` uint64) saved at ``out``,
    made by a process per usable core; each raw sample also goes to ``mds`` (an ``MDSWriter``) if given."""
    digests, made = np.zeros((samples, len(COLD_WARM)), np.uint64), 0
    # Forked: the processes need only Pillow, numpy and the transform, not a fresh import of torch.
    with multiprocessing.get_context("fork").Pool(len(os.sched_getaffinity(0))) as pool:
        for jpg, cls, each in pool.imap(partial(_expected, seed=seed), range(samples), chunksize=16):
            digests[made], made = each, made + 1
            if mds is not None:
                mds.write({"index": made - 1, "jpg": jpg, "cls": cls})
    if made != samples:  # a StopIteration raised in a process ends the loop above as if all were made
        raise RuntimeError(f"the expected outputs stopped at sample {made} of {samples}")
    np.save(out, digests)
    return out


# -- one epoch, every output byte checked ---------------------------------------------------------

def rows(batch) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
    """Each sample of a batch as (its number, its image, its label), the arrays views of the
    batch: a shardfeed ``Batch`` (``batch.outputs``), or Streaming's default-collated dict."""
    if isinstance(batch, Batch):
        if batch.missing.any():
            raise WrongBytes(f"samples {batch.indices[batch.missing].tolist()[:5]} missing")
        outputs = batch.outputs
        indices, images, labels = batch.indices, outputs["image"], outputs["label"]
    else:
        indices, images, labels = batch["index"], batch["image"], batch["label"]
    for i, image, label in zip(indices.tolist(), images.numpy(), labels.numpy()):
        yield i, image, label


def run_epoch(kind: str, loader, expected: np.ndarray, epoch: int, service_pid: int | None = None) -> Measured:
    """One epoch of ``loader``: each sample's outputs against ``expected[i, epoch]``, each sample
    once; samples/s, CPU per sample (``loaders._cpu``) and the seconds to the first batch."""
    seen = np.zeros(len(expected), np.int64)
    cpu, began, first = _cpu(service_pid), time.perf_counter(), 0.0
    for batch in loader:
        first = first or time.perf_counter() - began
        for i, image, label in rows(batch):
            if not 0 <= i < len(expected):
                raise WrongBytes(f"{kind}: sample {i}, outside the {len(expected)} seeded")
            if output_digest(image, label) != int(expected[i, epoch]):
                raise WrongBytes(f"{kind}, {COLD_WARM[epoch]} epoch: sample {i}: other outputs than "
                                 f"apply(imagenet_train, prepare(sample), seed, {epoch}, {i})")
            seen[i] += 1
    rate = len(expected) / (time.perf_counter() - began)
    spent = _cpu(service_pid)
    if (seen != 1).any():
        raise WrongBytes(f"{kind}, {COLD_WARM[epoch]} epoch: {int((seen == 0).sum())} samples not read, "
                         f"{int((seen > 1).sum())} read more than once")
    return Measured(rate, {party: (spent[party] - cpu[party]) * 1e6 / len(expected) for party in cpu}, first)


def prepared_lookups(url: str, at_least: int, wait: float = 15.0) -> tuple[int, int]:
    """The service's prepared-cache hits and misses so far (``GET /v1/stats``, host-wide), once
    they count ``at_least`` lookups: its figures are a snapshot taken every second or so."""
    deadline = time.monotonic() + wait
    while True:
        with urllib.request.urlopen(f"{url}/v1/stats", timeout=10) as answer:
            served = json.load(answer)["transforms"]["served"][NAME]
        hits, misses = served["prepared_hits"], served["prepared_misses"]
        if hits + misses >= at_least or time.monotonic() > deadline:
            return hits, misses
        time.sleep(0.2)


# -- the rounds, each in a fresh process -----------------------------------------------------------

def shardfeed_round(kind: str, url: str, expected_path: str, seed: int, service_pid: int) -> list[Measured]:
    """Two epochs of the service's transform (``"service"``) or the standard recipe's."""
    _quiet()
    expected = np.load(expected_path)
    dataset = ShardfeedDataset(url, "bench", transform=NAME if kind == "service" else imagenet_train())
    sampler = ShardfeedSampler(dataset, seed=seed)
    loader = DataLoader(dataset, batch_size=BATCH, sampler=sampler, num_workers=LOADER_WORKERS)
    epochs, before = [], (0, 0)
    for epoch in range(len(COLD_WARM)):
        sampler.set_epoch(epoch)
        measured = run_epoch(kind, loader, expected, epoch, service_pid)
        if kind == "service":
            hits, misses = prepared_lookups(url, (epoch + 1) * len(expected))
            looked_up = hits + misses - sum(before)
            measured.prepared_hit_ratio = (hits - before[0]) / looked_up if looked_up else None
            before = hits, misses
        epochs.append(measured)
    return epochs


def transformed_mds(streaming) -> type:
    """A ``StreamingDataset`` whose samples are the stock transform's outputs for ``(seed, epoch,
    index)``: a Streaming user's way (its own vision datasets override ``get_item`` alike). Made
    here because Streaming is optional; the DataLoader's workers get it by ``fork``."""

    class TransformedMDS(streaming.StreamingDataset):
        def __init__(self, *, augment_seed: int, **options):
            super().__init__(**options)
            self.transform, self.augment_seed, self.augment_epoch = imagenet_train(), augment_seed, 0

        def __getitem__(self, at: int) -> dict:
            sample = super().__getitem__(at)
            prepared = self.transform.prepare({"jpg": sample["jpg"], "cls": sample["cls"]})
            outputs = apply(self.transform, prepared, self.augment_seed, self.augment_epoch, sample["index"])
            return {"index": sample["index"], **outputs}

    return TransformedMDS


def streaming_round(remote: str, local: str, expected_path: str, seed: int) -> list[Measured]:
    """Two epochs of Streaming with the transform in its ``__getitem__``."""
    _quiet()
    expected, streaming = np.load(expected_path), import_streaming()
    dataset = streaming_dataset(streaming, clean=True, kind=transformed_mds(streaming), augment_seed=seed,
                                remote=remote, local=local, shuffle=True, shuffle_seed=seed, batch_size=BATCH)
    loader = DataLoader(dataset, batch_size=BATCH, num_workers=LOADER_WORKERS)
    epochs = []
    for epoch in range(len(COLD_WARM)):
        dataset.augment_epoch = epoch  # the workers, started anew each epoch, copy it
        epochs.append(run_epoch("streaming", loader, expected, epoch))
    return epochs


# -- the run -----------------------------------------------------------------------------------------

def run(args, server, kinds: list[str], streaming, tmp: Path) -> dict[str, list[list[Measured] | None]]:
    """Seed, make the expected outputs (and the MDS shards), then every loader's rounds."""
    began = time.perf_counter()
    seed_by_cli(DATA, args.samples, jpegs=True, shard_size=args.shard_size, env=server.env())
    expected = tmp / "expected.npy"
    if streaming is not None:
        with streaming.MDSWriter(out=str(tmp / "mds"), columns={"index": "int", "jpg": "bytes", "cls": "bytes"},
                                 size_limit=parse_size(args.shard_size)) as writer:
            expected_digests(args.samples, args.seed, expected, writer)
        upload(server, tmp / "mds", MDS)
        shutil.rmtree(tmp / "mds")
    else:
        expected_digests(args.samples, args.seed, expected)
    serve = ["--transform", f"{NAME}={SPEC}", "--transform-processes", str(args.transform_processes)]
    print(f"{args.samples} synthetic JPEGs ({shard_bytes(server, DATA) / 2**20:.0f} MiB of {args.shard_size} tar "
          f"shards{', the same as MDS' if streaming else ''}) on {server.kind} S3, seeded and their outputs "
          f"computed in {time.perf_counter() - began:.0f} s; DataLoader(batch_size={BATCH}, "
          f"num_workers={LOADER_WORKERS}), {NAME} to 224 x 224 uint8, seed {args.seed}; shardfeed serve --workers "
          f"{args.service_workers} {' '.join(serve)}", flush=True)
    results: dict[str, list[list[Measured] | None]] = {k: [] for k in kinds}
    for r in range(args.rounds):
        for kind in kinds if r % 2 == 0 else kinds[::-1]:
            scratch = tmp / f"{kind}-{r}"  # the service's cache, or Streaming's local directory
            if kind == "streaming":
                epochs = peer_round(f"round {r + 1} {kind:9s}", streaming_round, MDS, str(scratch), str(expected),
                                    args.seed)
            else:
                with start_service({"bench": DATA}, cache_dir=scratch, env=server.env(),
                                   workers=args.service_workers, args=serve if kind == "service" else ()) as svc:
                    epochs = in_fresh_process(shardfeed_round, kind, svc.url, str(expected), args.seed,
                                              svc.process.pid)
            shutil.rmtree(scratch, ignore_errors=True)
            results[kind].append(epochs)
            if epochs is not None:
                print(f"round {r + 1} {kind:9s} " + "   ".join(
                    f"{when} {e.rate:6.0f} samples/s, CPU us/sample training {_training(e):5.0f} service "
                    f"{e.cpu['service']:5.0f}" + (f", prepared hits {e.prepared_hit_ratio:.0%}"
                                                    if e.prepared_hit_ratio is not None else "")
                    for when, e in zip(COLD_WARM, epochs)), flush=True)
    return results


def _training(epoch: Epoch) -> float:
    """The training process tree's CPU per sample: the main process and its DataLoader workers."""
    return epoch.cpu["main"] + epoch.cpu["workers"]


def report(results: dict[str, list[list[Measured] | None]]) -> None:
    """The medians, the ratios, CPU per sample, the prepared cache's hit ratio, the targets."""
    done = {k: [r for r in v if r is not None] for k, v in results.items()}
    done = {k: v for k, v in done.items() if v}  # a loader with no round left has no median

    def median(kind: str, figure) -> list[float]:
        return [statistics.median(figure(r[e]) for r in done[kind]) for e in range(len(COLD_WARM))]

    rate = {k: median(k, lambda e: e.rate) for k in done}
    training = {k: median(k, _training) for k in done}
    service = {k: median(k, lambda e: e.cpu["service"]) for k in done}

    def ratio(base: str) -> tuple[str, str]:
        if "service" not in rate or base not in rate:
            return "", ""
        return (" / ".join(f"{s / b:.2f}x" for s, b in zip(rate["service"], rate[base])),
                paired_ratios(results["service"], results[base]))

    print(f"\nsamples/s, medians of {max(map(len, results.values()))} rounds; CPU per sample (us, medians): the "
          "training process tree (main + DataLoader workers) and the service's (its processes and its pool's):")
    print(table(["loader", "cold", "warm", "first batch (s)", "training CPU cold / warm", "service CPU cold / warm"],
                [(kind, f"{rate[kind][0]:,.0f}", f"{rate[kind][1]:,.0f}",
                  " / ".join(f"{f:.2f}" for f in median(kind, lambda e: e.first)),
                  " / ".join(f"{c:,.0f}" for c in training[kind]),
                  " / ".join(f"{c:,.0f}" for c in service[kind]) if kind != "streaming" else "")
                 for kind in done]))
    print("\nservice / the others, cold / warm: of the medians, and per round (median, range):")
    print(table(["ratio", "samples/s", "per round", "training CPU per sample"],
                [(f"service / {base}", *ratio(base),
                  " / ".join(f"{s / b:.2f}x" for s, b in zip(training["service"], training[base])))
                 for base in ("standard", "streaming") if base in done and "service" in done]))
    if "service" in done:
        hits = [e.prepared_hit_ratio for r in done["service"] for e in r[1:]]
        print(f"prepared cache hit ratio over the warm epoch (GET /v1/stats): "
              f"{' '.join(f'{h:.1%}' for h in hits if h is not None)} (each round)")
    targets(rate, training)


def targets(rate: dict[str, list[float]], training: dict[str, list[float]]) -> None:
    """Issue 44's targets, met or missed, where both sides ran."""
    if "service" not in rate:
        return
    cold, warm = rate["service"]
    met = {True: "met", False: "missed"}
    for base, name in (("standard", "the standard recipe"), ("streaming", "Streaming")):
        if base in rate:
            print(f"target: service warm >= 2.5x {name}: {met[warm / rate[base][1] >= 2.5]} "
                  f"({warm / rate[base][1]:.2f}x)")
    if "standard" in rate:
        print(f"target: service cold >= 1x the standard recipe: {met[cold / rate['standard'][0] >= 1]} "
              f"({cold / rate['standard'][0]:.2f}x)")
        shares = [s / b for s, b in zip(training["service"], training["standard"])]
        print(f"target: training CPU per sample, service <= 0.2x the standard recipe's: "
              f"{met[max(shares) <= 0.2]} ({' cold, '.join(f'{s:.2f}x' for s in shares)} warm)")


def main(argv=None) -> int:
    parser = benchmark_parser(__doc__, __spec__.name)
    parser.add_argument("--samples", type=int, default=4000,
                        help="synthetic JPEGs (default: %(default)s, about 5 minutes here; the issue's run: 20000)")
    parser.add_argument("--shard-size", default="16MiB", help="tar and MDS shards (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0, help="the samplers' and the augmentation's seed")
    parser.add_argument("--loaders", default=",".join(LOADERS), help=f"some of {', '.join(LOADERS)}")
    parser.add_argument("--service-workers", type=int, default=len(os.sched_getaffinity(0)),
                        help="shardfeed serve --workers (default: the usable cores)")
    parser.add_argument("--transform-processes", type=int, default=len(os.sched_getaffinity(0)),
                        help="shardfeed serve --transform-processes, all workers together (default: the usable cores)")
    parser.add_argument("--s3", choices=S3_SERVERS, default=default_server(),
                        help="the S3 server to start on loopback (default here: %(default)s)")
    args = parser.parse_args(argv)
    if args.samples < 1 or args.rounds < 1 or args.seed < 0:
        parser.error("--samples and --rounds must be at least 1, --seed not negative")
    kinds, streaming = chosen_loaders(parser, args.loaders, LOADERS)
    _quiet()
    return checked_runs(parser.prog, args.s3, lambda server, tmp: report(run(args, server, kinds, streaming, tmp)))


if __name__ == "__main__":
    raise SystemExit(main())
