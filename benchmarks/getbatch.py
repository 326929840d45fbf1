"""Loose objects and the AIStore SDK: samples/s of a loose-object dataset through shardfeed
(cold and warm cache) against one boto3 GET per object, and GetBatch through the unchanged
AIStore SDK against the native client on the same batches.

    python -m shardfeed.benchmarks.getbatch [--objects 4096] [--size 10KiB] [--batch 256]
                                           [--workers 8] [--latency-ms 20]

S3 is moto behind the delaying proxy (``s3proxy.py``: every S3 request waits
``--latency-ms`` first, as cloud S3's time to first byte). Every scenario keeps
``--workers`` requests in flight and reads the same shuffled batches; the individual
GETs read a prefix of them (their rate is steady and they are slow). Every sample's
length and bytes are checked, against the object asked for at its position.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path
from time import perf_counter

import boto3
import botocore.config
import httpx
import numpy as np
from aistore.sdk import Client as AisClient

from shardfeed.benchmarks import scenarios
from shardfeed.benchmarks.common import Digests, WrongBytes, benchmark_parser
from shardfeed.benchmarks.s3proxy import start_proxy_process
from shardfeed.client import Client
from shardfeed.process import start_service, stop_process
from shardfeed.s3server import start_moto
from shardfeed.seeds.synthetic import member_bytes
from shardfeed.sizes import format_size, parse_size
from shardfeed.tar import iter_members

BUCKET = "getbatch-bench"


def key_of(i: int) -> str:
    return f"loose/{i:09d}.bin"


def measure(get: Callable[[list[int]], list[bytes]], batches: list[list[int]], size: int,
            pool: ThreadPoolExecutor, verify: scenarios.Verify) -> scenarios.Measurement:
    """``get(batch)`` (the objects' bytes, in order) per batch, as many in flight as the pool has threads."""
    def fetch(batch: list[int]) -> float:
        began = perf_counter()
        got = get(batch)
        if len(got) != len(batch):
            raise WrongBytes(f"batch of {len(batch)} objects returned {len(got)}")
        for i, data in zip(batch, got):
            scenarios._check(i, data, size, verify)
        return perf_counter() - began

    m = scenarios.Measurement()
    start = perf_counter()
    m.batch_latencies = list(pool.map(fetch, batches))
    m.seconds = perf_counter() - start
    m.samples = sum(len(b) for b in batches)
    m.nbytes = m.samples * size
    return m


def sdk_get(client: AisClient) -> Callable[[list[int]], list[bytes]]:
    """One GetBatch per batch through the AIStore SDK."""
    bucket = client.bucket(BUCKET, provider="s3")
    return lambda batch: [data for _, data in client.batch([key_of(i) for i in batch], bucket=bucket).get()]


def raw_get(http: httpx.Client) -> Callable[[list[int]], list[bytes]]:
    """GetBatch without the SDK: the same request body over httpx, the answer parsed with
    shardfeed's own tar reader (the native client's): the server's share of the SDK path."""
    def get(batch: list[int]) -> list[bytes]:
        body = {"in": [{"objname": key_of(i), "bucket": BUCKET, "provider": "aws"} for i in batch],
                "mime": ".tar", "coer": True, "onob": False, "strm": True}
        return [bytes(data) for _, data in iter_members(http.request("GET", "/v1/ml/moss", json=body).content)]
    return get


def main() -> None:
    parser = benchmark_parser(__doc__, __spec__.name)
    parser.add_argument("--objects", type=int, default=4096)
    parser.add_argument("--size", default="10KiB")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--workers", type=int, default=8, help="requests in flight, every scenario")
    parser.add_argument("--latency-ms", type=float, default=20)
    parser.add_argument("--individual", type=int, default=1024, help="objects read by individual GETs")
    parser.add_argument("--rounds", type=int, default=5, help="rounds of the warm scenarios (median reported)")
    args = parser.parse_args()
    size = parse_size(args.size)

    with ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        moto = start_moto()
        stack.callback(moto.stop)
        os.environ.update(moto.env())
        proxy, process = start_proxy_process(moto.endpoint, args.latency_ms, tmp / "proxy.log")
        stack.callback(stop_process, process)
        pool = stack.enter_context(ThreadPoolExecutor(args.workers))
        s3 = boto3.client("s3", endpoint_url=proxy, config=botocore.config.Config(
            s3={"addressing_style": "path"}, max_pool_connections=args.workers + 8))
        moto.create_bucket(BUCKET)
        direct = moto.client()
        list(pool.map(lambda i: direct.put_object(Bucket=BUCKET, Key=key_of(i), Body=member_bytes(0, i, "bin", (size, size))),
                      range(args.objects)))

        verify = Digests(args.objects, (size, size)).verifier()

        order = np.random.default_rng(0).permutation(args.objects).tolist()
        batches = [order[i:i + args.batch] for i in range(0, len(order) - args.batch + 1, args.batch)]
        rows = []

        def record(name: str, m: scenarios.Measurement) -> float:
            rate = m.samples / m.seconds
            rows.append((name, rate))
            print(f"{name:34s} {rate:>10,.0f} samples/s  ({m.samples} samples in {m.seconds:.2f} s)", flush=True)
            return rate

        few = batches[:max(1, args.individual // args.batch)]
        gets = record("individual boto3 GETs", scenarios.individual_gets(
            s3, BUCKET, key_of, few, size, pool, verify))
        service = stack.enter_context(start_service(
            {"loose": f"s3://{BUCKET}/loose"}, cache_dir=tmp / "cache", env={"AWS_ENDPOINT_URL": proxy},
            args=["--index-objects", "--bucket", BUCKET, "--log-level", "warning"]))
        client = stack.enter_context(Client(service.url, max_connections=max(16, args.workers)))
        client.info("loose")
        cold = record("shardfeed native, cold cache", scenarios.batch_requests(
            client, "loose", batches, size, pool, verify))
        # The objects belong to the served dataset: GetBatch reads its (now warm) blocks. The warm
        # scenarios take turns, --rounds times, and each reports its median round: a burst of
        # load on a shared machine then hits all three alike.
        ais = AisClient(service.url, max_pool_size=max(10, args.workers))
        http = stack.enter_context(httpx.Client(base_url=service.url, timeout=60,
                                                limits=httpx.Limits(max_connections=args.workers)))
        warm_scenarios = {
            "shardfeed native, warm cache": lambda: scenarios.batch_requests(client, "loose", batches, size, pool, verify),
            "AIStore SDK GetBatch, warm cache": lambda: measure(sdk_get(ais), batches, size, pool, verify),
            "GetBatch over httpx (no SDK), warm": lambda: measure(raw_get(http), batches, size, pool, verify),
        }
        runs: dict[str, list[scenarios.Measurement]] = {name: [] for name in warm_scenarios}
        for _ in range(args.rounds):
            for name, scenario in warm_scenarios.items():
                runs[name].append(scenario())
        warm, sdk, raw = (record(name, sorted(ms, key=lambda m: m.samples / m.seconds)[(len(ms) - 1) // 2])
                          for name, ms in runs.items())
        print(f"\n{args.objects} loose {format_size(size)} objects, batch {args.batch}, {args.workers} in flight, "
              f"S3 +{args.latency_ms:g} ms (moto behind s3proxy)")
        print(f"cold vs individual GETs: {cold / gets:.1f}x; warm vs individual GETs: {warm / gets:.1f}x "
              f"(target >= 50x); AIStore SDK vs native (warm): {sdk / warm:.2f} (target >= 0.67); "
              f"GetBatch without the SDK vs native: {raw / warm:.2f}")


if __name__ == "__main__":
    main()
