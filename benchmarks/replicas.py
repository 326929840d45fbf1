"""One service versus three replicas on this machine, over one S3 server (SeaweedFS, or moto with
``--s3 moto``).

Reports, for a random epoch cold then warm: samples/s, store requests and cache hit
ratio per replica; and the cost of a peer hop: the latency of a warm per-sample GET
for a sample the receiving replica owns versus one a peer owns.

    python -m shardfeed.benchmarks.replicas --samples 8000 --size 10KiB
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np

from shardfeed.benchmarks.s3server import S3_SERVERS, default_server, start_s3
from shardfeed.service.cache import shard_id
from shardfeed.service.index import load_index
from shardfeed.service.process import free_port, scrape_metrics, start_service
from shardfeed.service.stores import open_store


def _epoch(urls: list[str], n: int, batch: int, workers: int, seed: int) -> float:
    order = np.random.default_rng(seed).permutation(n)
    batches = [order[i:i + batch].tolist() for i in range(0, n, batch)]

    def one(k: int) -> None:
        resp = httpx.post(f"{urls[k % len(urls)]}/v1/batch", json={"dataset": "bench", "indices": batches[k]},
                          timeout=120)
        resp.raise_for_status()

    began = time.perf_counter()
    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(one, range(len(batches))))
    return n / (time.perf_counter() - began)


def _latency_ms(url: str, samples: list[int], repeat: int = 3) -> float:
    times = []
    with httpx.Client(base_url=url) as client:
        for _ in range(repeat):
            for i in samples:
                began = time.perf_counter()
                client.get(f"/v1/datasets/bench/samples/{i}/cls").raise_for_status()
                times.append(time.perf_counter() - began)
    return 1e3 * statistics.median(times)


async def _load_index(url: str, env: dict[str, str]):
    os.environ.update(env)
    async with open_store(url) as store:
        return await load_index(store)


def _report(label: str, urls: list[str], cold: float, warm: float) -> None:
    print(f"{label}: cold {cold:7.0f} samples/s, warm {warm:7.0f} samples/s")
    for url in urls:
        m = scrape_metrics(url)
        hits, misses = m["shardfeed_cache_hits_total"], m["shardfeed_cache_misses_total"]
        print(f"  {url}: store requests {m['shardfeed_store_requests_total']:5.0f}, "
              f"store MiB {m['shardfeed_store_bytes_total'] / 2**20:6.1f}, "
              f"cache hit ratio {hits / max(1, hits + misses):.3f}, "
              f"sub-batches sent {m.get('shardfeed_peer_requests_total', 0):4.0f}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=8000)
    parser.add_argument("--size", default="10KiB")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--s3", choices=S3_SERVERS, default=default_server(),
                        help="the S3 server to start on loopback (default here: %(default)s)")
    args = parser.parse_args(argv)

    s3 = start_s3(args.s3)
    try:
        s3.create_bucket("bench")
        subprocess.run([sys.executable, "-m", "shardfeed", "-q", "seed", "s3://bench/data", "--samples",
                        str(args.samples), "--size", args.size, "--shard-size", "4MiB"],
                       check=True, env={**os.environ, **s3.env()})
        url = "s3://bench/data"
        with tempfile.TemporaryDirectory() as tmp:
            with start_service({"bench": url}, cache_dir=Path(tmp) / "single", env=s3.env()) as svc:
                cold = _epoch([svc.url], args.samples, args.batch, args.workers, 0)
                warm = _epoch([svc.url], args.samples, args.batch, args.workers, 1)
                _report("1 service", [svc.url], cold, warm)

            ports = [free_port() for _ in range(3)]
            peers = ",".join(f"r{i}=http://127.0.0.1:{p}" for i, p in enumerate(ports))
            replicas = [start_service({"bench": url}, cache_dir=Path(tmp) / f"r{i}", port=port, env=s3.env(),
                                      args=["--node-id", f"r{i}", "--peers", peers])
                        for i, port in enumerate(ports)]
            try:
                urls = [r.url for r in replicas]
                time.sleep(1.5)  # first health checks
                cold = _epoch(urls, args.samples, args.batch, args.workers, 0)
                warm = _epoch(urls, args.samples, args.batch, args.workers, 1)
                _report("3 replicas (batches round-robin)", urls, cold, warm)

                # Peer hop: samples whose shard r0 owns versus shards r1 owns, asked of r0.
                cluster = httpx.get(f"{urls[0]}/v1/cluster").json()
                assert [p["id"] for p in cluster["peers"]] == ["r0", "r1", "r2"]
                cache0 = {p.name.split("-")[0] for p in (Path(tmp) / "r0").glob("*/*.blk")}
                index = asyncio.run(_load_index(url, s3.env()))
                members = index.lookup(np.arange(len(index)), ["cls"])
                owned = np.array([shard_id(path) in cache0 for path in index.shards])[members.shard]
                own = members.sample[owned][:: max(1, owned.sum() // 20)][:20].tolist()
                other = members.sample[~owned][:: max(1, (~owned).sum() // 20)][:20].tolist()
                local = _latency_ms(urls[0], own[:20])
                remote = _latency_ms(urls[0], other[:20])
                print(f"warm per-sample GET to r0, P50: own shard {local:.2f} ms, peer-owned shard {remote:.2f} ms "
                      f"(peer hop +{remote - local:.2f} ms)")
            finally:
                for r in replicas:
                    r.stop()
    finally:
        s3.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
