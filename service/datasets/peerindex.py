"""The ``mds`` and ``litdata`` layouts: the index of a peer's dataset from its ``index.json`` and
its shards' own headers, with ranged reads, never a shard's data.

A dataset root whose listing holds an ``index.json`` (and no ``index.parquet``) is one of
these: ``mds.py`` and ``litdata.py`` each read their peer's ``index.json`` into a
``PeerLayout`` (the records' columns, the shards in the peer's order, how each is stored).
``index_records`` then reads each shard's header, ``4 * (samples + 2)`` bytes at its start,
``concurrency`` at a time, and checks it against ``index.json``: sample ``i`` is the
``i``-th record of the shards in ``index.json``'s order, as the peer's own dataset numbers
them, and has one index row per column, each the record's extent (``records.py``).

A LitData chunk whose records are all empty holds its items in an Arrow footer instead
(``arrowfooter.py``): its index rows are its fields' own extents, found from the footer with a
few more ranged reads, and the index says so (``indexfile.ROWS_KEY``). A dataset is one kind
or the other, never both.

Samples are keyed by their number, zero-padded (the peers have no keys). Field names are
lowercased, as for tar members.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

import numpy as np
import pyarrow as pa

from shardfeed.service.datasets import arrowfooter, litdata, mds
from shardfeed.service.datasets.arrowfooter import FooterRows
from shardfeed.service.datasets.index import Index
from shardfeed.service.datasets.indexfile import LAYOUT_KEY, ROWS_KEY, VERSION, VERSION_KEY, IndexFormatError
from shardfeed.service.datasets.records import PeerLayout, PeerShard
from shardfeed.service.datasets.tarscan import Meter, bounded_map
from shardfeed.service.stores import ObjectInfo, Store
from shardfeed.service.stores.compressed import Compressed, CompressedShards

PEER_INDEX = "index.json"
PEER_INDEX_LIMIT = 1 << 30
"""Bytes of an ``index.json`` read whole, at most (Streaming's takes ~500 bytes a shard)."""


def peer_layout(data: bytes, where: str, listed: set[str]) -> PeerLayout:
    """The layout an ``index.json`` describes (``where`` names it in errors); ``listed``: the
    paths under the root, to read a shard raw where a peer left it decompressed."""
    try:
        document = json.loads(data)
    except (ValueError, UnicodeDecodeError) as err:
        raise IndexFormatError(f"{where}: not JSON ({err})") from None
    if not isinstance(document, dict):
        raise IndexFormatError(f"{where}: not a JSON object")
    readers: dict[str, Callable[[dict, str, set[str]], PeerLayout]] = {"shards": mds.layout, "chunks": litdata.layout}
    for key, read in readers.items():
        if key in document:
            try:
                return read(document, where, listed)
            except (KeyError, TypeError, ValueError, AttributeError) as err:
                if isinstance(err, IndexFormatError):
                    raise
                raise IndexFormatError(f"{where}: malformed ({type(err).__name__}: {err})") from None
    raise IndexFormatError(f"{where}: neither an MDS index (\"shards\") nor a LitData one (\"chunks\")")


def shard_store(store: Store, layout: PeerLayout) -> Store:
    """What reads ``layout``'s shards as the index names them: ``store`` itself, or over it the
    raw shards of the compressed ones (``stores/compressed.py``)."""
    compressed = layout.compressed
    if not compressed:
        return store
    try:
        return CompressedShards(store, {
            name: Compressed(shard.stored, shard.codec, shard.raw_size, shard.frames, shard.digests)
            for name, shard in compressed.items()})
    except ValueError as err:  # a codec or a hash not understood
        raise IndexFormatError(str(err)) from None


async def read_peer_layout(store: Store, info: ObjectInfo, listing: list[ObjectInfo]) -> PeerLayout:
    if info.size > PEER_INDEX_LIMIT:
        raise IndexFormatError(f"{store.url}/{info.path}: {info.size} bytes, more than the {PEER_INDEX_LIMIT} "
                               "an index.json of a million shards takes")
    data = await store.read(info.path, info.etag)
    return peer_layout(data, f"{store.url}/{info.path}", {i.path for i in listing})


def _offsets(shard: PeerShard, header: bytes) -> np.ndarray:
    """The shard's ``samples + 1`` record offsets, checked against ``index.json``."""
    n = shard.samples
    if len(header) < 4 * (n + 2):
        raise IndexFormatError(f"{shard.name}: {len(header)} bytes, its header needs {4 * (n + 2)}")
    values = np.frombuffer(header, "<u4", n + 2).astype(np.int64)
    if values[0] != n:
        raise IndexFormatError(f"{shard.name}: its header counts {int(values[0])} samples, index.json {n}")
    offsets = values[1:]
    if offsets[0] < 4 * (n + 2) or (np.diff(offsets) < 0).any():
        raise IndexFormatError(f"{shard.name}: its header's sample offsets are not in order after the header")
    if shard.raw_size is not None and offsets[-1] > shard.raw_size:
        raise IndexFormatError(f"{shard.name}: its samples end at {int(offsets[-1])}, "
                               f"index.json sizes it at {shard.raw_size} bytes")
    return offsets


def _check_least(shard: PeerShard, offsets: np.ndarray, least: int) -> None:
    """``IndexFormatError`` for a record shorter than ``least``, the bytes of the smallest record
    the columns allow."""
    short = np.diff(offsets) < least
    if short.any():
        raise IndexFormatError(f"{shard.name}: record {int(np.flatnonzero(short)[0])} is shorter than its "
                               f"{least}-byte least (its header and fixed-size columns)")


async def index_records(store: Store, layout: PeerLayout, sizes: list[int], *, concurrency: int = 64,
                        meter: Meter | None = None) -> Index:
    """The index of ``layout``'s shards (of ``sizes`` bytes as stored, in order), from their
    headers read through ``store`` (where a compressed shard reads as its raw bytes:
    ``stores/compressed.py``), and from the Arrow footers of LitData's chunks whose records are
    empty (``arrowfooter.py``)."""
    async def rows(shard: PeerShard, size: int) -> np.ndarray | FooterRows:
        if shard.samples == 0:
            return np.zeros(1, np.int64)
        found = _offsets(shard, await store.read_range(shard.name, 0, 4 * (shard.samples + 2)))
        if layout.format.layout == "litdata" and shard.codec is None and (np.diff(found) == 0).all():
            found = await arrowfooter.footer_rows(store, shard.name, size, layout.format.columns, int(found[0]),
                                                  shard.samples)
        else:
            _check_least(shard, found, layout.format.least_bytes)
        if meter is not None:
            meter.update(1)
        return found

    per_shard = await bounded_map(lambda pair: rows(*pair), list(zip(layout.shards, sizes, strict=True)),
                                  concurrency)
    return await asyncio.to_thread(_index, layout, per_shard)


def _index(layout: PeerLayout, per_shard: list[np.ndarray | FooterRows]) -> Index:
    """The index of the shards' records (``per_shard``: each one's record offsets), or of their
    fields (each one's ``FooterRows``); ``IndexFormatError`` for a dataset of both."""
    names = [shard.name for shard in layout.shards]
    footers = [k for k, found in enumerate(per_shard) if isinstance(found, FooterRows)]
    records = [k for k, found in enumerate(per_shard) if not isinstance(found, FooterRows) and len(found) > 1]
    if footers and records:
        raise IndexFormatError(f"{names[footers[0]]} holds its items in an Arrow footer, {names[records[0]]} as "
                               "records: a dataset of both kinds of chunk is not read")
    if footers:
        return _field_index(layout, per_shard)
    k = len(layout.format.columns)
    starts = np.concatenate([o[:-1] for o in per_shard])
    sizes = np.concatenate([np.diff(o) for o in per_shard])
    n = len(starts)
    shard_of = np.repeat(np.arange(len(layout.shards)), [len(o) - 1 for o in per_shard])
    return _table(layout, np.repeat(np.arange(n, dtype=np.int64), k), np.tile(np.arange(k), n),
                  np.repeat(shard_of, k), np.repeat(starts, k), np.repeat(sizes, k), records=True)


def _field_index(layout: PeerLayout, per_shard: list[np.ndarray | FooterRows]) -> Index:
    """The index of chunks of Arrow footers (a chunk without items: its record offsets)."""
    first = np.cumsum([0, *(shard.samples for shard in layout.shards)])
    parts = [(rows.item + first[k], rows.column, np.full(len(rows.item), k), rows.offset, rows.size)
             for k, rows in enumerate(per_shard) if isinstance(rows, FooterRows)]
    sample, column, shard, offset, size = (np.concatenate(values) for values in zip(*parts))
    return _table(layout, sample, column, shard, offset, size, records=False)


def _table(layout: PeerLayout, sample: np.ndarray, column: np.ndarray, shard: np.ndarray, offset: np.ndarray,
           size: np.ndarray, *, records: bool) -> Index:
    """The index of rows ``sample``, ``column`` (in the layout's columns), ``shard`` (in its
    shards), ``offset`` and ``size``, sample after sample; ``records``: rows of records' extents."""
    n = int(sample[-1]) + 1 if len(sample) else 0
    if n == 0:
        raise IndexFormatError("the dataset's index.json lists no samples")
    width = max(6, len(str(n - 1)))
    table = pa.table({
        "sample": sample.astype(np.int64),
        "key": pa.array(np.char.zfill(np.arange(n).astype(str), width)).take(pa.array(sample)),
        "field": pa.DictionaryArray.from_arrays(column.astype(np.int32), [c.name for c in layout.format.columns]),
        "shard": pa.DictionaryArray.from_arrays(shard.astype(np.int32), [s.name for s in layout.shards]),
        "offset": offset.astype(np.int64),
        "size": size.astype(np.int64),
    }).replace_schema_metadata({VERSION_KEY: VERSION, LAYOUT_KEY: layout.format.layout.encode(),
                                ROWS_KEY: b"records" if records else b"fields"})
    return Index.from_table(table)
