"""DataLoader epochs on one node: shardfeed against MosaicML Streaming, over the same S3.

The loader a user would otherwise pick, tried as a new user would: the same samples
(``bin`` bytes and a ``cls`` label) on one S3 server (moto on loopback), as shardfeed
shards for ``shardfeed serve`` and as Streaming's MDS shards. Each loader runs
``DataLoader(batch_size=64, num_workers=4)``, shuffled, for two epochs: the first on
cold caches (a fresh service cache; a fresh Streaming local directory), the second warm.
Rounds alternate the loaders; the medians are printed with the shardfeed/Streaming
ratios. Every batch is checked: each sample's ``bin`` is compared with the bytes seeded.

    python -m shardfeed.benchmarks.loaders --samples 20000 --size 10KiB --rounds 5

Streaming is optional (``pip install mosaicml-streaming``, then ``pip uninstall -y
torchvision``: the PyPI torchvision wheels need CUDA torch). Without it, shardfeed alone
is measured and the script says so.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.machinery
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time
import types
import warnings
from pathlib import Path

from torch.utils.data import DataLoader

from shardfeed.benchmarks.s3server import start_moto
from shardfeed.client.torch import ShardfeedDataset, ShardfeedIterableDataset, ShardfeedLoader
from shardfeed.seeds.synthetic import member_bytes, parse_sizes
from shardfeed.service.process import start_service
from shardfeed.service.sizes import parse_size

BATCH, LOADER_WORKERS = 64, 4


class _StandIn(types.ModuleType):
    """An empty torchvision module: any name in it is a placeholder class."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return type(name, (), {})


def import_streaming() -> types.ModuleType | None:
    """MosaicML Streaming, or ``None`` when it is not installed.

    Streaming imports its torchvision datasets at import time, and no torchvision wheel
    works with the CPU torch build: an empty stand-in is enough, since no vision code runs.
    """
    if importlib.util.find_spec("streaming") is None:
        return None
    if importlib.util.find_spec("torchvision") is None:
        for name in ("torchvision", "torchvision.datasets", "torchvision.transforms",
                     "torchvision.transforms.functional"):
            module = sys.modules[name] = _StandIn(name)
            module.__spec__ = importlib.machinery.ModuleSpec(name, None)
    return importlib.import_module("streaming")


def _collate(samples: list) -> list:
    return samples


def _check(batch: list, seed_sizes: tuple[int, int], key: str) -> int:
    for sample in batch:
        i = int(sample[key])
        assert bytes(sample["bin"]) == member_bytes(0, i, "bin", seed_sizes), f"sample {i}: wrong bytes"
    return len(batch)


def _epochs(loader, sizes, key: str, epochs: int = 2) -> list[float]:
    """Samples/s of each epoch, every sample checked."""
    rates = []
    for _ in range(epochs):
        began, n = time.perf_counter(), 0
        for batch in loader:
            n += _check(batch, sizes, key)
        rates.append(n / (time.perf_counter() - began))
    return rates


def shardfeed_round(kind: str, url: str, sizes, seed: int) -> list[float]:
    if kind == "shardfeed-map":
        loader = DataLoader(ShardfeedDataset(url, "bench"), batch_size=BATCH, shuffle=True,
                            num_workers=LOADER_WORKERS, collate_fn=_collate, persistent_workers=False)
        return _epochs(loader, sizes, "__index__")
    dataset = ShardfeedIterableDataset(url, "bench", batch_size=BATCH, seed=seed, collate_fn=None)
    return _epochs(ShardfeedLoader(dataset, num_workers=LOADER_WORKERS), sizes, "__index__")


def streaming_round(streaming, remote: str, local: Path, sizes, seed: int) -> list[float]:
    streaming.base.util.clean_stale_shared_memory()
    dataset = streaming.StreamingDataset(remote=remote, local=str(local), shuffle=True, shuffle_seed=seed,
                                         batch_size=BATCH)
    loader = DataLoader(dataset, batch_size=BATCH, num_workers=LOADER_WORKERS, collate_fn=_collate)
    return _epochs(loader, sizes, "index")


def write_mds(streaming, moto, samples: int, sizes, shard_size: int, tmp: Path) -> str:
    out = tmp / "mds"
    with streaming.MDSWriter(out=str(out), columns={"index": "int", "bin": "bytes", "cls": "bytes"},
                             size_limit=shard_size) as writer:
        for i in range(samples):
            writer.write({"index": i, "bin": member_bytes(0, i, "bin", sizes), "cls": member_bytes(0, i, "cls", sizes)})
    s3 = moto.client()
    for path in out.iterdir():
        s3.upload_file(str(path), "bench", f"mds/{path.name}")
    return "s3://bench/mds"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=20000)
    parser.add_argument("--size", default="10KiB")
    parser.add_argument("--shard-size", default="4MiB")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--service-workers", type=int, default=len(os.sched_getaffinity(0)),
                        help="shardfeed serve --workers (default: the usable cores)")
    args = parser.parse_args(argv)
    # 4 DataLoader workers on fewer cores is the setting compared, not a mistake to warn about.
    warnings.filterwarnings("ignore", message="This DataLoader will create")
    sizes = parse_sizes(args.size)
    shard_size = parse_size(args.shard_size)

    streaming = import_streaming()
    if streaming is None:
        print("MosaicML Streaming is not installed (pip install mosaicml-streaming): measuring shardfeed alone")
    moto = start_moto()
    with tempfile.TemporaryDirectory() as tmp_name, contextlib.ExitStack() as stack:
        stack.callback(moto.stop)
        tmp = Path(tmp_name)
        moto.create_bucket("bench")
        env = {**os.environ, **moto.env()}
        os.environ.update(moto.env())
        os.environ["S3_ENDPOINT_URL"] = moto.endpoint  # Streaming's name for a custom endpoint
        subprocess.run([sys.executable, "-m", "shardfeed", "-q", "seed", "s3://bench/data", "--samples",
                        str(args.samples), "--size", args.size, "--shard-size", args.shard_size,
                        "--fields", "bin,cls"], check=True, env=env)
        remote = write_mds(streaming, moto, args.samples, sizes, shard_size, tmp) if streaming else None
        kinds = ["shardfeed-map", "shardfeed-iterable"] + (["streaming"] if streaming else [])
        results: dict[str, list[list[float]]] = {k: [] for k in kinds}
        for r in range(args.rounds):
            for kind in (kinds if r % 2 == 0 else kinds[::-1]):
                if kind == "streaming":
                    rates = streaming_round(streaming, remote, tmp / f"local-{r}", sizes, seed=r)
                else:
                    with start_service({"bench": "s3://bench/data"}, cache_dir=tmp / f"cache-{kind}-{r}",
                                       env=moto.env(), workers=args.service_workers) as svc:
                        rates = shardfeed_round(kind, svc.url, sizes, seed=r)
                results[kind].append(rates)
                print(f"round {r + 1} {kind:20s} cold {rates[0]:8.0f}  warm {rates[1]:8.0f} samples/s", flush=True)
    print(f"\n{args.samples} x {args.size} samples, DataLoader(batch_size={BATCH}, num_workers={LOADER_WORKERS}), "
          f"shuffled, medians of {args.rounds} rounds; shardfeed serve --workers {args.service_workers}; "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    medians = {k: [statistics.median(r[e] for r in v) for e in range(2)] for k, v in results.items()}
    for kind, (cold, warm) in medians.items():
        ratio = ""
        if "streaming" in medians and kind != "streaming":
            base = medians["streaming"]
            ratio = f"   {cold / base[0]:.2f}x / {warm / base[1]:.2f}x Streaming"
        print(f"{kind:20s} cold {cold:8.0f}  warm {warm:8.0f} samples/s{ratio}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
