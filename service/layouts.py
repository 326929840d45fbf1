"""Layouts: how the objects under a dataset's root become its index.

    tar      WebDataset tar shards; members found by reading their headers (``indexer.py``)
    objects  one object per member, as s3torchconnector users keep data: ``a/0001.jpg`` and
             ``a/0001.cls`` are the fields ``jpg`` and ``cls`` of sample ``a/0001``. The
             index comes from a listing of the prefix (no object is read); each member is
             a whole object (its "shard", offset 0), so the planner, coalescer and stream
             serve it like a shard member, and the block cache keeps it whole.

``shardfeed index`` writes either (``--objects`` for the second); ``shardfeed serve
--index-objects`` builds the second at start for a dataset without ``index.parquet``.
"""

from __future__ import annotations

import argparse
import asyncio
import time

import pyarrow as pa
from tqdm import tqdm

from .index import (
    INDEX_FILE, LAYOUT_KEY, SCHEMA, VERSION, VERSION_KEY, Index, IndexFormatError, split_member_name, write_index,
)
from .indexer import index_shards
from .sizes import format_size, parse_size
from .stores import ObjectInfo, Store, open_store


def objects_table(infos: list[ObjectInfo]) -> pa.Table:
    """Index rows of the objects layout: samples numbered in key order, fields in name order."""
    samples: dict[str, list[tuple[str, str, int]]] = {}
    for info in infos:
        parts = split_member_name(info.path)
        if parts is None or info.path == INDEX_FILE:  # no extension: WebDataset skips it too
            continue
        key, field = parts
        samples.setdefault(key, []).append((field, info.path, info.size))
    rows: dict[str, list] = {name: [] for name in SCHEMA.names}
    for sample, key in enumerate(sorted(samples)):
        for field, path, size in sorted(samples[key]):
            rows["sample"].append(sample)
            rows["key"].append(key)
            rows["field"].append(field)
            rows["shard"].append(path)
            rows["offset"].append(0)
            rows["size"].append(size)
    return pa.table(rows, schema=SCHEMA.with_metadata({VERSION_KEY: VERSION, LAYOUT_KEY: b"objects"}))


async def index_objects(store: Store, *, progress: bool = True) -> Index:
    """Build (not write) the index of the loose objects under ``store``, from a paged listing."""
    infos: list[ObjectInfo] = []
    with tqdm(unit=" objects", desc="list", disable=None if progress else True) as bar:
        async for page in store.list_pages():
            infos.extend(page)
            bar.update(len(page))
    table = objects_table(infos)
    if table.num_rows == 0:
        raise IndexFormatError(f"{store.url}: no objects named KEY.FIELD found")
    return await asyncio.to_thread(Index.from_table, table)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("url", metavar="URL", help="dataset root: s3://bucket/prefix, file:///dir or a path")
    parser.add_argument("--objects", action="store_true",
                        help="the root holds one object per member (a/0001.jpg, a/0001.cls), not tar "
                             "shards: index the objects from a listing")
    parser.add_argument("--window", default="1MiB",
                        help="bytes per ranged header read of a tar shard (default 1MiB)")


def run(args: argparse.Namespace) -> int:
    async def main() -> tuple[Index, str]:
        async with open_store(args.url) as store:
            if args.objects:
                index = await index_objects(store, progress=args.progress)
            else:
                index = await index_shards(store, window=parse_size(args.window), progress=args.progress)
            # S3Store counts its requests: report what indexing cost.
            cost = (f", {store.requests} store requests, {format_size(store.bytes_read)} read"
                    if hasattr(store, "requests") else "")
            await write_index(store, index)
            return index, cost

    started = time.monotonic()
    index, cost = asyncio.run(main())
    print(f"indexed {index.summary()} at {args.url} in {time.monotonic() - started:.1f}s{cost}")
    return 0
