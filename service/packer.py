"""``shardfeed pack``: write samples into uncompressed tar shards plus ``index.parquet``.

``write_shards`` is the one shard writer (``pack`` and the seeders use it): it fills a
shard of about ``shard_size`` in a thread, never splitting a sample, uploads it, and
writes the index last, so an interrupted run leaves no index that points at missing
data. Memory stays at about one shard.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import pyarrow as pa
from tqdm import tqdm

from shardfeed.tar import END_OF_ARCHIVE, member_header, padding

from .index import INDEX_FILE, SCHEMA, Index, IndexFormatError, split_member_name, write_index
from .sizes import parse_size
from .stores import ObjectNotFound, Store, open_store

Sample = tuple[str, list[tuple[str, bytes]]]
"""``(key, [(field, data), ...])``: one sample, members in the order they are written."""

DEFAULT_SHARD_SIZE = 64 << 20


def shard_name(n: int) -> str:
    return f"shard-{n:06d}.tar"


class _ShardBuilder:
    """Pulls samples from an iterator and lays them out as tar shards (CPU and file I/O: runs in a thread)."""

    def __init__(self, samples: Iterator[Sample], shard_size: int, bar: tqdm):
        self._samples = samples
        self._shard_size = shard_size
        self._bar = bar
        self._held: Sample | None = None  # the sample that did not fit in the previous shard
        self.next_sample = 0

    def build(self, name: str) -> tuple[bytes, pa.Table] | None:
        """The next shard's bytes and index rows, or ``None`` when the samples are exhausted."""
        parts: list[bytes] = []
        length = 0
        rows: dict[str, list] = {c: [] for c in SCHEMA.names}
        while True:
            sample = self._held or next(self._samples, None)
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
            for header, (field, data) in zip(headers, members):
                length += len(header)
                for column, value in (("sample", self.next_sample), ("key", key), ("field", field),
                                      ("shard", name), ("offset", length), ("size", len(data))):
                    rows[column].append(value)
                parts += (header, data, bytes(padding(len(data))))
                length += len(data) + padding(len(data))
            self.next_sample += 1
            self._bar.update(sum(len(d) for _, d in members))
        if not length:
            return None
        parts.append(END_OF_ARCHIVE)
        return b"".join(parts), pa.table(rows, schema=SCHEMA)


async def _refuse_existing(store: Store) -> None:
    """Writing shards over a dataset would silently invalidate its index: refuse instead."""
    try:
        await store.head(INDEX_FILE)
    except ObjectNotFound:
        return
    raise FileExistsError(f"{store.url} already holds a dataset ({INDEX_FILE}); choose an empty destination")


async def write_shards(store: Store, samples: Iterable[Sample], *, shard_size: int = DEFAULT_SHARD_SIZE,
                       total_bytes: int | None = None, desc: str = "write", progress: bool = True) -> Index:
    """Write ``samples`` as ``shard-000000.tar``, ... plus ``index.parquet`` (last), and return the index.

    shard_size: target shard size in bytes; a shard holds whole samples only, so one
    sample larger than this gets a shard of its own.
    total_bytes: payload bytes expected, for the progress bar.
    progress: show a tqdm bar (payload bytes) on stderr when it is a terminal.
    The ``samples`` iterator is consumed in a worker thread, so it may do blocking I/O.
    Refuses (``FileExistsError``) a destination that already has an ``index.parquet``.
    """
    if shard_size < 1:
        raise ValueError(f"shard size must be positive, not {shard_size}")
    await _refuse_existing(store)
    tables = []
    with tqdm(total=total_bytes, unit="B", unit_scale=True, unit_divisor=1024, desc=desc,
              disable=None if progress else True) as bar:
        builder = _ShardBuilder(iter(samples), shard_size, bar)
        while built := await asyncio.to_thread(builder.build, shard_name(len(tables))):
            data, table = built
            await store.write(shard_name(len(tables)), data)
            del data, built  # free this shard before the next one is built
            tables.append(table)
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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("src", metavar="SRC_DIR", help="directory of KEY.FIELD files (subdirectories kept in keys)")
    parser.add_argument("dest", metavar="DEST_URL", help="new dataset root: s3://bucket/prefix, file:///dir or a path")
    parser.add_argument("--shard-size", default="64MiB",
                        help="target shard size, e.g. 64MiB (default)")


def run(args: argparse.Namespace) -> int:
    shard_size = parse_size(args.shard_size)

    async def main() -> Index:
        async with open_store(args.dest) as store:
            return await pack_directory(args.src, store, shard_size=shard_size, progress=args.progress)

    started = time.monotonic()
    index = asyncio.run(main())
    print(f"packed {index.summary()} to {args.dest} in {time.monotonic() - started:.1f}s")
    return 0
