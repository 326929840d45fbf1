"""A served dataset: its store, its index, and the per-shard facts the coalescer needs."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow.compute as pc

from .cache import dataset_id
from .index import Index, load_index
from .stores import Store, open_store


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
    field_codes: dict[str, int]

    def info(self) -> dict:
        return {
            "name": self.name,
            "url": self.url,
            "samples": len(self.index),
            "shards": len(self.index.shards),
            "bytes": self.index.total_bytes,
            "fields": self.index.fields,
        }


def shard_extents(index: Index) -> np.ndarray:
    table = index.to_table()
    ends = pc.add(table["offset"], table["size"])
    grouped = table.select(["shard"]).append_column("end", ends).group_by("shard").aggregate([("end", "max")])
    extents = np.zeros(len(index.shards), dtype=np.int64)
    code = {path: i for i, path in enumerate(index.shards)}
    for path, end in zip(grouped["shard"].to_pylist(), grouped["end_max"].to_pylist()):
        extents[code[path]] = end
    return extents


async def open_dataset(name: str, url: str, store_options: dict | None = None) -> Dataset:
    """Open the store at ``url`` and load its index (``StoreError``/``IndexFormatError`` if bad)."""
    store = open_store(url, **(store_options or {}))
    try:
        index = await load_index(store)
    except BaseException:
        await store.close()
        raise
    return Dataset(
        name=name, url=url, store=store, index=index, id=dataset_id(url),
        extents=shard_extents(index), field_codes={f: i for i, f in enumerate(index.fields)},
    )
