"""The ``tar`` layout: build the index of existing WebDataset tar shards (``shardfeed index``).

Only tar headers are read, with ranged reads: read a window at a header, parse every
header that lies inside it, and when the next header lies beyond the window (member
data too large), jump straight to it. A shard larger than the window opens with a small
probe (a header and whatever follows it), and the window grows only while members are
small: then it reads ``2 * window - probe`` bytes, so the probe costs no extra request
and a shard of small members costs about ``shard_size / window`` requests. After a
member of a quarter window or more, the next read is a probe again: a shard of large
members costs one small request per member (about 6% of the bytes for 1 MiB members),
and their data is never downloaded.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol, TypeVar

import pyarrow as pa
from tqdm import tqdm

from shardfeed.service.datasets.index import Index
from shardfeed.service.datasets.indexfile import SCHEMA, IndexFormatError, split_member_name
from shardfeed.service.stores import ObjectInfo, Store
from shardfeed.tar import BLOCK, TarFormatError, padding, parse_header, parse_pax

T = TypeVar("T")
R = TypeVar("R")

_ZERO_BLOCK = bytes(BLOCK)
_PROBE = 64 << 10  # the opening read, and the read after a large member: a header and what follows
_REGULAR = (b"0", b"\0", b"7")  # regular file (old and new style), contiguous file
_MAX_LONG_NAME = 1 << 20  # a PAX / GNU long-name record larger than this is corruption, not a name


class ShardScan:
    """Header-by-header walk through one shard, fed window by window (pure CPU, runs in a thread)."""

    def __init__(self, path: str, size: int):
        self.path = path
        self.size = size
        self.pos = 0  # offset of the next header
        self.done = False
        self.last_size = 0  # size of the last member parsed: predicts the next one
        self.names: list[str] = []
        self.offsets: list[int] = []
        self.sizes: list[int] = []
        self._long_name: bytes | None = None

    def _error(self, message: str) -> IndexFormatError:
        return IndexFormatError(f"{self.path}: {message}")

    def feed(self, window: bytes, base: int) -> int:
        """Parse every header inside ``window`` (shard bytes from ``base``).

        Returns how many bytes from ``self.pos`` the next call needs (0 when done).
        """
        end = base + len(window)
        while True:
            pos = self.pos
            if pos == 0 and self.size < BLOCK:
                raise self._error(f"not a tar file (only {self.size} bytes)")
            if pos + BLOCK > self.size:
                where = "between members" if pos == self.size else f"at offset {pos}"
                raise self._error(f"truncated shard: ends {where} without the tar end-of-archive marker")
            if pos + BLOCK > end:
                return BLOCK
            block = window[pos - base:pos - base + BLOCK]
            if block == _ZERO_BLOCK:
                self.done = True
                return 0
            try:
                name, size, typeflag = parse_header(block)
            except TarFormatError:
                raise self._error("not a tar file" if pos == 0 else f"corrupt tar header at offset {pos}") from None
            start, stop = pos + BLOCK, pos + BLOCK + size
            self.last_size = size
            if stop > self.size:
                raise self._error(f"truncated shard: member {name.decode(errors='replace')!r} at offset {pos} "
                                  f"needs {stop} bytes, the shard has {self.size}")
            if typeflag in (b"x", b"L"):  # PAX / GNU long name for the next member: read its data
                if size > _MAX_LONG_NAME:
                    raise self._error(f"corrupt tar: {size}-byte extended header at offset {pos}")
                if stop > end:
                    return BLOCK + size
                data = window[start - base:stop - base]
                try:
                    self._long_name = (parse_pax(data).get(b"path", self._long_name) if typeflag == b"x"
                                       else data.rstrip(b"\0"))
                except (ValueError, IndexError):
                    raise self._error(f"corrupt PAX header at offset {pos}") from None
            elif typeflag in _REGULAR:
                self.names.append((self._long_name or name).decode(errors="replace"))
                self.offsets.append(start)
                self.sizes.append(size)
                self._long_name = None
            elif typeflag != b"g":  # directories, links, ...: not sample data
                self._long_name = None
            self.pos = stop + padding(size)

    def table(self) -> pa.Table:
        """This shard's members as index rows, samples numbered from 0 (runs of one key)."""
        samples, keys, fields, offsets, sizes = [], [], [], [], []
        current, seen, sample = None, set(), -1
        for name, offset, size in zip(self.names, self.offsets, self.sizes):
            parts = split_member_name(name)
            if parts is None:  # no extension: WebDataset skips it too
                continue
            key, field = parts
            if key != current:
                current, seen, sample = key, set(), sample + 1
            if field in seen:
                raise self._error(f"sample {key!r} has field {field!r} twice")
            seen.add(field)
            samples.append(sample)
            keys.append(key)
            fields.append(field)
            offsets.append(offset)
            sizes.append(size)
        return pa.table({"sample": pa.array(samples, pa.int64()), "key": keys, "field": fields,
                         "shard": pa.array([self.path] * len(keys), pa.string()),
                         "offset": pa.array(offsets, pa.int64()), "size": pa.array(sizes, pa.int64())},
                        schema=SCHEMA)


class Meter(Protocol):
    """What counts the bytes covered: a tqdm bar, or anything with its ``update``."""

    def update(self, n: int) -> object: ...


class _Meters:
    def __init__(self, *meters: Meter):
        self.meters = meters

    def update(self, n: int) -> None:
        for meter in self.meters:
            meter.update(n)


async def scan_shard(store: Store, info: ObjectInfo, window: int, bar: Meter | None = None) -> ShardScan:
    """Walk the headers of one shard (``ShardScan``'s names, offsets and sizes), reading only
    around them; ``bar`` counts the bytes covered."""
    scan = ShardScan(info.path, info.size)
    probe = min(window, _PROBE)
    data, base, covered = b"", 0, 0
    while need := await asyncio.to_thread(scan.feed, data, base):
        if not data:  # the first read: the whole shard if it fits in a window, else a probe
            want = info.size if info.size <= window else probe
        elif scan.last_size >= window // 4:  # large members: read the next header only
            want = probe
        else:  # small members: a whole window, plus what the opening probe did not cover
            want = 2 * window - probe if base == 0 and len(data) == probe else window
        base = scan.pos
        data = await store.read_range(info.path, base, min(info.size - base, max(want, need)), info.etag)
        if bar is not None:
            bar.update(base - covered)
        covered = base
    if bar is not None:
        bar.update(info.size - covered)
    return scan


async def bounded_map(fn: Callable[[T], Awaitable[R]], items: Sequence[T], limit: int) -> list[R]:
    """``[await fn(x) for x in items]`` with at most ``limit`` running; the first error cancels the rest."""
    results: list[R] = [None] * len(items)  # type: ignore[list-item]
    todo = iter(enumerate(items))

    async def worker() -> None:
        for i, item in todo:
            results[i] = await fn(item)

    tasks = [asyncio.ensure_future(worker()) for _ in range(min(limit, len(items)))]
    try:
        await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return results


def _number_samples(tables: list[pa.Table]) -> pa.Table:
    """Concatenate per-shard tables, renumbering samples densely across shards (in shard order)."""
    chunks, base = [], 0
    for table in tables:
        if table.num_rows == 0:
            continue
        local = table.column("sample").to_numpy()
        chunks.append(table.set_column(0, "sample", pa.array(local + base)))
        base += int(local[-1]) + 1
    return pa.concat_tables(chunks)


async def index_shards(store: Store, shards: Sequence[str] | None = None, *, infos: Sequence[ObjectInfo] = (),
                       window: int = 1 << 20, concurrency: int = 16, progress: bool = True,
                       meter: Meter | None = None) -> Index:
    """Build (not write) the index of the tar shards in ``store``, reading only their headers.

    shards: shard paths relative to the store root; default every ``*.tar`` under it, sorted.
    infos: the shards as listed already (path, size, version), instead of ``shards``.
    window: bytes fetched per ranged read; larger means fewer requests on shards of small members.
    concurrency: shards scanned at once.
    progress: show a tqdm bar (bytes of shard covered) on stderr when it is a terminal.
    meter: told those bytes too (``autoindex.IndexProgress``: the status page's).
    Raises ``IndexFormatError`` naming the shard at fault (not a tar file, truncated,
    duplicate field in a sample) or when there are no samples at all.
    """
    if window < BLOCK:
        raise ValueError(f"window must be at least {BLOCK} bytes, not {window}")
    if infos:
        infos = list(infos)
    elif shards is None:
        infos = [o for o in await store.list() if o.path.endswith(".tar")]
        if not infos:
            raise IndexFormatError(f"{store.url}: no .tar shards found")
    else:
        infos = await bounded_map(store.head, sorted(set(shards)), concurrency)
    with tqdm(total=sum(o.size for o in infos), unit="B", unit_scale=True, unit_divisor=1024,
              desc="index", disable=None if progress else True) as bar:
        meters = _Meters(bar, meter) if meter is not None else bar

        async def table(info: ObjectInfo) -> pa.Table:
            return await asyncio.to_thread((await scan_shard(store, info, window, meters)).table)

        tables = await bounded_map(table, infos, concurrency)
    if not any(t.num_rows for t in tables):
        raise IndexFormatError(f"{store.url}: the shards hold no samples")
    return await asyncio.to_thread(lambda: Index.from_table(_number_samples(tables)))
