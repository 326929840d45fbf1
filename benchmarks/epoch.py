"""One random-order epoch through the service over S3 (SeaweedFS, or moto with ``--s3 moto``), cold
then warm.

Measures what issue 3 asks of the service alone: store requests per 1000 samples and
store bytes per dataset byte on a cold cache larger than the dataset, then warm-cache
samples/s and the service's CPU time per sample. Every sample is checked byte for byte.

    python -m shardfeed.benchmarks.epoch --samples 20000 --size 10KiB --shard-size 4MiB
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np

from shardfeed.benchmarks.s3server import S3_SERVERS, default_server, start_s3
from shardfeed.seeds.synthetic import member_bytes, parse_sizes
from shardfeed.service.process import scrape_metrics, start_service
from shardfeed.tar import iter_members


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _epoch(url: str, order: np.ndarray, batch: int, workers: int, check) -> float:
    batches = [order[i:i + batch].tolist() for i in range(0, len(order), batch)]

    def one(indices):
        with httpx.Client(timeout=120) as client:
            resp = client.post(f"{url}/v1/batch", json={"dataset": "bench", "indices": indices})
            resp.raise_for_status()
            return indices, resp.content

    began = time.perf_counter()
    with ThreadPoolExecutor(workers) as pool:
        results = list(pool.map(one, batches))
    elapsed = time.perf_counter() - began
    for indices, body in results:
        check(indices, body)
    return elapsed


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=20000)
    parser.add_argument("--size", default="10KiB")
    parser.add_argument("--shard-size", default="4MiB")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--workers", type=int, default=4, help="concurrent batch requests")
    parser.add_argument("--block-size", default="1MiB")
    parser.add_argument("--cache-size", default="20GiB",
                        help="the service's cache; below the dataset size the warm epoch re-reads from S3")
    parser.add_argument("--s3", choices=S3_SERVERS, default=default_server(),
                        help="the S3 server to start on loopback (default here: %(default)s)")
    args = parser.parse_args(argv)

    sizes = parse_sizes(args.size)
    s3 = start_s3(args.s3)
    try:
        s3.create_bucket("bench")
        env = {**os.environ, **s3.env()}
        subprocess.run([sys.executable, "-m", "shardfeed", "-q", "seed", "s3://bench/data", "--samples",
                        str(args.samples), "--size", args.size, "--shard-size", args.shard_size],
                       check=True, env=env)
        shard_bytes = sum(o["Size"] for o in s3.client().list_objects_v2(Bucket="bench", Prefix="data/")
                          ["Contents"] if o["Key"].endswith(".tar"))

        def check(indices, body):
            members = list(iter_members(body))
            assert len(members) == 2 * len(indices)
            for i, (name, data) in zip(np.repeat(indices, 2), members):
                field = name.rsplit(".", 1)[1]
                assert bytes(data) == member_bytes(0, int(i), field, sizes), f"sample {i} {field} differs"

        order = np.random.default_rng(0).permutation(args.samples)
        with tempfile.TemporaryDirectory() as tmp, start_service(
                {"bench": "s3://bench/data"}, cache_dir=Path(tmp) / "cache", cache_size=args.cache_size,
                env=s3.env(), args=["--block-size", args.block_size]) as svc:
            cold = _epoch(svc.url, order, args.batch, args.workers, check)
            m = scrape_metrics(svc.url)
            cpu0 = _cpu_seconds(svc.process.pid)
            warm = _epoch(svc.url, np.random.default_rng(1).permutation(args.samples), args.batch,
                          args.workers, check)
            cpu = _cpu_seconds(svc.process.pid) - cpu0
            m2 = scrape_metrics(svc.url)
        n = args.samples
        print(f"dataset: {n} samples x {args.size} in {args.shard_size} shards on {s3.kind} S3 "
              f"({shard_bytes / 2**20:.1f} MiB of shards); batches of {args.batch}, {args.workers} concurrent")
        print(f"cold epoch: {n / cold:8.0f} samples/s   store requests per 1000 samples: "
              f"{1000 * m['shardfeed_store_requests_total'] / n:.2f}   store bytes / shard bytes: "
              f"{m['shardfeed_store_bytes_total'] / shard_bytes:.3f}   (cache {args.cache_size})")
        print(f"warm epoch: {n / warm:8.0f} samples/s   service CPU per sample: {1e6 * cpu / n:.1f} us   "
              f"store requests during warm epoch: "
              f"{m2['shardfeed_store_requests_total'] - m['shardfeed_store_requests_total']:.0f}")
    finally:
        s3.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
