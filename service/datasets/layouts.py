"""Layouts: how the objects under a dataset's root become its index.

    tar      WebDataset tar shards; members found by reading their headers (``tarscan.py``)
    objects  one object per member, as s3torchconnector users keep data: ``a/0001.jpg`` and
             ``a/0001.cls`` are the fields ``jpg`` and ``cls`` of sample ``a/0001``. The
             index comes from a listing of the prefix (no object is read); each member is
             a whole object (its "shard", offset 0), so the planner, coalescer and stream
             serve it like a shard member, and the block cache keeps it whole.

``shardfeed index`` writes either (``--objects`` for the second); ``shardfeed serve
--index-objects`` builds the second at start for a dataset without ``index.parquet``.
"""

from __future__ import annotations

import asyncio

import pyarrow as pa
from tqdm import tqdm

from shardfeed.service.datasets.index import Index
from shardfeed.service.datasets.indexfile import (
    INDEX_FILE, LAYOUT_KEY, SCHEMA, VERSION, VERSION_KEY, IndexFormatError, split_member_name,
)
from shardfeed.service.stores import ObjectInfo, Store


def objects_table(infos: list[ObjectInfo]) -> pa.Table:
    """Index rows of the objects layout: samples numbered in key order, fields in name order."""
    samples: dict[str, list[tuple[str, str, int]]] = {}
    for info in infos:
        parts = split_member_name(info.path)
        if parts is None or info.path == INDEX_FILE:  # no extension: WebDataset skips it too
            continue
        key, field = parts
        samples.setdefault(key, []).append((field, info.path, info.size))
    rows: dict[str, list] = {name: [] for name in SCHEMA.names}
    for sample, key in enumerate(sorted(samples)):
        for field, path, size in sorted(samples[key]):
            rows["sample"].append(sample)
            rows["key"].append(key)
            rows["field"].append(field)
            rows["shard"].append(path)
            rows["offset"].append(0)
            rows["size"].append(size)
    return pa.table(rows, schema=SCHEMA.with_metadata({VERSION_KEY: VERSION, LAYOUT_KEY: b"objects"}))


async def list_objects(store: Store, *, prefix: str = "", progress: bool = True) -> list[ObjectInfo]:
    """Every object under ``store`` (and ``prefix``): path, size and version, from a paged listing."""
    infos: list[ObjectInfo] = []
    with tqdm(unit=" objects", desc="list", disable=None if progress else True) as bar:
        async for page in store.list_pages(prefix):
            infos.extend(page)
            bar.update(len(page))
    return infos


async def index_objects(store: Store, *, progress: bool = True, listing: list[ObjectInfo] | None = None) -> Index:
    """Build (not write) the index of the loose objects under ``store``, from ``listing`` or a
    listing made now."""
    infos = listing if listing is not None else await list_objects(store, progress=progress)
    table = objects_table(infos)
    if table.num_rows == 0:
        raise IndexFormatError(f"{store.url}: no objects named KEY.FIELD found")
    return await asyncio.to_thread(Index.from_table, table)
