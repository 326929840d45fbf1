"""``shardfeed index``: write ``index.parquet`` for the tar shards (``tarscan.py``: headers
only) or the loose objects (``layouts.py``: a listing) under a dataset root."""

from __future__ import annotations

import argparse
import asyncio
import time

from shardfeed.service.datasets.index import Index, write_index
from shardfeed.service.datasets.indexfile import IndexFormatError
from shardfeed.service.datasets.layouts import index_objects
from shardfeed.service.datasets.peerindex import PEER_INDEX
from shardfeed.service.datasets.tarscan import index_shards
from shardfeed.service.stores import ObjectNotFound, open_store
from shardfeed.sizes import format_size, parse_size


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("url", metavar="URL", help="dataset root: s3://bucket/prefix, file:///dir or a path")
    parser.add_argument("--objects", action="store_true",
                        help="the root holds one object per member (a/0001.jpg, a/0001.cls), not tar "
                             "shards: index the objects from a listing")
    parser.add_argument("--window", default="1MiB",
                        help="bytes per ranged header read of a tar shard (default 1MiB)")


async def _exists(store, path: str) -> bool:
    try:
        await store.head(path)
    except ObjectNotFound:
        return False
    return True


def run(args: argparse.Namespace) -> int:
    async def main() -> tuple[Index, str]:
        async with open_store(args.url) as store:
            if args.objects:
                index = await index_objects(store, progress=args.progress)
            else:
                try:
                    index = await index_shards(store, window=parse_size(args.window), progress=args.progress)
                except IndexFormatError:
                    if await _exists(store, PEER_INDEX):
                        raise IndexFormatError(
                            f"{args.url} holds a MosaicML Streaming or LitData dataset ({PEER_INDEX}): `shardfeed "
                            "serve --dataset NAME=URL` serves it in place, with no index") from None
                    raise
            # S3Store counts its requests: report what indexing cost.
            cost = (f", {store.requests} store requests, {format_size(store.bytes_read)} read"
                    if hasattr(store, "requests") else "")
            await write_index(store, index)
            return index, cost

    started = time.monotonic()
    index, cost = asyncio.run(main())
    print(f"indexed {index.summary()} at {args.url} in {time.monotonic() - started:.1f}s{cost}")
    return 0
