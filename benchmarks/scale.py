"""How the index and what is built from it grow with the dataset: 10^6 to 10^8 samples.

    python -m shardfeed.benchmarks.scale [--sizes 1e6,1e7,1e8] [--parquet-max 1e7] [--processes 4]
                                         [--service-sizes 1e5,1e6] [--service-workers 1,2,4]

Synthetic indexes (no shards needed): two fields a sample (``bin``, ``cls``), 10-byte keys,
10,000 samples a shard, 1 MiB blocks. Per size, in one process tree:

- ``map bytes/sample``: the host's one copy of the index (``service/datasets/mapped.py``);
- ``host bytes/sample``: what ``--processes`` processes that map it and read every page
  hold together (the sum of their PSS growth: shared pages count once), and the most one
  of them holds privately;
- ``parquet open``: a first open from a local ``index.parquet`` (parse, check, write the
  map), seconds per 10^6 samples (up to ``--parquet-max``, its peak memory being several
  times the index's); ``map open``: every later open (a worker, a restart);
- ``routing``: the routing table's runs and owners (``GET .../routing``);
- ``geometry``: a plan's per-sample block geometry (built once per dataset and version)
  and its bytes per sample; ``plan``: registering a full-epoch ``sampler`` plan
  (``--max-plan-samples`` bounds it) and its bytes per position; ``order``: the
  ``sampler`` kind's order computation alone.

The block cache (``--cache-blocks``): a kept cache of that many 1 MiB blocks (a synthetic
catalogue, ``service/cache/catalog.py``, 1,000 blocks a shard, each in a slot of its own; no
slabs: none is read), opened by ``BlockCache.open``: seconds, and RAM per block (what ``tracemalloc`` sees
allocated, numpy's arrays included, and what the catalogue counts); then the cost of one eviction, LRU and with a plan of 10^6
samples over the first shards (``Plans.victim_order``), each ranking 64 blocks drawn at
random. ``--first-batch``: ``shardfeed serve`` on the largest such cache and a small real
dataset, seconds from launch to its first batch answered.

Then the service itself (``--service-sizes``, ``--service-workers``): ``shardfeed serve
--memory-cache 0`` on a ``file://`` dataset holding only its index, the whole process
tree's PSS right after start and after one batch a worker, per extra sample (the
difference between the two sizes, as issue 25 measured it: 88 bytes with one worker and
181 with two, before the map).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

import httpx
import numpy as np
import pyarrow as pa

from shardfeed.benchmarks.serverside import process_tree
from shardfeed.process import start_service
from shardfeed.seeds.synthetic import seed_dataset
from shardfeed.service.cache.catalog import CATALOG, MAGIC, RECORD, STREAMS
from shardfeed.service.cache.disk import BlockCache
from shardfeed.service.cache.slabs import SIZE_SHIFT, slot_sizes
from shardfeed.service.cluster.peers import Cluster, Peer
from shardfeed.service.config import ServiceConfig
from shardfeed.service.datasets.dataset import Dataset
from shardfeed.service.datasets.index import Index, index_from_parquet, parquet_bytes
from shardfeed.service.datasets.indexfile import INDEX_FILE, narrow
from shardfeed.service.datasets.mapped import map_index, write_mapped
from shardfeed.service.observe.metrics import Metrics
from shardfeed.service.plans import sampler
from shardfeed.service.plans.registry import Geometry, Plan, Plans
from shardfeed.service.stores import open_store

MiB = 1 << 20

FIELDS = ("bin", "cls")
SHARD_SAMPLES = 10_000
KEY_DIGITS = 10
MEMBER_BYTES = (100 * 1024, 8)  # bin, cls


def synthetic_index(samples: int) -> Index:
    """An index of ``samples`` two-field samples built straight from numpy (no parquet)."""
    key_data = np.empty(samples * KEY_DIGITS, np.uint8)
    powers = 10 ** np.arange(KEY_DIGITS - 1, -1, -1, dtype=np.int64)
    for low in range(0, samples, 1 << 22):  # zero-padded decimal keys, a chunk at a time
        high = min(samples, low + (1 << 22))
        digits = np.arange(low, high, dtype=np.int64)[:, None] // powers % 10 + ord("0")
        key_data[low * KEY_DIGITS:high * KEY_DIGITS] = digits.reshape(-1)
    key_offsets = narrow(np.arange(samples + 1, dtype=np.int64) * KEY_DIGITS)
    key_type = pa.string() if key_offsets.dtype == np.int32 else pa.large_string()
    keys = pa.Array.from_buffers(key_type, samples, [None, pa.py_buffer(key_offsets), pa.py_buffer(key_data)])
    per_member = 512 + 1024  # a tar header, data padded: a small stand-in for the offsets' spread
    within = np.arange(samples, dtype=np.int64) % SHARD_SAMPLES
    sample_size = sum(MEMBER_BYTES) + 2 * per_member
    offset = np.empty(2 * samples, np.int64)
    offset[0::2] = within * sample_size + 512
    offset[1::2] = offset[0::2] + MEMBER_BYTES[0] + per_member
    size = np.tile(np.array(MEMBER_BYTES, np.int32), samples)
    shard = np.repeat(np.arange(samples, dtype=np.int64) // SHARD_SAMPLES, 2)
    shards = [f"shard-{i:06d}.tar" for i in range(int(shard[-1]) + 1)]
    return Index(keys=keys, starts=narrow(np.arange(samples + 1, dtype=np.int64) * 2),
                 shard=shard.astype(np.int16 if len(shards) < 2**15 else np.int32),
                 field=np.tile(np.arange(2, dtype=np.int16), samples), offset=narrow(offset), size=size,
                 shards=shards, fields=list(FIELDS))


def pss_kib() -> dict[str, int]:
    """This process's ``Pss`` and private bytes, KiB (``/proc/self/smaps_rollup``)."""
    values = {}
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name in ("Pss", "Private_Clean", "Private_Dirty"):
                values[name] = int(rest.split()[0])
    return {"pss": values["Pss"], "private": values["Private_Clean"] + values["Private_Dirty"]}


def touch_all(path: str) -> None:
    """A worker: map the index, read every page, report memory before and after (JSON on stdout)."""
    before = pss_kib()
    index = map_index(Path(path))
    total = 0
    for array in index.arrays().values():
        if isinstance(array, pa.Array):
            total += sum(int(np.frombuffer(b, np.uint8)[::4096].sum()) for b in array.buffers() if b is not None)
        else:
            total += int(array.view(np.uint8)[::4096].sum())
    batch = np.random.default_rng(os.getpid()).integers(0, len(index), 64)
    index.lookup(batch), index.keys(batch)
    print(total, flush=True)
    sys.stdin.readline()  # every sibling has touched every page: measure, then hold on until all have
    print(json.dumps({"before": before, "after": pss_kib()}), flush=True)
    sys.stdin.readline()


def host_memory(path: Path, processes: int) -> tuple[float, float]:
    """KiB of PSS the processes gained together, and the most private KiB one gained."""
    code = "import sys; from shardfeed.benchmarks.scale import touch_all; touch_all(sys.argv[1])"
    children = [subprocess.Popen([sys.executable, "-c", code, str(path)], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, text=True) for _ in range(processes)]
    for child in children:
        child.stdout.readline()
    for child in children:
        child.stdin.write("measure\n")
        child.stdin.flush()
    reports = [json.loads(child.stdout.readline()) for child in children]
    for child in children:
        child.communicate("")
    gained = sum(r["after"]["pss"] - r["before"]["pss"] for r in reports)
    private = max(r["after"]["private"] - r["before"]["private"] for r in reports)
    return gained, private


def timed(fn):
    began = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - began


def array_bytes(*arrays: np.ndarray) -> int:
    return sum(a.nbytes for a in arrays)


def measure(samples: int, workdir: Path, processes: int, parquet_max: int) -> dict:
    row: dict = {"samples": samples}
    index, row["build_s"] = timed(lambda: synthetic_index(samples))
    map_path = workdir / f"scale-{samples}.idx"
    if samples <= parquet_max:
        data = parquet_bytes(index.to_table())
        parquet = workdir / INDEX_FILE
        parquet.write_bytes(data)
        del data

        def first_open() -> None:
            write_mapped(index_from_parquet(parquet.read_bytes()), map_path)

        _, seconds = timed(first_open)
        row["parquet_open_s_per_1e6"] = seconds / samples * 1e6
        parquet.unlink()
    else:
        write_mapped(index, map_path)
    del index
    row["map_bytes_per_sample"] = map_path.stat().st_size / samples
    mapped, seconds = timed(lambda: map_index(map_path))
    row["map_open_s"] = seconds
    gained, private = host_memory(map_path, processes)
    row["host_bytes_per_sample"] = gained * 1024 / samples
    row["private_bytes_per_sample"] = private * 1024 / samples

    cluster = Cluster([Peer(f"n{i}", f"http://10.0.0.{i}:8080") for i in range(3)], 0, Metrics())
    starts, runs = mapped.shard_runs()
    _, row["routing_s"] = timed(lambda: (cluster.owners("s3://b/d", mapped.shards, runs), starts.tolist()))
    dataset = Dataset(name="d", url="s3://b/d", store=None, index=mapped, id="d", extents=mapped.shard_extents(),
                      shard_ids=[f"s{i}" for i in range(len(mapped.shards))], shard_samples=mapped.shard_samples())
    geometry, row["geometry_s"] = timed(lambda: Geometry(dataset, MiB))
    row["geometry_bytes_per_sample"] = array_bytes(geometry.first, geometry.span, geometry.sample_bytes) / samples
    request = sampler.Request(kind="sampler", seed=1, batch_size=64)
    order, row["order_s"] = timed(lambda: sampler.order(request, samples))
    plan, row["plan_s"] = timed(lambda: Plan("p", dataset, "sampler", 600, order, True, geometry))
    row["plan_bytes_per_position"] = array_bytes(plan.order, plan.by_sample, plan.by_block, plan.blocks) / samples
    row["peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    map_path.unlink()
    return row


def tree_pss(pid: int) -> int:
    """Bytes of PSS of a process and its descendants."""
    total = 0
    for p in process_tree(pid):
        try:
            with open(f"/proc/{p}/smaps_rollup") as f:
                total += next(int(line.split()[1]) for line in f if line.startswith("Pss:")) * 1024
        except (OSError, StopIteration):
            pass
    return total


def service_memory(samples: int, workers: int, workdir: Path) -> tuple[int, int]:
    """The service tree's PSS after start and after a batch per worker, on ``samples``."""
    root = workdir / f"svc-{samples}"
    if not (root / INDEX_FILE).exists():
        root.mkdir(parents=True, exist_ok=True)
        (root / INDEX_FILE).write_bytes(parquet_bytes(synthetic_index(samples).to_table()))
    cache = workdir / f"cache-{samples}-{workers}"
    with start_service({"d": root.as_uri()}, cache_dir=cache, workers=workers,
                       args=["--memory-cache", "0"], timeout=300) as svc:
        time.sleep(2)
        started = tree_pss(svc.process.pid)
        # Each worker answers one request for samples it does not hold: a 4xx/5xx is fine here,
        # the lookup runs (shards are absent on purpose).
        workers = httpx.get(f"{svc.url}/v1/cluster", timeout=30).json().get("workers", [])
        for url in {w["url"] for w in workers} or {svc.url}:
            httpx.post(f"{url}/v1/batch", json={"dataset": "d", "indices": list(range(0, samples, samples // 64))},
                       timeout=120)
        return started, tree_pss(svc.process.pid)


CACHE_SHARD_BLOCKS = 1000


def synthetic_cache(directory: Path, blocks: int) -> None:
    """A kept cache's catalogue of ``blocks`` 1 MiB blocks of dataset ``d1``, no slabs."""
    directory.mkdir(parents=True, exist_ok=True)
    shards = -(-blocks // CACHE_SHARD_BLOCKS)
    (directory / STREAMS).write_text("".join(json.dumps([i, "d1", f"shard{i:07d}", MiB]) + "\n"
                                             for i in range(shards)))
    records = np.zeros(blocks, RECORD)
    records["stream"] = np.arange(blocks) // CACHE_SHARD_BLOCKS
    records["block"] = np.arange(blocks) % CACHE_SHARD_BLOCKS
    records["place"] = (len(slot_sizes(MiB)) - 1) << SIZE_SHIFT | np.arange(blocks)
    records["size"] = MiB
    with open(directory / CATALOG, "wb") as f:
        f.write(MAGIC)
        records.tofile(f)


def cache_row(blocks: int, workdir: Path) -> dict:
    directory = workdir / f"cache-{blocks}"
    synthetic_cache(directory, blocks)
    row: dict = {"blocks": blocks}
    tracemalloc.start()  # numpy's buffers are traced too
    cache = BlockCache(directory, blocks * MiB, MiB, Metrics())
    _, row["open_s"] = timed(cache.open)
    row["heap_bytes_per_block"] = tracemalloc.get_traced_memory()[0] / blocks
    tracemalloc.stop()
    row["catalog_bytes_per_block"] = cache._catalog.nbytes / blocks

    def evictions(count: int) -> float:
        with cache._lock:
            began = time.perf_counter()
            for _ in range(count):
                cache.capacity -= MiB  # one block too many each time: one eviction
                cache._evict_locked()
            return (time.perf_counter() - began) / count

    row["evict_lru_us"] = evictions(200) * 1e6
    samples = 10**6
    index = synthetic_index(samples)
    shards = [f"shard{i:07d}" for i in range(len(index.shards))]
    dataset = Dataset(name="d", url="s3://b/d", store=None, index=index, id="d1", extents=index.shard_extents(),
                      shard_ids=shards, shard_samples=index.shard_samples())
    plans = Plans(ServiceConfig(), Metrics())
    request = sampler.Request(kind="sampler", seed=1, batch_size=64)
    plans.insert(plans.build(dataset, "sampler", sampler.order(request, samples), None, True, None))
    cache.close()
    cache = BlockCache(directory, cache.capacity, MiB, Metrics(), victims=plans)  # the same blocks, planned
    cache.open()
    row["evict_plans_us"] = evictions(200) * 1e6
    cache.close()
    return row


def first_batch_seconds(blocks: int, workdir: Path) -> float:
    """``shardfeed serve`` on a kept cache of ``blocks`` blocks: launch to first batch answered."""
    cache = workdir / f"cache-{blocks}"
    if not (cache / CATALOG).exists():
        synthetic_cache(cache, blocks)
    data = workdir / "small-dataset"
    if not data.exists():
        async def seed() -> None:
            async with open_store(data.as_uri()) as store:
                await seed_dataset(store, samples=256, size="10KiB", progress=False)

        asyncio.run(seed())
    began = time.perf_counter()
    with start_service({"d": data.as_uri()}, cache_dir=cache, cache_size=f"{blocks * MiB}",
                       args=["--block-size", "1MiB"], timeout=300) as svc:
        httpx.post(f"{svc.url}/v1/batch", json={"dataset": "d", "indices": list(range(64))},
                   timeout=120).raise_for_status()
        return time.perf_counter() - began


def parse_sizes(text: str) -> list[int]:
    return [int(float(s)) for s in text.split(",") if s]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="1e6,1e7,1e8", help="samples per synthetic index")
    parser.add_argument("--parquet-max", default="1e7", help="largest size opened from parquet too")
    parser.add_argument("--processes", type=int, default=4, help="processes mapping the index (a host's workers)")
    parser.add_argument("--service-sizes", default="1e5,1e6", help="two sizes for the service measure ('' skips it)")
    parser.add_argument("--service-workers", default="1,2,4")
    parser.add_argument("--cache-blocks", default="1e4,1e5,1e6,1e7", help="blocks of a kept cache ('' skips)")
    parser.add_argument("--first-batch", action="store_true", help="time a service's start on the largest cache")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    figures: dict = {"index": [], "cache": [], "service": []}
    with tempfile.TemporaryDirectory(prefix="shardfeed-scale-") as tmp:
        workdir = Path(tmp)
        print(f"{'samples':>11} {'map B/s':>8} {'host B/s':>8} {'priv B/s':>8} {'parquet s/1e6':>13} "
              f"{'map open s':>10} {'routing s':>9} {'geom s':>7} {'geom B/s':>8} {'order s':>7} {'plan s':>7} "
              f"{'plan B/pos':>10} {'peak GiB':>8}", flush=True)
        for samples in parse_sizes(args.sizes):
            row = measure(samples, workdir, args.processes, int(float(args.parquet_max)))
            figures["index"].append(row)
            parquet = row.get("parquet_open_s_per_1e6")
            print(f"{samples:>11,} {row['map_bytes_per_sample']:8.1f} {row['host_bytes_per_sample']:8.1f} "
                  f"{row['private_bytes_per_sample']:8.2f} {'-' if parquet is None else f'{parquet:.2f}':>13} "
                  f"{row['map_open_s']:10.4f} {row['routing_s']:9.4f} {row['geometry_s']:7.2f} "
                  f"{row['geometry_bytes_per_sample']:8.1f} {row['order_s']:7.2f} {row['plan_s']:7.2f} "
                  f"{row['plan_bytes_per_position']:10.1f} {row['peak_rss_gib']:8.1f}", flush=True)
        cache_sizes = parse_sizes(args.cache_blocks)
        if cache_sizes:
            print(f"\n{'blocks':>11} {'open s':>7} {'heap B/block':>12} {'catalog B/block':>15} "
                  f"{'evict LRU us':>12} {'evict plans us':>14}", flush=True)
        for blocks in cache_sizes:
            row = cache_row(blocks, workdir)
            figures["cache"].append(row)
            print(f"{blocks:>11,} {row['open_s']:7.2f} {row['heap_bytes_per_block']:12.1f} "
                  f"{row['catalog_bytes_per_block']:15.1f} {row['evict_lru_us']:12.1f} {row['evict_plans_us']:14.1f}",
                  flush=True)
        if args.first_batch and cache_sizes:
            seconds = first_batch_seconds(max(cache_sizes), workdir)
            figures["first_batch_s"] = seconds
            print(f"first batch of a service on a kept cache of {max(cache_sizes):,} blocks: {seconds:.1f} s "
                  "after launch", flush=True)
        sizes = parse_sizes(args.service_sizes)
        if len(sizes) == 2:
            small, large = sizes
            print(f"\nservice tree PSS per extra sample ({small:,} -> {large:,} samples, --memory-cache 0)")
            print(f"{'workers':>7} {'after start':>11} {'after a batch':>13}")
            for workers in [int(w) for w in args.service_workers.split(",")]:
                (s0, b0), (s1, b1) = (service_memory(n, workers, workdir) for n in (small, large))
                row = {"workers": workers, "start_bytes_per_sample": (s1 - s0) / (large - small),
                       "batch_bytes_per_sample": (b1 - b0) / (large - small)}
                figures["service"].append(row)
                print(f"{workers:>7} {row['start_bytes_per_sample']:11.1f} {row['batch_bytes_per_sample']:13.1f}",
                      flush=True)
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
