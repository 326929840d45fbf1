"""Where GetBatch entries live: plain objects by name, files inside tar shards by archpath.

An entry becomes a ``Span``: an object of an allowed bucket, that object's size, and the
byte range wanted from it. The coalescer then reads it like a shard member (blocks,
cache, singleflight), with the object's full size as its extent.

Sizes and versions come from a HEAD per object, remembered in a bounded LRU (``max_objects``)
for at most ``object_ttl`` seconds (``--object-ttl``), so an object overwritten in the store is
read at its new version within that time; a read that finds it replaced sooner forgets
the HEAD at once (``forget``). A
LIST would answer for a whole prefix, but an entry names one object under any prefix
and the listing may be huge; a whole-object GET would need no size, but could not be
planned into blocks, so it would bypass the cache and the coalescing of concurrent
requests. An object of a served loose-object dataset needs no HEAD: its index has the
size (``Index.layout`` ``objects``) and its listing the version. Blocks of an object are
cached under its version, and every read of them asks for it (``If-Match``): a replaced
object is never served from its old blocks, nor as a mix of two versions.

A file inside a shard: the shard's member table comes from the index of a served tar
dataset that holds the shard, else from one scan of the shard's headers (``tarscan.py``'s
windowed scan), kept in a bounded LRU of member tables (``max_members`` in all).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import urlparse

from shardfeed.buffers import BufferPool
from shardfeed.service.datasets.dataset import Dataset
from shardfeed.service.datasets.tarscan import scan_shard
from shardfeed.service.stores import AccessDenied, Arrived, InvalidPath, ObjectInfo, ObjectNotFound, Store
from shardfeed.service.stores.lru import Lru


@dataclass(frozen=True)
class Span:
    bucket: str
    key: str
    extent: int  # the object's size: every read of its blocks stops there
    offset: int
    size: int
    home: tuple[Dataset, int] | None = None
    """The served dataset and shard code that index these bytes: read through that dataset,
    they share its cached blocks (and its replica owners)."""
    version: str | None = None
    """The object's version (``ObjectInfo.etag``): its blocks are cached under it, and reads ask for it."""
    row: int = -1
    """Its member row in ``home``'s index (-1: none): a record layout's field is placed from it."""

    @property
    def path(self) -> str:
        """The object's path in ``BucketStores``."""
        return f"{self.bucket}/{self.key}"


class EntryMissing(LookupError):
    """The object, the shard, or the file inside the shard does not exist."""


class BucketStores(Store):
    """The allowed buckets as one read-only store: path ``<bucket>/<key>``.

    GetBatch entries of several buckets are one batch, so the coalescer reads them through
    one store; each bucket keeps its own (hedged) store, opened at start.
    """

    url = "s3://"

    def __init__(self, stores: dict[str, Store]):
        self.stores = stores

    def _split(self, path: str) -> tuple[Store, str]:
        bucket, _, key = path.partition("/")
        store = self.stores.get(bucket)
        if store is None:
            raise InvalidPath(f"bucket {bucket!r} is not served")
        return store, key

    async def read_range(self, path: str, offset: int, size: int, version: str | None = None) -> bytes:
        store, key = self._split(path)
        return await store.read_range(key, offset, size, version)

    async def read_pieces(self, path: str, offset: int, size: int, piece: int,
                          version: str | None = None, *, arrived: Arrived | None = None,
                          buffers: BufferPool | None = None) -> list[bytes]:
        store, key = self._split(path)
        return await store.read_pieces(key, offset, size, piece, version, arrived=arrived, buffers=buffers)

    async def read(self, path: str, version: str | None = None) -> bytes:
        store, key = self._split(path)
        return await store.read(key, version)

    async def head(self, path: str) -> ObjectInfo:
        store, key = self._split(path)
        return await store.head(key)

    async def write(self, path: str, data: bytes) -> None:
        raise AccessDenied(f"{path}: GetBatch buckets are read-only")

    async def list(self, prefix: str = "") -> list[ObjectInfo]:
        store, key = self._split(prefix)
        return await store.list(key)

    async def close(self) -> None:
        for store in self.stores.values():
            await store.close()


class Catalog:
    """Locates entries in the allowed buckets; served datasets lend their indexes."""

    def __init__(self, buckets: BucketStores, datasets: Mapping[str, Dataset], *, max_objects: int = 1 << 18,
                 max_members: int = 1 << 20, scan_window: int = 1 << 20, max_lookups: int = 64,
                 object_ttl: float = math.inf):
        """max_objects: HEADs remembered (about 200 bytes each), each for ``object_ttl``
        seconds; max_members: shard members remembered over all scanned shards (about 150
        bytes each); max_lookups: HEADs and scans in flight."""
        self.buckets = buckets
        self.stores = buckets.stores
        self._served = _served_roots(datasets)
        self._scan_window = scan_window
        self._lookups = asyncio.Semaphore(max_lookups)
        self._objects: Lru[tuple[str, str], ObjectInfo] = Lru(self._head, max_objects, ttl=object_ttl)
        # (members by name, whether a served index gave them) per version of a shard
        self._tables: Lru[tuple[str, ObjectInfo], tuple[dict[str, tuple[int, int]], bool]] = Lru(
            self._member_table, max_members, weight=lambda table: max(1, len(table[0])))

    def serve(self, datasets: Mapping[str, Dataset]) -> None:
        """Lend the indexes of ``datasets`` from now on (a dataset was reopened)."""
        self._served = _served_roots(datasets)

    def forget(self, bucket: str, key: str) -> None:
        """Drop what a HEAD said of an object (a read found it replaced): the next entry asks again."""
        self._objects.forget((bucket, key))

    def known(self, bucket: str, key: str, archpath: str) -> Span | None:
        """``locate`` without waiting, when everything it needs is at hand (``None`` otherwise):
        a warm batch then costs no task per entry."""
        loose = self._loose(bucket, key)
        if loose is not None and not archpath:
            return loose
        info = self._objects.peek((bucket, key)) if loose is None else _info(loose)
        if info is None:
            return None
        if not archpath:
            return _whole(bucket, key, info)
        table = self._tables.peek((bucket, info))
        return None if table is None else self._member(bucket, key, info, archpath, table)

    async def locate(self, bucket: str, key: str, archpath: str) -> Span:
        """The bytes of an entry; ``EntryMissing``, or ``StoreError`` when the store fails."""
        loose = self._loose(bucket, key)
        if loose is not None and not archpath:
            return loose
        info = _info(loose) if loose is not None else await self._objects.get((bucket, key))
        if not archpath:
            return _whole(bucket, key, info)
        span = self._member(bucket, key, info, archpath, await self._tables.get((bucket, info)))
        if span is None:
            raise EntryMissing(f"{key}/{archpath}")
        return span

    def _member(self, bucket: str, key: str, info: ObjectInfo, archpath: str,
                table: tuple[dict[str, tuple[int, int, int]], bool]) -> Span | None:
        members, indexed = table
        member = members.get(archpath)
        if member is None:
            return None
        offset, size, row = member
        return Span(bucket, key, info.size, offset, size, home=self._home(bucket, key) if indexed else None,
                    version=info.etag, row=row)

    def _home(self, bucket: str, key: str) -> tuple[Dataset, int] | None:
        """The served dataset that has ``key`` as a shard (a loose object: a member), and its code."""
        for dataset, rel in self._owners(bucket, key):
            code = dataset.index.shard_code(rel)
            if code is not None:
                return dataset, code
        return None

    def _loose(self, bucket: str, key: str) -> Span | None:
        """A loose object of a served dataset, whole: its index has the size, its listing the version."""
        home = self._home(bucket, key)
        if home is None or home[0].index.layout != "objects":
            return None
        size = int(home[0].extents[home[1]])
        return Span(bucket, key, size, 0, size, home=home, version=home[0].shard_version(home[1]))

    async def _head(self, where: tuple[str, str]) -> ObjectInfo:
        bucket, key = where
        async with self._lookups:
            try:
                return await self.stores[bucket].head(key)
            except ObjectNotFound:
                raise EntryMissing(key) from None

    async def _member_table(self, where: tuple[str, ObjectInfo]) -> tuple[dict[str, tuple[int, int, int]], bool]:
        bucket, info = where
        home = self._home(bucket, info.path)
        if home is not None and home[0].index.layout != "objects":  # a shard the index knows
            return home[0].index.shard_members(home[0].index.shards[home[1]]), True
        async with self._lookups:
            try:
                scan = await scan_shard(self.stores[bucket], info, self._scan_window)
            except ValueError as err:  # not a tar file, truncated, corrupt header
                raise EntryMissing(f"{info.path}: {err}") from None
        table: dict[str, tuple[int, int, int]] = {}
        for name, offset, size in zip(scan.names, scan.offsets, scan.sizes):
            table.setdefault(name, (offset, size, -1))
        return table, False

    def _owners(self, bucket: str, key: str):
        """Served datasets whose root holds ``key``, with its path relative to that root."""
        for prefix, dataset in self._served.get(bucket, ()):
            if not prefix:
                yield dataset, key
            elif key.startswith(prefix + "/"):
                yield dataset, key[len(prefix) + 1:]


def _whole(bucket: str, key: str, info: ObjectInfo) -> Span:
    return Span(bucket, key, info.size, 0, info.size, version=info.etag)


def _info(span: Span) -> ObjectInfo:
    """What a HEAD would say of the object of ``span``, a whole loose object of a served dataset."""
    return ObjectInfo(span.key, span.extent, span.version)


def _served_roots(datasets: Mapping[str, Dataset]) -> dict[str, list[tuple[str, Dataset]]]:
    """Served S3 datasets by bucket, with their key prefix."""
    roots: dict[str, list[tuple[str, Dataset]]] = {}
    for dataset in datasets.values():
        url = urlparse(dataset.url)
        if url.scheme == "s3":
            roots.setdefault(url.netloc, []).append((url.path.strip("/"), dataset))
    return roots

