"""``shardfeed pack``: pack a directory of files, or a store of loose objects
(``pack s3://a s3://b``), into uncompressed tar shards plus ``index.parquet``, through the
one shard writer (``service/datasets/shards.py``)."""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from collections import deque
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import numpy as np

from shardfeed.service.datasets.index import Index
from shardfeed.service.datasets.indexfile import IndexFormatError, split_member_name
from shardfeed.service.datasets.layouts import index_objects
from shardfeed.service.datasets.shards import DEFAULT_SHARD_SIZE, Sample, refuse_existing, write_shards
from shardfeed.service.stores import Store, open_store
from shardfeed.sizes import parse_size


def _directory_samples(directory: Path, rel: str) -> list[tuple[str, list[tuple[str, Path]]]]:
    """The samples whose files sit directly in ``directory``, sorted by key, fields sorted."""
    groups: dict[str, dict[str, Path]] = {}
    with os.scandir(directory) as entries:
        files = sorted(e.name for e in entries if not e.name.startswith(".") and e.is_file())
    for name in files:
        parts = split_member_name(name)
        if parts is None:
            raise IndexFormatError(f"{directory / name}: no extension (files must be named KEY.FIELD)")
        stem, field = parts
        fields = groups.setdefault(f"{rel}/{stem}" if rel else stem, {})
        if field in fields:
            raise IndexFormatError(f"{directory / name}: duplicate field {field!r} "
                                   f"(also {fields[field].name}) in sample {stem!r}")
        fields[field] = directory / name
    return [(key, sorted(groups[key].items())) for key in sorted(groups)]


def _raise(err: OSError) -> None:
    raise err


def _walk(src: Path) -> Iterator[tuple[str, list[tuple[str, Path]]]]:
    """Every sample under ``src``: directories in sorted order, top-down. One directory held at a time."""
    for dirpath, dirnames, _ in os.walk(src, onerror=_raise):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        rel = Path(dirpath).relative_to(src).as_posix()
        yield from _directory_samples(Path(dirpath), "" if rel == "." else rel)


def _survey(src: Path) -> int:
    """Check every name first (so a bad file fails before anything is written); total bytes."""
    if not src.is_dir():
        raise FileNotFoundError(f"source directory {str(src)!r} does not exist" if not src.exists()
                                else f"source {str(src)!r} is not a directory")
    total = files = 0
    for _, members in _walk(src):
        files += len(members)
        total += sum(path.stat().st_size for _, path in members)
    if not files:
        raise IndexFormatError(f"source directory {str(src)!r} has no files to pack")
    return total


async def pack_directory(src_dir: str | os.PathLike, store: Store, *, shard_size: int = DEFAULT_SHARD_SIZE,
                         progress: bool = True) -> Index:
    """Pack the files under ``src_dir`` into shards plus index in ``store``; returns the index.

    Files are grouped into samples by WebDataset naming (``dir/KEY.FIELD``: key = path
    up to the first dot of the file name, field = the rest, lowercased), in sorted,
    deterministic order. Dot-files and dot-directories are skipped. A file without an
    extension or two files with the same field in one sample is an ``IndexFormatError``.
    shard_size: target shard size in bytes (see ``write_shards``).
    """
    src = Path(src_dir)
    total = await asyncio.to_thread(_survey, src)
    samples = ((key, [(field, path.read_bytes()) for field, path in members]) for key, members in _walk(src))
    return await write_shards(store, samples, shard_size=shard_size, total_bytes=total, desc="pack",
                              progress=progress)


async def _store_samples(src: Store, index: Index, max_bytes: int, max_samples: int) -> AsyncIterator[Sample]:
    """The samples of a loose-object index, in order, each read whole from ``src``; reads run
    ahead by at most ``max_samples`` samples and ``max_bytes`` bytes (but always one sample)."""
    async def fetch(i: int) -> Sample:
        members = index.lookup([i])
        paths = [index.shards[code] for code in members.shard.tolist()]
        datas = await asyncio.gather(*(src.read(path) for path in paths))
        return index.key(i), [(index.fields[f], data) for f, data in zip(members.field.tolist(), datas)]

    def sample_sizes() -> Iterator[tuple[int, int]]:
        for lo in range(0, len(index), 4096):  # looked up a slice at a time: the index may be huge
            members = index.lookup(np.arange(lo, min(lo + 4096, len(index))))
            yield from enumerate(np.bincount(members.position, weights=members.size).astype(int).tolist(), lo)

    upcoming = sample_sizes()
    waiting = next(upcoming, None)
    pending: deque[tuple[asyncio.Task, int]] = deque()
    ahead = 0
    try:
        while waiting is not None or pending:
            while waiting is not None and len(pending) < max_samples and (
                    not pending or ahead + waiting[1] <= max_bytes):
                pending.append((asyncio.create_task(fetch(waiting[0])), waiting[1]))
                ahead += waiting[1]
                waiting = next(upcoming, None)
            task, size = pending.popleft()
            sample = await task
            ahead -= size
            yield sample
    finally:
        for task, _ in pending:
            task.cancel()
        await asyncio.gather(*(task for task, _ in pending), return_exceptions=True)


async def pack_store(src: Store, dest: Store, *, shard_size: int = DEFAULT_SHARD_SIZE, progress: bool = True,
                     max_read_ahead: int = 256 << 20, max_reads: int = 64) -> Index:
    """Pack the loose objects under ``src`` (``KEY.FIELD`` objects, grouped as ``layouts.py``
    does) into shards plus index in ``dest``, streamed: no local copy, memory bounded by
    ``max_read_ahead`` (objects being read) plus one upload part."""
    if (dest.url.rstrip("/") + "/").startswith(src.url.rstrip("/") + "/"):
        raise ValueError(f"the destination {dest.url} lies inside the source {src.url}: "
                         "packing would read its own shards")
    await refuse_existing(dest)
    index = await index_objects(src, progress=progress)
    return await write_shards(dest, _store_samples(src, index, max_read_ahead, max_reads), shard_size=shard_size,
                              total_bytes=index.total_bytes, desc="pack", progress=progress)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("src", metavar="SRC", help="directory of KEY.FIELD files (subdirectories kept in keys), "
                                                   "or a store URL (s3://bucket/prefix) of such objects")
    parser.add_argument("dest", metavar="DEST_URL", help="new dataset root: s3://bucket/prefix, file:///dir or a path")
    parser.add_argument("--shard-size", default="64MiB",
                        help="target shard size, e.g. 64MiB (default)")
    parser.add_argument("--part-size", default="64MiB",
                        help="S3 destination: shards larger than this are uploaded in parts of this size "
                             "(5MiB..5GiB; default 64MiB), the memory a shard takes while written")


def run(args: argparse.Namespace) -> int:
    shard_size = parse_size(args.shard_size)

    dest_options = {"part_size": parse_size(args.part_size)} if args.dest.startswith("s3://") else {}

    async def main() -> Index:
        async with open_store(args.dest, **dest_options) as store:
            if "://" not in args.src:
                return await pack_directory(args.src, store, shard_size=shard_size, progress=args.progress)
            async with open_store(args.src) as src:
                return await pack_store(src, store, shard_size=shard_size, progress=args.progress)

    started = time.monotonic()
    index = asyncio.run(main())
    print(f"packed {index.summary()} to {args.dest} in {time.monotonic() - started:.1f}s")
    return 0
