"""A served dataset: its store, its index, and the per-shard facts the coalescer needs.

A dataset is opened from one listing of its shards' prefix, which names every shard's
version (``ObjectInfo.etag``, ``stores/base.py``): the index is read at the version its
HEAD names, each
shard's blocks are cached under a name that includes its version (``cache.shard_id``),
and every store read of a shard is conditional on that version. A dataset that changes
in the store is opened again (``served.py``); the old ``Dataset`` keeps reading its own
versions, or fails, and never mixes the two.
"""

from __future__ import annotations

import hashlib
import posixpath
import time
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from shardfeed.service.cache.names import dataset_id, shard_id
from shardfeed.service.datasets import layouts
from shardfeed.service.datasets.autoindex import IndexKeeper, IndexProgress
from shardfeed.service.datasets.index import Index, Share, read_index, unshared
from shardfeed.service.datasets.indexfile import IndexFormatError
from shardfeed.service.datasets.peerindex import PEER_INDEX, index_records, read_peer_layout, shard_store
from shardfeed.service.datasets.records import RecordFormat
from shardfeed.service.stores import ObjectChanged, ObjectInfo, ObjectNotFound, Store, open_store

OPEN_ATTEMPTS = 3
"""Reads of the index when it changes between its HEAD and its read."""


@dataclass
class Dataset:
    name: str
    url: str
    store: Store
    index: Index
    id: str
    """Short stable id of the URL: names the dataset's blocks in the cache."""
    extents: np.ndarray
    """Per shard code, the end of its last member's data: reads never go past it."""
    shard_ids: list[str]
    """Per shard code, the shard's name in the cache (``cache.shard_id``: path and version)."""
    shard_samples: int
    """Samples in a typical shard (``Index.shard_samples``)."""
    owned: bool = True
    """Whether replicas split its shards by owner; ``False`` for a view made for one request
    (GetBatch), which the peers do not know: read where it was asked."""
    versions: list[str | None] = field(default_factory=list)
    """Per shard code, the version every read of it asks for (``None``: unconditional)."""
    version: str = ""
    """The index's and every shard's version, digested: equal on every node that opened the same bytes."""
    checked: float = 0.0
    """When (Unix time) the store was last listed for this dataset."""
    root: Store | None = None
    """The store at its URL, which a reopening lists: ``store`` itself, or what ``store`` reads
    through (a peer's compressed shards: ``stores/compressed.py``)."""
    encodings: dict[str, str] = field(default_factory=dict)
    """Each field's encoding, where its layout names one (MDS, LitData: what ``decode=`` decodes by)."""
    records: RecordFormat | None = None
    """The columns of its records, when its index holds records rather than fields (MDS,
    LitData's records: ``records.py``; ``read/fields.py`` places the fields)."""

    @cached_property
    def stored_bytes(self) -> int:
        """Bytes of its shards the service may read: the sum of ``extents``."""
        return int(self.extents.sum())

    def shard_version(self, shard: int) -> str | None:
        return self.versions[shard] if self.versions else None

    def info(self) -> dict:
        return {
            "name": self.name,
            "url": self.url,
            "samples": len(self.index),
            "shards": len(self.index.shards),
            "bytes": self.index.total_bytes,
            "shard_samples": self.shard_samples,
            "fields": self.index.fields,
            "layout": self.index.layout,
            "encodings": self.encodings,
            "version": self.version,
            "checked": self.checked,
        }


async def open_dataset(name: str, url: str, store_options: dict | None = None, *,
                       index_objects: bool = False, store: Store | None = None,
                       keeper: IndexKeeper | None = None, progress: IndexProgress | None = None,
                       share: Share = unshared) -> Dataset:
    """Open the store at ``url`` (or use ``store``, already open there) and load its index at
    the version listed (``StoreError``/``IndexFormatError`` if bad).

    Without ``index.parquet``: with ``index_objects``, index the loose objects under ``url``
    now (the ``objects`` layout, ``layouts.py``), in memory, from the same listing; else with
    a ``keeper``, index its tar shards (``autoindex.py``, its advance told to ``progress``).
    An ``index.parquet`` is read through ``share`` (``mapped.py``: once per host).
    """
    own_store = store is None
    store = open_store(url, **(store_options or {})) if own_store else store
    try:
        opened = await _index_and_versions(store, index_objects, keeper, progress, share)
    except BaseException:
        if own_store:
            await store.close()
        raise
    index, listed = opened.index, opened.listed
    shards = [opened.objects.get(path) for path in index.shards]
    return Dataset(
        name=name, url=url, store=opened.store or store, root=store, index=index, id=dataset_id(url),
        encodings=opened.encodings, records=opened.records,
        extents=index.shard_extents(),
        shard_ids=[shard_id(path, *_version(info)) for path, info in zip(index.shards, shards)],
        shard_samples=index.shard_samples(),
        versions=[info.etag if info is not None else None for info in shards],
        version=_digest(listed, shards), checked=time.time(),
    )


@dataclass
class _Opened:
    index: Index
    listed: ObjectInfo | None
    """The version of the index read (``index.parquet``, or a peer's ``index.json``)."""
    objects: dict[str, ObjectInfo]
    """The version of each shard, by its name in the index."""
    encodings: dict[str, str] = field(default_factory=dict)
    records: RecordFormat | None = None
    store: Store | None = None
    """What reads its shards, when not the root's store (a peer's compressed shards)."""


async def _index_and_versions(store: Store, index_objects: bool, keeper: IndexKeeper | None,
                              progress: IndexProgress | None, share: Share) -> _Opened:
    """The index (read at the version a HEAD names), that version, and a listing of the
    shards' common prefix: one page per 1,000 shards, whatever else the root holds."""
    for attempt in range(OPEN_ATTEMPTS):
        try:
            index, listed = await read_index(store, share)
            break
        except ObjectChanged:  # replaced between its HEAD and its read: again
            if attempt == OPEN_ATTEMPTS - 1:
                raise
        except ObjectNotFound:
            listing = await layouts.list_objects(store, progress=False)
            peer = next((info for info in listing if info.path == PEER_INDEX), None)
            if peer is not None:
                return await _open_peer(store, peer, listing, keeper, progress)
            if not index_objects and keeper is None:
                raise
            if index_objects:
                index, listed = await layouts.index_objects(store, listing=listing), None
            else:
                index, listed = await keeper.index(store, listing, progress)
            return _Opened(index, listed, {i.path: i for i in listing})
    # A key prefix, not a directory: S3 and the file store both list by string prefix.
    listing = await layouts.list_objects(store, prefix=posixpath.commonprefix(index.shards), progress=False)
    return _Opened(index, listed, {info.path: info for info in listing})


async def _open_peer(store: Store, peer: ObjectInfo, listing: list[ObjectInfo], keeper: IndexKeeper | None,
                     progress: IndexProgress | None) -> _Opened:
    """A peer's dataset (``peerindex.py``): its layout from ``peer`` (its ``index.json``), its
    shards' versions those of the objects holding them, its index built or kept; its fields
    placed in their records by the read path unless the index holds the fields' own extents
    (LitData's Arrow footers)."""
    layout = await read_peer_layout(store, peer, listing)
    infos = {info.path: info for info in listing}
    for shard in layout.shards:
        if shard.stored not in infos:
            raise IndexFormatError(f"{store.url}/{peer.path} names shard {shard.stored!r}, which the store lacks")
    shards = shard_store(store, layout)
    stored = [infos[shard.stored] for shard in layout.shards]
    index = await (keeper.index_records(shards, layout, [peer, *stored], progress) if keeper is not None
                   else index_records(shards, layout, [info.size for info in stored]))
    return _Opened(index, peer, {shard.name: info for shard, info in zip(layout.shards, stored)},
                   layout.format.encodings, layout.format if index.records else None, shards)


def _version(info: ObjectInfo | None) -> tuple[str | None, int | None]:
    return (info.etag, info.size) if info is not None else (None, None)


def _digest(index: ObjectInfo | None, shards: list[ObjectInfo | None]) -> str:
    digest = hashlib.sha1()
    for info in [index, *shards]:
        digest.update(repr(_version(info)).encode())
    return digest.hexdigest()[:12]
