"""``shardfeed pack``: write samples into uncompressed tar shards plus ``index.parquet``.

``write_shards`` is the one shard writer (``pack`` and the seeders use it): it streams
samples into shards of about ``shard_size``, never splitting a sample, uploads each as
it is laid out (S3: in parts, so memory stays at about one upload part), and writes the
index last, so an interrupted run leaves no index that points at missing data. The
source is a directory of files or a store of loose objects (``pack s3://a s3://b``).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from collections import deque
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
from tqdm import tqdm

from shardfeed.tar import END_OF_ARCHIVE, member_header, padding

from .index import INDEX_FILE, SCHEMA, Index, IndexFormatError, split_member_name, write_index
from .layouts import index_objects
from .sizes import parse_size
from .stores import ObjectNotFound, Store, open_store

Sample = tuple[str, list[tuple[str, bytes]]]
"""``(key, [(field, data), ...])``: one sample, members in the order they are written."""

DEFAULT_SHARD_SIZE = 64 << 20


def shard_name(n: int) -> str:
    return f"shard-{n:06d}.tar"


class _ShardWriter:
    """Lays samples out as tar shards, one shard at a time, as a stream of chunks: a shard
    never holds more than its store's upload part in memory (``Store.write_stream``)."""

    def __init__(self, samples: AsyncIterator[Sample], shard_size: int, bar: tqdm):
        self._samples = samples
        self._shard_size = shard_size
        self._bar = bar
        self._held: Sample | None = None  # the sample that did not fit in the previous shard
        self.next_sample = 0

    async def next_shard(self) -> bool:
        """Whether any sample is left for another shard."""
        if self._held is None:
            self._held = await anext(self._samples, None)
        return self._held is not None

    async def chunks(self, name: str, rows: dict[str, list]) -> AsyncIterator[bytes]:
        """The bytes of shard ``name``; its index rows are appended to ``rows`` as they go out."""
        length = 0
        while True:
            sample = self._held or await anext(self._samples, None)
            self._held = None
            if sample is None:
                break
            key, members = sample
            if not members:
                raise ValueError(f"sample {key!r} has no members")
            for field, _ in members:
                if split_member_name(f"{key}.{field}") != (key, field):  # re-indexing must give it back
                    raise ValueError(f"cannot name a member {key!r} + {field!r} in WebDataset style "
                                     "(no dot in the key's file name, lowercase field)")
            headers = [member_header(f"{key}.{field}", len(data)) for field, data in members]
            need = sum(len(h) + len(d) + padding(len(d)) for h, (_, d) in zip(headers, members))
            if length and length + need + len(END_OF_ARCHIVE) > self._shard_size:
                self._held = sample  # never split a sample: it opens the next shard
                break
            parts = []
            for header, (field, data) in zip(headers, members):
                length += len(header)
                for column, value in (("sample", self.next_sample), ("key", key), ("field", field),
                                      ("shard", name), ("offset", length), ("size", len(data))):
                    rows[column].append(value)
                parts += (header, data, bytes(padding(len(data))))
                length += len(data) + padding(len(data))
            self.next_sample += 1
            self._bar.update(sum(len(d) for _, d in members))
            yield b"".join(parts)
        yield END_OF_ARCHIVE


async def _in_thread(samples: Iterable[Sample]) -> AsyncIterator[Sample]:
    """A blocking iterator (files on disk, generated data) pulled in a worker thread."""
    it = iter(samples)
    while (sample := await asyncio.to_thread(next, it, None)) is not None:
        yield sample


async def _refuse_existing(store: Store) -> None:
    """Writing shards over a dataset would silently invalidate its index: refuse instead."""
    try:
        await store.head(INDEX_FILE)
    except ObjectNotFound:
        return
    raise FileExistsError(f"{store.url} already holds a dataset ({INDEX_FILE}); choose an empty destination")


async def write_shards(store: Store, samples: Iterable[Sample] | AsyncIterable[Sample], *,
                       shard_size: int = DEFAULT_SHARD_SIZE, total_bytes: int | None = None, desc: str = "write",
                       progress: bool = True) -> Index:
    """Write ``samples`` as ``shard-000000.tar``, ... plus ``index.parquet`` (last), and return the index.

    shard_size: target shard size in bytes; a shard holds whole samples only, so one
    sample larger than this gets a shard of its own.
    total_bytes: payload bytes expected, for the progress bar.
    progress: show a tqdm bar (payload bytes) on stderr when it is a terminal.
    A plain iterator of ``samples`` is consumed in a worker thread, so it may do blocking I/O.
    Refuses (``FileExistsError``) a destination that already has an ``index.parquet``.
    """
    if shard_size < 1:
        raise ValueError(f"shard size must be positive, not {shard_size}")
    await _refuse_existing(store)
    source = samples if isinstance(samples, AsyncIterable) else _in_thread(samples)
    tables = []
    with tqdm(total=total_bytes, unit="B", unit_scale=True, unit_divisor=1024, desc=desc,
              disable=None if progress else True) as bar:
        writer = _ShardWriter(aiter(source), shard_size, bar)
        while await writer.next_shard():
            rows: dict[str, list] = {c: [] for c in SCHEMA.names}
            await store.write_stream(shard_name(len(tables)), writer.chunks(shard_name(len(tables)), rows))
            tables.append(pa.table(rows, schema=SCHEMA))
    if not tables:
        raise IndexFormatError(f"{store.url}: no samples to write")
    index = await asyncio.to_thread(lambda: Index.from_table(pa.concat_tables(tables)))
    await write_index(store, index)
    return index


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
    await _refuse_existing(dest)
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
