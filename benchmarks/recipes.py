"""The recipes users type, on a dataset larger than the cache: what one epoch reads from S3.

    python -m shardfeed.benchmarks.recipes [--samples 6000] [--size 10KiB] [--cache-share 0.25]
        [--shard-size 2MiB] [--latency-ms 0,300] [--configs defaults,memory-cache-0,...]

A synthetic dataset with two fields (``bin``, ``cls``) on moto's S3 server, written as a new
user writes shards: Python's ``tarfile``, a shard closed once it is past ``--shard-size``, so
each ends just past a block boundary, in a short last block (end-of-archive and the record
padding). The service (its defaults: RAM tier on, every core as workers; a block cache of
``--cache-share`` of the dataset's bytes) reads it through the counting proxy (``s3proxy.py``),
which adds ``--latency-ms`` to every S3 request (cloud S3's time to first byte; each latency
listed is a run of its own). Each recipe runs one epoch with ``DataLoader(num_workers=2)``, on
a fresh cache, every sample checked:

- ``iterable, plain``: ``ShardfeedIterableDataset(url, name, batch_size=64)`` in a plain
  ``DataLoader(ds, batch_size=None)``, every other argument its default;
- ``iterable, loader``: the same through ``ShardfeedLoader``;
- ``map + ShardfeedSampler``: ``DataLoader(ShardfeedDataset(url, name), batch_size=64,
  sampler=ShardfeedSampler(ds))``.

``--layout mds`` writes the same samples as MosaicML Streaming's MDS shards (``MDSWriter``), which
the service serves in place (issue 42): its records are read ahead whole, then their headers and
fields taken from them.

Each recipe runs in each of ``--configs`` (``CONFIGS``: the defaults, ``--memory-cache 0``,
one or two service workers, one field, read-ahead off). Printed per run: S3 bytes per dataset
byte (tar shards included), S3 requests per sample, the first batch's seconds (compare with
``read-ahead-off``: reading ahead must not delay it), plans held right after the epoch (one per
rank and epoch is right), samples/s. Targets (issues 25, 43): with reading ahead on, at most
``MAX_BYTES`` times the dataset's bytes and ``MAX_REQUESTS`` S3 requests per sample: a run past
either makes the exit status 1.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shlex
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import httpx
from torch.utils.data import DataLoader

from shardfeed.benchmarks.loaders import import_streaming, write_mds
from shardfeed.benchmarks.s3proxy import control, start_proxy_process
from shardfeed.client.torch import ShardfeedDataset, ShardfeedIterableDataset, ShardfeedLoader, ShardfeedSampler
from shardfeed.process import scrape_metrics, start_service, stop_process
from shardfeed.s3server import start_moto
from shardfeed.seeds.synthetic import member_bytes, parse_sizes, sample_key
from shardfeed.sizes import parse_size

FIELDS = ("bin", "cls")
MAX_BYTES = 1.2
"""S3 bytes read per dataset byte in an epoch, at most."""
MAX_REQUESTS = 1.05
"""S3 requests per sample in an epoch, at most."""


@dataclass(frozen=True)
class Config:
    """How the service runs and what the loader asks for; ``None`` workers: ``--service-workers``."""
    serve_args: tuple[str, ...] = ()
    workers: int | None = None
    fields: tuple[str, ...] = FIELDS
    limits: bool = True  # held to MAX_BYTES and MAX_REQUESTS (not without reading ahead)


CONFIGS = {
    "defaults": Config(),
    "memory-cache-0": Config(serve_args=("--memory-cache", "0")),
    "workers-1": Config(workers=1),
    "workers-2": Config(workers=2),
    "one-field": Config(fields=("bin",)),
    "read-ahead-off": Config(serve_args=("--plan-ahead", "0"), limits=False),
}


def _store_bytes(url: str) -> float:
    return scrape_metrics(url)["shardfeed_store_bytes_total"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m shardfeed.benchmarks.recipes", description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=6000)
    parser.add_argument("--size", default="10KiB")
    parser.add_argument("--shard-size", default="2MiB", help="tar shards are closed once past this size")
    parser.add_argument("--cache-share", type=float, default=0.25, help="the block cache, as a share of the dataset")
    parser.add_argument("--recipes", default="iterable-plain,iterable-loader,map-sampler")
    parser.add_argument("--configs", default="defaults", help=f"any of {', '.join(CONFIGS)}")
    parser.add_argument("--latency-ms", default="0,300", help="ms added to every S3 request, one run per value")
    parser.add_argument("--serve-args", default="", help="more `serve` flags for every run, e.g. '--plan-memory 0'")
    parser.add_argument("--service-workers", type=int, default=os.cpu_count() or 1,
                        help="serve --workers where a config names none (default: every core, as serve's own default)")
    parser.add_argument("--layout", choices=("tar", "mds"), default="tar",
                        help="the shards: tar (tarfile), or MDS (Streaming's MDSWriter), served in place")
    args = parser.parse_args(argv)
    configs = args.configs.split(",")
    if unknown := set(configs) - set(CONFIGS):
        parser.error(f"unknown configs {', '.join(sorted(unknown))} (choose from {', '.join(CONFIGS)})")
    streaming = import_streaming() if args.layout == "mds" else None
    if args.layout == "mds" and streaming is None:
        parser.error("--layout mds writes its shards with MosaicML Streaming: pip install mosaicml-streaming")
    work = Path(tempfile.mkdtemp(prefix="shardfeed-recipes-"))
    sizes = parse_sizes(args.size)
    s3 = start_moto()
    proxy, proxy_process = start_proxy_process(s3.endpoint, 0, work / "proxy.log")
    failed = []
    try:
        if streaming is None:
            url = "s3://recipes/data"
            s3.create_bucket("recipes")
            write_tar_shards(s3, url, args.samples, sizes, parse_size(args.shard_size))
        else:
            s3.create_bucket("bench")
            url = write_mds(streaming, s3, args.samples, sizes, 1 << 20, work)
        bucket, _, prefix = url.removeprefix("s3://").partition("/")
        dataset_bytes = sum(o["Size"] for o in s3.client().list_objects_v2(Bucket=bucket, Prefix=prefix)["Contents"]
                            if o["Key"].endswith(f".{args.layout}"))
        cache = max(1 << 20, int(args.cache_share * dataset_bytes))
        print(f"{args.samples} samples, {dataset_bytes / 2**20:.1f} MiB of {args.layout} shards, cache {cache / 2**20:.1f} MiB "
              f"({args.cache_share:g} of the dataset), moto behind the counting proxy", file=sys.stderr)
        print(f"\n{'recipe':<18}{'config':<16}{'S3 ms':>6}{'S3 bytes/dataset':>17}{'S3 requests/sample':>20}"
              f"{'first batch s':>14}{'plans':>7}{'samples/s':>11}")
        for latency in (float(ms) for ms in args.latency_ms.split(",")):
            _post(proxy, "latency", {"ms": latency})
            for recipe in args.recipes.split(","):
                for name in configs:
                    config = CONFIGS[name]
                    with start_service({"data": url}, cache_dir=work / f"{recipe}-{name}-{latency:g}" / "cache",
                                       cache_size=str(cache), env={**s3.env(), "AWS_ENDPOINT_URL": proxy},
                                       workers=config.workers or args.service_workers,
                                       args=[*config.serve_args, *shlex.split(args.serve_args)]) as svc:
                        before = control(proxy, "counts").get("GET", 0)
                        began = time.perf_counter()
                        seen, first = run(recipe, svc.url, sizes, config.fields)
                        seconds = time.perf_counter() - began
                        requests = control(proxy, "counts").get("GET", 0) - before
                        store_bytes = _store_bytes(svc.url)
                        plans = len(httpx.get(f"{svc.url}/v1/datasets/data/plans", timeout=10).json())
                    # Every sample; a few twice at most, where the last batch is padded (drop_last off).
                    assert set(seen) == set(range(args.samples)) and len(seen) - args.samples < 64, recipe
                    ratio, per_sample = store_bytes / dataset_bytes, requests / args.samples
                    over = config.limits and (ratio > MAX_BYTES or per_sample > MAX_REQUESTS)
                    if over:
                        failed.append(f"{recipe} {name} {latency:g} ms")
                    print(f"{recipe:<18}{name:<16}{latency:>6g}{ratio:>17.2f}{per_sample:>20.2f}{first:>14.2f}"
                          f"{plans:>7}{args.samples / seconds:>11,.0f}{'  OVER' if over else ''}", flush=True)
    finally:
        stop_process(proxy_process)
        s3.stop()
    if failed:
        print(f"past {MAX_BYTES}x the dataset's bytes or {MAX_REQUESTS} S3 requests per sample: "
              f"{'; '.join(failed)}", file=sys.stderr)
        return 1
    return 0


def write_tar_shards(s3, url: str, samples: int, sizes: tuple[int, int], shard_size: int) -> None:
    """The synthetic samples as a new user writes them: ``tarfile`` shards, each closed once past
    ``shard_size`` (so it ends in a short block), uploaded, then ``shardfeed index``\ ed."""
    bucket, _, prefix = url.removeprefix("s3://").partition("/")
    client = s3.client()
    shard, buffer = 0, io.BytesIO()
    tar = tarfile.open(fileobj=buffer, mode="w")

    def close() -> None:
        nonlocal shard
        tar.close()
        client.put_object(Bucket=bucket, Key=f"{prefix}/shard-{shard:06d}.tar", Body=buffer.getvalue())
        shard += 1

    for i in range(samples):
        for field in FIELDS:
            payload = member_bytes(0, i, field, sizes)
            info = tarfile.TarInfo(f"{sample_key(i)}.{field}")
            info.size = len(payload)
            tar.addfile(info, io.BytesIO(payload))
        if buffer.tell() > shard_size:
            close()
            buffer = io.BytesIO()
            tar = tarfile.open(fileobj=buffer, mode="w")
    if buffer.tell():
        close()
    subprocess.run([sys.executable, "-m", "shardfeed", "-q", "index", url], check=True,
                   env={**os.environ, **s3.env()})


def _post(proxy: str, what: str, body: dict) -> None:
    request = urllib.request.Request(f"{proxy}/_proxy/{what}", data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    urllib.request.urlopen(request, timeout=10).close()


def run(recipe: str, url: str, sizes: tuple[int, int], fields: tuple[str, ...]) -> tuple[list[int], float]:
    """One epoch of ``recipe`` reading ``fields``: the sample indices delivered (each checked byte
    for byte), and the seconds until the first batch."""
    seen: list[int] = []

    def check(sample: dict) -> None:
        index = sample["__index__"]
        assert set(sample) - {"__key__", "__index__"} == set(fields), f"sample {index}: fields {sorted(sample)}"
        for field in fields:
            assert sample[field] == member_bytes(0, index, field, sizes), f"sample {index} field {field} wrong"
        seen.append(index)

    began = time.perf_counter()
    if recipe.startswith("iterable"):
        ds = ShardfeedIterableDataset(url, "data", batch_size=64, fields=list(fields), collate_fn=None)
        loader = ShardfeedLoader(ds, num_workers=2) if recipe == "iterable-loader" else \
            DataLoader(ds, batch_size=None, num_workers=2)
    else:
        ds = ShardfeedDataset(url, "data", fields=list(fields))
        loader = DataLoader(ds, batch_size=64, sampler=ShardfeedSampler(ds), num_workers=2, collate_fn=list)
    first = None
    for batch in loader:
        first = first if first is not None else time.perf_counter() - began
        for sample in batch:
            check(sample)
    return seen, first


if __name__ == "__main__":
    sys.exit(main())
