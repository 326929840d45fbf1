"""Datasets without ``index.parquet``: indexed when they open (tar shards; a peer's, MDS or LitData).

A dataset registered (``POST /v1/datasets``, or ``serve --dataset``) whose root holds
``.tar`` shards but no index is indexed from the shards' headers (``tarscan.py``: a few
ranged reads per shard, never their data), with its progress on the status page. The
index is written beside the shards when the store takes it, so that every later open,
on any node, reads it as usual; where the prefix is read-only it is kept in the
service's index directory instead, named by the dataset's URL and its shards' versions:
the next open of the same shards (a restart, another worker) reads it from there, and a
shard replaced in the store makes a new one.

A peer's dataset (an ``index.json``: ``peerindex.py``) is indexed from its shards' headers
and always kept here (``index_records``), never written beside the peer's files.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import logging
import os
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

from shardfeed.service.cache.names import dataset_id
from shardfeed.service.datasets.index import (
    Index, Share, index_from_parquet, index_version, parquet_bytes, read_index, unshared, write_index,
)
from shardfeed.service.datasets.indexfile import INDEX_FILE
from shardfeed.service.datasets.peerindex import index_records
from shardfeed.service.datasets.records import PeerLayout
from shardfeed.service.datasets.tarscan import index_shards
from shardfeed.service.stores import ObjectInfo, ObjectNotFound, Store, StoreError

log = logging.getLogger("shardfeed.datasets")


@dataclass
class IndexProgress:
    """How far the indexing of one dataset's shards is (``update`` is called with bytes covered)."""

    shards: int = 0
    bytes: int = 0
    done: int = 0
    began: float = field(default_factory=time.time)

    def update(self, covered: int) -> None:
        self.done += covered

    def info(self) -> dict:
        return {"shards": self.shards, "bytes": self.bytes, "done": self.done,
                "fraction": self.done / self.bytes if self.bytes else 0.0, "seconds": time.time() - self.began}


class IndexKeeper:
    """Indexes tar shards that have no index, keeping the result in the store or ``directory``."""

    def __init__(self, directory: Path, share: Share = unshared):
        self.directory = directory
        self.share = share
        """Kept indexes are read through it (``mapped.py``: once per host)."""

    async def index(self, store: Store, listing: list[ObjectInfo], progress: IndexProgress | None = None,
                    ) -> tuple[Index, ObjectInfo | None]:
        """The index of the ``.tar`` shards in ``listing`` (the store root's), and the version of
        ``index.parquet`` when it went to the store (None when kept here)."""
        shards = sorted((info for info in listing if info.path.endswith(".tar")), key=lambda info: info.path)
        if not shards:
            raise ObjectNotFound(f"{store.url} holds neither {INDEX_FILE} nor .tar shards (index loose objects "
                                 "with `shardfeed index --objects`, or pack files with `shardfeed pack`)")
        kept = self.directory / f"{dataset_id(store.url)}-{_versions_digest(shards)}.parquet"
        async with locked(kept.with_suffix(".lock")):  # one indexer per host; the others read its index
            if kept.exists():
                return await self.share(store.url, kept.name, partial(asyncio.to_thread, read_kept, kept)), None
            with contextlib.suppress(ObjectNotFound):
                return await read_index(store, self.share)
            return await self._index(store, shards, kept, progress or IndexProgress())

    async def _index(self, store: Store, shards: list[ObjectInfo], kept: Path, progress: IndexProgress,
                     ) -> tuple[Index, ObjectInfo | None]:
        progress.shards, progress.bytes = len(shards), sum(info.size for info in shards)
        log.info("indexing %s: %d tar shards, %d bytes, headers only", store.url, len(shards), progress.bytes)
        index = await index_shards(store, infos=shards, progress=False, meter=progress)

        async def built() -> Index:
            return index

        try:
            await write_index(store, index)
            listed = await store.head(INDEX_FILE)
        except StoreError as err:  # a read-only prefix: keep it ourselves
            log.info("index of %s kept in %s (the store did not take it: %s)", store.url, kept, err)
        else:
            return await self.share(store.url, index_version(listed), built), listed
        data = await asyncio.to_thread(parquet_bytes, index.to_table())
        await asyncio.to_thread(write_atomically, kept, data)
        return await self.share(store.url, kept.name, built), None


    async def index_records(self, store: Store, layout: PeerLayout, infos: list[ObjectInfo],
                            progress: IndexProgress | None = None) -> Index:
        """The index of a peer's shards (``peerindex.py``), ``infos`` the versions of its
        ``index.json`` and shards (the objects holding them, in ``layout``'s order): kept here,
        never in the store, named by those versions, so that a peer's writer that replaces the
        dataset (knowing nothing of ours) never finds a stale index beside it."""
        kept = self.directory / f"{dataset_id(store.url)}-{_versions_digest(infos)}.parquet"
        async with locked(kept.with_suffix(".lock")):
            if kept.exists():
                return await self.share(store.url, kept.name, partial(asyncio.to_thread, read_kept, kept))
            progress = progress or IndexProgress()
            progress.shards = progress.bytes = len(layout.shards)  # counted in shard headers read
            log.info("indexing %s: %d %s shards, headers only", store.url, len(layout.shards), layout.format.layout)
            index = await index_records(store, layout, [info.size for info in infos[1:]], meter=progress)
            data = await asyncio.to_thread(parquet_bytes, index.to_table())
            await asyncio.to_thread(write_atomically, kept, data)

            async def built() -> Index:
                return index

            return await self.share(store.url, kept.name, built)


def read_kept(kept: Path) -> Index:
    return index_from_parquet(kept.read_bytes(), str(kept))


@contextlib.asynccontextmanager
async def locked(path: Path) -> AsyncIterator[None]:
    """Hold an ``flock`` on ``path`` (polled: no thread waits on it), released by the kernel
    should this process die."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                await asyncio.sleep(0.1)
        yield
    finally:
        os.close(fd)


def _versions_digest(shards: list[ObjectInfo]) -> str:
    digest = hashlib.sha1()
    for info in shards:
        digest.update(f"{info.path}\0{info.etag}\0{info.size}\n".encode())
    return digest.hexdigest()[:16]


def write_atomically(path: Path, data: bytes) -> None:
    """``path`` holds ``data`` whole or keeps what it held: readers never see half of it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    with os.fdopen(fd, "wb") as out:
        out.write(data)
    os.replace(temp, path)
