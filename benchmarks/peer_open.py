"""Opening an MDS dataset of many shards, in place: one listing and one header range per shard (issue 42).

MosaicML Streaming's own writer (``streaming.MDSWriter``) writes ``--shards`` shards of
``--per-shard`` records each (an ``index`` int and ``--size`` bytes of ``bin``) to an S3
server on loopback (SeaweedFS, or moto with ``--s3 moto``). A service started with no
dataset of its own is then asked to serve it (``POST /v1/datasets``), twice, each on an
empty cache (no index kept from before):

    counted  its S3 requests through a counting proxy (``s3proxy.py``): the requests the
             store saw, by kind, against what opening costs (``service/datasets/dataset.py``:
             the HEAD that finds no ``index.parquet``, the listing, a page per 1,000 keys,
             ``index.json`` read whole, and one ranged GET of each shard's header, never a
             shard read whole)
    direct   straight to the S3 server: the seconds to open, held against ``--target``

Then ``--check`` samples, drawn across the shards, are read through the service and held
against Streaming's own reader (``reader_from_json``) over the shards as written: each
field's bytes exact (``bin``; ``index`` as the int64 Streaming decodes).
The exit status is 1 past ``--target`` seconds or when the store saw other requests than
those, or other bytes came back.

    python -m shardfeed.benchmarks.peer_open --shards 10000
"""

from __future__ import annotations

import json
import math
import random
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import httpx
import numpy as np

from shardfeed.benchmarks.common import WrongBytes, benchmark_parser, load_note, upload
from shardfeed.benchmarks.loaders import import_streaming
from shardfeed.benchmarks.s3proxy import start_proxy
from shardfeed.client import Client
from shardfeed.process import ServiceProcess, start_service
from shardfeed.s3server import S3_SERVERS, default_server, start_s3
from shardfeed.seeds.synthetic import member_bytes
from shardfeed.sizes import parse_size

URL, NAME = "s3://bench/mds", "peer"
COLUMNS = {"index": "int", "bin": "bytes"}
LIST_PAGE = 1000
"""Keys per page of an S3 listing (ListObjectsV2's most)."""


def record_bytes(size: int) -> int:
    """Bytes a record of ``COLUMNS`` takes in a shard: its offset in the shard's header, its
    header (the ``bin`` size), the ``bin`` bytes and the 8-byte ``index``."""
    return 4 + 4 + size + 8


def write_shards(streaming, out: Path, shards: int, per_shard: int, size: int) -> None:
    """``shards`` MDS shards of ``per_shard`` records each, by Streaming's own writer; its size
    limit half a record past ``per_shard`` records, so each shard closes there (a shard's own
    header and config, under half a record, counted in)."""
    record = record_bytes(size)
    with streaming.MDSWriter(out=str(out), columns=COLUMNS, size_limit=int((per_shard + 0.5) * record)) as writer:
        for i in range(shards * per_shard):
            writer.write({"index": i, "bin": member_bytes(0, i, "bin", (size, size))})
    written = json.loads((out / "index.json").read_text())["shards"]
    counts = Counter(shard["samples"] for shard in written)
    if len(written) != shards or set(counts) != {per_shard}:
        raise ValueError(f"MDSWriter wrote {len(written)} shards ({dict(counts)}: shards by their records), "
                           f"not {shards} of {per_shard} records: pick a larger --size")


def expected_requests(shards: int) -> Counter:
    """What opening ``shards`` MDS shards should cost the store, by the proxy's counts."""
    pages = math.ceil((shards + 1) / LIST_PAGE)  # index.json is listed too
    return Counter({"HEAD": 1, "LIST": pages, "GET whole": 1, "GET range": shards,
                    "requests": 1 + pages + 1 + shards})


def kinds(counts: dict[str, int]) -> Counter:
    """The proxy's counts as ``expected_requests`` names them."""
    found = Counter({k: v for k, v in counts.items() if k in ("HEAD", "LIST", "GET range", "requests")})
    found["GET whole"] = counts.get("GET", 0) - found["LIST"] - found["GET range"]
    others = {k: v for k, v in counts.items() if k not in ("GET", "HEAD", "LIST", "GET range", "requests")}
    return found + Counter(others)


def open_seconds(env: dict[str, str], cache_dir: Path,
                 before: Callable[[], object] | None = None) -> tuple[float, dict, ServiceProcess]:
    """Start a service, ask it to serve ``URL``, and time the ``POST`` until it is served
    (``before()`` called just before the ``POST``): the seconds, the dataset's info, the
    service (still running: the caller stops it)."""
    service = start_service(cache_dir=cache_dir, env=env)
    try:
        if before is not None:
            before()
        began = time.perf_counter()
        while (answer := httpx.post(f"{service.url}/v1/datasets", params={"wait": 60},
                                    json={"name": NAME, "url": URL}, timeout=90)).status_code == 202:
            pass
        seconds = time.perf_counter() - began
        if answer.status_code != 200:
            raise RuntimeError(f"POST /v1/datasets answered {answer.status_code}: {answer.text[:500]}")
        return seconds, answer.json()["dataset"], service
    except BaseException:
        service.stop()
        raise


def check_samples(url: str, streaming, local: Path, per_shard: int, indices: list[int]) -> int:
    """Samples ``indices`` through the service at ``url``, each field as Streaming's own reader
    reads it from the shards in ``local``; how many."""
    shards = json.loads((local / "index.json").read_text())["shards"]
    readers: dict[int, object] = {}
    with Client(url) as client:
        got = client.get_batch(NAME, indices)
    for i, sample in zip(indices, got, strict=True):
        number, at = divmod(i, per_shard)
        if number not in readers:
            readers[number] = streaming.base.format.reader_from_json(str(local), None, shards[number])
        theirs = readers[number].get_item(at)
        if bytes(sample["bin"]) != theirs["bin"]:
            raise WrongBytes(f"sample {i} bin: other bytes than Streaming's reader reads")
        if not int(np.frombuffer(sample["index"], "<i8")[0]) == theirs["index"] == i:
            raise WrongBytes(f"sample {i} index: {bytes(sample['index'])!r}, Streaming's reader {theirs['index']}")
    return len(got)


def measure(args, streaming, tmp: Path) -> tuple[float, float, Counter, dict, int]:
    """Write the shards, open them counted then direct, read some back: the seconds of each open,
    the store requests of the counted one (by kind), the dataset's info, the samples checked."""
    began = time.perf_counter()
    samples = args.shards * args.per_shard
    write_shards(streaming, tmp / "mds", args.shards, args.per_shard, parse_size(args.size))
    server = start_s3(args.s3)
    try:
        server.create_bucket("bench")
        upload(server, tmp / "mds", URL)
        print(f"{args.shards} MDS shards of {args.per_shard} x {args.size} records (MDSWriter) to {args.s3} "
              f"in {time.perf_counter() - began:.1f} s", flush=True)
        with start_proxy(server.endpoint) as proxy:
            before: dict[str, int] = {}
            counted, _, service = open_seconds({**server.env(), "AWS_ENDPOINT_URL": proxy.url}, tmp / "counted",
                                               lambda: before.update(proxy.counts))
            service.stop()
            found = kinds(proxy.counts) - kinds(before)
        direct, info, service = open_seconds(server.env(), tmp / "direct")
        with service:
            indices = random.Random(0).sample(range(samples), min(args.check, samples))
            checked = check_samples(service.url, streaming, tmp / "mds", args.per_shard, indices)
    finally:
        server.stop()
    return counted, direct, found, info, checked


def main(argv: list[str] | None = None) -> int:
    parser = benchmark_parser(__doc__, __spec__.name)
    parser.add_argument("--shards", type=int, default=10_000)
    parser.add_argument("--per-shard", type=int, default=2, help="records per shard (default %(default)s)")
    parser.add_argument("--size", default="1KiB", help="bytes of each record's bin (default %(default)s)")
    parser.add_argument("--check", type=int, default=256, help="samples read back and checked (default %(default)s)")
    parser.add_argument("--target", type=float, default=30.0, help="seconds an open may take (default %(default)s)")
    parser.add_argument("--s3", choices=S3_SERVERS, default=default_server())
    args = parser.parse_args(argv)
    if args.shards < 1 or args.per_shard < 1:
        parser.error("--shards and --per-shard take 1 or more")
    streaming = import_streaming()
    if streaming is None:
        parser.exit(2, f"{parser.prog}: MosaicML Streaming writes the shards: pip install mosaicml-streaming\n")
    with tempfile.TemporaryDirectory() as tmp:
        try:
            counted, direct, found, info, checked = measure(args, streaming, Path(tmp))
        except ValueError as err:  # the shards as asked cannot be written
            parser.exit(2, f"{parser.prog}: {err}\n")
    expected = expected_requests(args.shards)
    print(f"opened: {info['samples']} samples, {info['shards']} shards, fields {info['fields']}, "
          f"layout {info['layout']}")
    print(f"  direct to {args.s3}: {direct:.2f} s (target {args.target:g} s); "
          f"through the counting proxy: {counted:.2f} s")
    print("  store requests: " + ", ".join(f"{k} {found[k]} (expected {expected[k]})" for k in expected)
          + "".join(f", {k} {v} (expected 0)" for k, v in found.items() if k not in expected))
    print(f"  {checked} samples read back, every field as Streaming's reader reads it; {load_note()}")
    failed = []
    if (info["samples"], info["shards"]) != (args.shards * args.per_shard, args.shards):
        failed.append(f"the service serves {info['samples']} samples in {info['shards']} shards")
    if direct > args.target:
        failed.append(f"the open took {direct:.2f} s, past the {args.target:g} s target")
    if +found != +expected:
        failed.append("the store saw other requests than one listing and one header range per shard")
    for why in failed:
        print(f"FAILED: {why}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
