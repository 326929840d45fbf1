"""Epochs through the service over S3 (SeaweedFS, or moto with ``--s3 moto``), with a cache of
a given share of the dataset, a shuffle mode, the map-style or the iterable loader's order,
and a plan or not.

For each combination a fresh service reads ``--epochs`` epochs (the first is cold), every
sample checked byte for byte, and one row is printed per epoch: samples/s (and its ratio
to the warm epoch of the same order with a cache that holds the dataset), S3 bytes read
per dataset byte, S3 requests per 1000 samples, and the order's shuffle quality: distinct
shards per batch and the Spearman rank correlation between a sample's place in the epoch
and in the dataset. A second table puts the locality modes next to MosaicML Streaming's
``py1e`` at the same cache size (the real one when ``mosaicml-streaming`` is installed,
else the same algorithm written out below).

    python -m shardfeed.benchmarks.epoch --samples 20000 --size 10KiB --shard-size 4MiB \\
        --cache-size 1,0.25 --shuffle uniform,windows --loader map,iterable --plan on,off --latency-ms 20

``--loader map`` is what ``ShardfeedSampler`` + a DataLoader read (a sample-level order cut
into batches); ``iterable`` is ``ShardfeedIterableDataset`` (an order of whole batches).
"""

from __future__ import annotations

import itertools
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

import httpx
import numpy as np

from shardfeed.benchmarks.common import BENCH_DATA, Digests, benchmark_parser, load_note, seeded_s3, seeded_s3_arguments
from shardfeed.benchmarks.s3proxy import start_proxy_process
from shardfeed.client.sampling import EpochSampler
from shardfeed.client.shuffles import LOCAL, SHUFFLES, cache_window, shard_samples
from shardfeed.process import scrape_metrics, start_service, stop_process
from shardfeed.seeds.synthetic import DEFAULT_FIELDS, parse_sizes
from shardfeed.sizes import parse_size


def _epoch(url: str, batches: list[list[int]], workers: int, check) -> float:
    def one(indices):
        with httpx.Client(timeout=300) as client:
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


def sampler_for(loader: str, samples: int, batch: int, mode: str, locality, seed: int) -> EpochSampler:
    """The sampler whose order the loader reads (and whose plan it registers)."""
    size = 1 if loader == "map" else batch  # ShardfeedSampler yields samples; the DataLoader batches them
    return EpochSampler(samples, size, seed=seed, shuffle=mode, locality=locality)


def quality(order: np.ndarray, batch: int, per_shard: int) -> tuple[float, float]:
    """Mean distinct shards per batch, and Spearman's rho of epoch place vs dataset place."""
    shards = order // per_shard
    whole = len(order) // batch * batch
    distinct = np.mean([len(np.unique(b)) for b in shards[:whole].reshape(-1, batch)])
    places = order[:len(np.unique(order))]  # an epoch's first pass (padding repeats come after)
    rho = float(np.corrcoef(np.arange(len(places)), np.argsort(np.argsort(places)))[0, 1])
    return float(distinct), rho


def py1e(shard_sizes: np.ndarray, seed: int, epoch: int, block_size: int) -> np.ndarray:
    """Streaming's ``get_shuffle_py1e`` for one canonical node (``streaming/base/shuffle/py1e.py``)."""
    from shardfeed.benchmarks.loaders import import_streaming  # torch and the client: imported only here

    if import_streaming() is not None:
        from streaming.base.shuffle.py1e import get_shuffle_py1e

        return get_shuffle_py1e(shard_sizes, 1, seed, epoch, block_size)
    starts = np.concatenate([[0], np.cumsum(shard_sizes)[:-1]])
    spans = [(int(s), int(s + n)) for s, n in zip(starts, shard_sizes)]
    total = int(np.sum(shard_sizes))
    np.random.default_rng(seed).shuffle(spans)
    rng = np.random.default_rng(seed + epoch)
    rng.shuffle(spans)
    samples = np.empty(total)
    at = 0
    for begin, end in spans:
        part = np.arange(begin, end)
        rng.shuffle(part)
        samples[at:at + end - begin] = part
        at += end - begin
    positions = np.arange(total, dtype=np.float64)
    offset = 0
    for begin, end in spans:
        size = end - begin
        cutoff = max(0.0, (rng.integers(int(0.75 * block_size), int(1.25 * block_size)) - size) / 2)
        shifts = rng.uniform(max(-cutoff, -offset), min(cutoff, total - offset - size), size)
        positions[offset:offset + size] += shifts
        offset += size
    return samples[np.argsort(positions)].astype(np.int64)


def _cache_bytes(spec: str, dataset_bytes: int) -> int:
    """``0.25`` is a quarter of the dataset's shard bytes; ``20GiB`` is a size."""
    try:
        return int(float(spec) * dataset_bytes)
    except ValueError:
        return parse_size(spec)


def main(argv=None) -> int:
    parser = benchmark_parser(__doc__, __spec__.name)
    seeded_s3_arguments(parser, samples=20000, shard_size="4MiB")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--workers", type=int, default=4, help="concurrent batch requests")
    parser.add_argument("--service-workers", type=int, default=1,
                        help="shardfeed serve --workers: each worker owns its share of the shards and of the "
                             "cache, and holds every plan (default: %(default)s)")
    parser.add_argument("--block-size", default="1MiB")
    parser.add_argument("--cache-size", default="1",
                        help="comma-separated: shares of the dataset (1, 0.25) or sizes (20GiB)")
    parser.add_argument("--shuffle", default="uniform", help=f"comma-separated modes of: {', '.join(SHUFFLES)}")
    parser.add_argument("--loader", default="iterable", help="comma-separated: map, iterable")
    parser.add_argument("--plan", default="on", help="comma-separated: on, off")
    parser.add_argument("--epochs", type=int, default=2, help="epochs per service; the first is cold")
    parser.add_argument("--latency-ms", type=float, default=0, help="added to every S3 request (a proxy)")
    parser.add_argument("--plan-memory", default="8MiB",
                        help="the service's --plan-memory: small, so that memory does not act as the cache")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    lists = {name: getattr(args, name).split(",") for name in ("cache_size", "shuffle", "loader", "plan")}
    for mode in lists["shuffle"]:
        if mode not in SHUFFLES:
            parser.error(f"unknown shuffle mode {mode!r} (modes: {', '.join(SHUFFLES)})")
    if set(lists["loader"]) - {"map", "iterable"} or set(lists["plan"]) - {"on", "off"}:
        parser.error("--loader takes map,iterable and --plan takes on,off")

    sizes = parse_sizes(args.size)
    n = args.samples
    with ExitStack() as stack:
        server = stack.enter_context(seeded_s3(args.s3, n, args.size, args.shard_size))
        listing = server.client().list_objects_v2(Bucket="bench", Prefix="data/")["Contents"]
        shard_bytes = sum(o["Size"] for o in listing if o["Key"].endswith(".tar"))
        s3 = server.env()
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        if args.latency_ms:
            url, proxy = start_proxy_process(s3["AWS_ENDPOINT_URL"], args.latency_ms, tmp / "s3proxy.log")
            stack.callback(stop_process, proxy)
            s3["AWS_ENDPOINT_URL"] = url

        digests = Digests(n, sizes, DEFAULT_FIELDS)

        print(f"dataset: {n} samples x {args.size} in {args.shard_size} shards on {server.kind} S3 "
              f"({shard_bytes / 2**20:.1f} MiB of shards), +{args.latency_ms:g} ms per S3 request; "
              f"batches of {args.batch}, {args.workers} concurrent; block {args.block_size}; "
              f"serve --workers {args.service_workers}; "
              f"{load_note()}", flush=True)
        header = (f"{'cache':>6} {'shuffle':>8} {'loader':>8} {'plan':>4} {'epoch':>5} {'samples/s':>9} "
                  f"{'x warm':>6} {'S3 B/B':>7} {'req/1k':>7} {'shards/batch':>12} {'rho':>6}")
        print(header, flush=True)
        rows = []
        per_shard = None
        windows = {}
        for cache, mode, loader, plan in itertools.product(*lists.values()):
            capacity = _cache_bytes(cache, shard_bytes)
            cache_dir = tmp / f"cache-{len(rows)}"
            with start_service({"bench": BENCH_DATA}, cache_dir=cache_dir, cache_size=str(capacity),
                               env=s3, workers=args.service_workers, args=["--block-size", args.block_size, "--no-hedge",
                                             "--plan-memory", args.plan_memory]) as svc:
                info = httpx.get(f"{svc.url}/v1/datasets/bench").json()
                per_shard = shard_samples(info)
                locality = (per_shard, cache_window(info)) if mode in LOCAL else None
                windows[cache] = cache_window(info)
                for epoch in range(args.epochs):
                    sampler = sampler_for(loader, n, args.batch, mode, locality, args.seed)
                    sampler.set_epoch(epoch)
                    if plan == "on":
                        httpx.post(f"{svc.url}/v1/datasets/bench/plans", json=sampler.plan()).raise_for_status()
                    order = sampler.rank_order()
                    batches = [order[i:i + args.batch].tolist() for i in range(0, len(order), args.batch)]
                    before = scrape_metrics(svc.url)
                    elapsed = _epoch(svc.url, batches, args.workers, digests.check_tar)
                    after = scrape_metrics(svc.url)
                    served = len(order)
                    row = {"cache": cache, "shuffle": mode, "loader": loader, "plan": plan, "epoch": epoch,
                           "rate": served / elapsed,
                           "bytes": (after["shardfeed_store_bytes_total"] - before["shardfeed_store_bytes_total"])
                           / shard_bytes * n / served,
                           "requests": 1000 * (after["shardfeed_store_requests_total"]
                                               - before["shardfeed_store_requests_total"]) / served}
                    row["distinct"], row["rho"] = quality(order, args.batch, per_shard)
                    rows.append(row)
                    print(_format(row, None), flush=True)
        warm = {(r["shuffle"], r["loader"], r["plan"]): r["rate"] for r in rows
                if _cache_bytes(r["cache"], shard_bytes) >= shard_bytes and r["epoch"] == args.epochs - 1}
        if warm:
            print("\nwith the ratio to the warm epoch (cache >= dataset, last epoch) of the same order and plan:")
            print(header)
            for row in rows:
                print(_format(row, warm.get((row["shuffle"], row["loader"], row["plan"]))))
        print(f"\nshuffle quality at each cache size (batches of {args.batch}; {per_shard} samples per shard; "
              f"py1e with shuffle_block_size = window x samples per shard):")
        print(f"{'cache':>6} {'window':>6} {'shuffle':>8} {'shards/batch':>12} {'rho':>6}")
        for cache, window in windows.items():
            for mode in ("uniform", "blocks", "windows"):
                order = EpochSampler(n, args.batch, seed=args.seed, shuffle=mode,
                                     locality=(per_shard, window)).order()
                print(f"{cache:>6} {window:>6} {mode:>8} {_quality(order, args.batch, per_shard)}")
            shard_sizes = np.full(-(-n // per_shard), per_shard, dtype=np.int64)
            shard_sizes[-1] = n - per_shard * (len(shard_sizes) - 1)
            order = py1e(shard_sizes, args.seed, 0, window * per_shard)
            print(f"{cache:>6} {window:>6} {'py1e':>8} {_quality(order, args.batch, per_shard)}")
    return 0


def _quality(order: np.ndarray, batch: int, per_shard: int) -> str:
    distinct, rho = quality(order, batch, per_shard)
    return f"{distinct:12.1f} {rho:6.3f}"


def _format(row: dict, warm: float | None) -> str:
    ratio = f"{row['rate'] / warm:6.2f}" if warm else f"{'':>6}"
    return (f"{row['cache']:>6} {row['shuffle']:>8} {row['loader']:>8} {row['plan']:>4} {row['epoch']:>5} "
            f"{row['rate']:9.0f} {ratio} {row['bytes']:7.2f} {row['requests']:7.1f} {row['distinct']:12.1f} "
            f"{row['rho']:6.3f}")


if __name__ == "__main__":
    raise SystemExit(main())
