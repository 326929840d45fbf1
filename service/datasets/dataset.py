"""A served dataset: its store, its index, and the per-shard facts the coalescer needs."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from shardfeed.service.cache.disk import dataset_id, shard_id
from shardfeed.service.datasets import layouts
from shardfeed.service.datasets.index import Index, load_index
from shardfeed.service.stores import ObjectNotFound, Store, open_store


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
    """Per shard code, the shard's name in the cache (``cache.shard_id``)."""
    shard_samples: int
    """Samples in a typical shard (``Index.shard_samples``)."""
    owned: bool = True
    """Whether replicas split its shards by owner; ``False`` for a view made for one request
    (GetBatch), which the peers do not know: read where it was asked."""

    @cached_property
    def stored_bytes(self) -> int:
        """Bytes of its shards the service may read: the sum of ``extents``."""
        return int(self.extents.sum())

    def info(self) -> dict:
        return {
            "name": self.name,
            "url": self.url,
            "samples": len(self.index),
            "shards": len(self.index.shards),
            "bytes": self.index.total_bytes,
            "shard_samples": self.shard_samples,
            "fields": self.index.fields,
        }


async def open_dataset(name: str, url: str, store_options: dict | None = None, *,
                       index_objects: bool = False) -> Dataset:
    """Open the store at ``url`` and load its index (``StoreError``/``IndexFormatError`` if bad).

    index_objects: without ``index.parquet``, index the loose objects under ``url`` now
    (the ``objects`` layout, ``layouts.py``), in memory.
    """
    store = open_store(url, **(store_options or {}))
    try:
        try:
            index = await load_index(store)
        except ObjectNotFound:
            if not index_objects:
                raise
            index = await layouts.index_objects(store)
    except BaseException:
        await store.close()
        raise
    return Dataset(
        name=name, url=url, store=store, index=index, id=dataset_id(url),
        extents=index.shard_extents(),
        shard_ids=[shard_id(path) for path in index.shards], shard_samples=index.shard_samples(),
    )
