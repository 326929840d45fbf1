"""The recipes users type, on a dataset larger than the cache: what one epoch reads from S3.

    python -m shardfeed.benchmarks.recipes [--samples 6000] [--size 10KiB] [--cache-share 0.25]

A synthetic dataset with two fields (``bin``, ``cls``) on moto's S3 server; the service
(its default workers, ``--memory-cache 0``, a block cache of ``--cache-share`` of the
dataset's bytes) reads it through the counting proxy (``s3proxy.py``). Each recipe runs
one epoch with ``DataLoader(num_workers=2)``, on a fresh cache, every sample checked:

- ``iterable, plain``: ``ShardfeedIterableDataset(url, name, batch_size=64)`` in a plain
  ``DataLoader(ds, batch_size=None)``, every other argument its default;
- ``iterable, loader``: the same through ``ShardfeedLoader``;
- ``map + ShardfeedSampler``: ``DataLoader(ShardfeedDataset(url, name), batch_size=64,
  sampler=ShardfeedSampler(ds))``.

``--layout mds`` writes the same samples as MosaicML Streaming's MDS shards (``MDSWriter``), which
the service serves in place (issue 42): its records are read ahead whole, then their headers and
fields taken from them.

Printed per recipe: S3 bytes per dataset byte (tar shards included), S3 requests per
sample, plans held right after the epoch (one per rank and epoch is right), samples/s. Targets (issue 25): the plain iterable recipe
<= 1.2x the dataset's bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import httpx
from torch.utils.data import DataLoader

from shardfeed.benchmarks.common import seed_by_cli
from shardfeed.benchmarks.loaders import import_streaming, write_mds
from shardfeed.benchmarks.s3proxy import start_proxy_process
from shardfeed.client.torch import ShardfeedDataset, ShardfeedIterableDataset, ShardfeedLoader, ShardfeedSampler
from shardfeed.process import scrape_metrics, start_service, stop_process
from shardfeed.s3server import start_moto
from shardfeed.seeds.synthetic import member_bytes, parse_sizes

FIELDS = ("bin", "cls")


def _counts(proxy: str) -> dict:
    with urllib.request.urlopen(f"{proxy}/_proxy/counts", timeout=10) as resp:
        return json.loads(resp.read())


def _store_bytes(url: str) -> float:
    return scrape_metrics(url)["shardfeed_store_bytes_total"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m shardfeed.benchmarks.recipes", description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=6000)
    parser.add_argument("--size", default="10KiB")
    parser.add_argument("--cache-share", type=float, default=0.25, help="the block cache, as a share of the dataset")
    parser.add_argument("--recipes", default="iterable-plain,iterable-loader,map-sampler")
    parser.add_argument("--serve-args", default="", help="more `serve` flags, e.g. '--plan-memory 0'")
    parser.add_argument("--service-workers", type=int, default=os.cpu_count() or 1,
                        help="serve --workers (default: every core, as serve's own default)")
    parser.add_argument("--layout", choices=("tar", "mds"), default="tar",
                        help="the shards: tar (shardfeed seed), or MDS (Streaming's MDSWriter), served in place")
    args = parser.parse_args(argv)
    streaming = import_streaming() if args.layout == "mds" else None
    if args.layout == "mds" and streaming is None:
        parser.error("--layout mds writes its shards with MosaicML Streaming: pip install mosaicml-streaming")
    work = Path(tempfile.mkdtemp(prefix="shardfeed-recipes-"))
    sizes = parse_sizes(args.size)
    s3 = start_moto()
    proxy, proxy_process = start_proxy_process(s3.endpoint, 0, work / "proxy.log")
    try:
        if streaming is None:
            url = "s3://recipes/data"
            s3.create_bucket("recipes")
            seed_by_cli(url, args.samples, args.size, shard_size="1MiB", fields=FIELDS, env=s3.env())
        else:
            s3.create_bucket("bench")
            url = write_mds(streaming, s3, args.samples, sizes, 1 << 20, work)
        bucket, _, prefix = url.removeprefix("s3://").partition("/")
        dataset_bytes = sum(o["Size"] for o in s3.client().list_objects_v2(Bucket=bucket, Prefix=prefix)["Contents"]
                            if o["Key"].endswith(f".{args.layout}"))
        cache = max(1 << 20, int(args.cache_share * dataset_bytes))
        print(f"{args.samples} samples, {dataset_bytes / 2**20:.1f} MiB of {args.layout} shards, cache {cache / 2**20:.1f} MiB "
              f"({args.cache_share:g} of the dataset), moto behind the counting proxy", file=sys.stderr)
        print(f"\n{'recipe':<26}{'S3 bytes/dataset':>17}{'S3 requests/sample':>20}{'plans':>7}{'samples/s':>11}")
        for recipe in args.recipes.split(","):
            with start_service({"data": url}, cache_dir=work / recipe / "cache", cache_size=str(cache),
                               env={**s3.env(), "AWS_ENDPOINT_URL": proxy}, workers=args.service_workers,
                               args=["--memory-cache", "0", *shlex.split(args.serve_args)]) as svc:
                before = _counts(proxy).get("GET", 0)
                began = time.perf_counter()
                seen = run(recipe, svc.url, sizes)
                seconds = time.perf_counter() - began
                requests = _counts(proxy).get("GET", 0) - before
                store_bytes = _store_bytes(svc.url)
                plans = len(httpx.get(f"{svc.url}/v1/datasets/data/plans", timeout=10).json())
            # Every sample; a few twice at most, where the last batch is padded (drop_last off).
            assert set(seen) == set(range(args.samples)) and len(seen) - args.samples < 64, recipe
            print(f"{recipe:<26}{store_bytes / dataset_bytes:>17.2f}{requests / args.samples:>20.2f}"
                  f"{plans:>7}{args.samples / seconds:>11,.0f}")
        return 0
    finally:
        stop_process(proxy_process)
        s3.stop()


def run(recipe: str, url: str, sizes: tuple[int, int]) -> list[int]:
    """One epoch of ``recipe``; the sample indices delivered (each checked byte for byte)."""
    seen: list[int] = []

    def check(sample: dict) -> None:
        index = sample["__index__"]
        for field in FIELDS:
            assert sample[field] == member_bytes(0, index, field, sizes), f"sample {index} field {field} wrong"
        seen.append(index)

    if recipe.startswith("iterable"):
        ds = ShardfeedIterableDataset(url, "data", batch_size=64, collate_fn=None)
        loader = ShardfeedLoader(ds, num_workers=2) if recipe == "iterable-loader" else \
            DataLoader(ds, batch_size=None, num_workers=2)
        for batch in loader:
            for sample in batch:
                check(sample)
        return seen
    ds = ShardfeedDataset(url, "data")
    for batch in DataLoader(ds, batch_size=64, sampler=ShardfeedSampler(ds), num_workers=2, collate_fn=list):
        for sample in batch:
            check(sample)
    return seen


if __name__ == "__main__":
    sys.exit(main())
