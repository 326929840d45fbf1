"""The prepared cache: ``prepare``'s outputs (``pack``ed), kept in the block cache.

An entry is a block of its own, ``BlockKey(dataset, shard, sample)``:

    dataset   ``dataset_id`` of ``prepared:`` and the dataset's URL: not the dataset's own id, so
              ``BlockCache.retain`` of the dataset (which drops its replaced shards' blocks) leaves
              these alone
    shard     the sample's shard version (``Dataset.shard_ids``: path, ETag, size), the transform's
              name and ``version``, digested together
    block     the sample's place in that shard version: its first member's offset there

So an entry made from a replaced shard, or by an old version of the transform, is never found
again (its key is never asked for) and ages out under the cache's one byte budget and eviction.
The place in the shard, not the sample's number: an index made again (a shard added before
it) may give the same bytes another number, and that number to other bytes of the same shard.

Reads and writes go through the disk cache in a thread (off the event loop); an entry read from
disk a second time lately is kept in the RAM tier too (``MemoryTier.admits``), as a block is.
With no cache (``--cache-size 0``), nothing is kept.
"""

from __future__ import annotations

import asyncio
import hashlib

import numpy as np

from shardfeed.service.cache.disk import BlockCache
from shardfeed.service.cache.memtier import MemoryTier
from shardfeed.service.cache.names import BlockKey, dataset_id
from shardfeed.service.datasets.dataset import Dataset
from shardfeed.service.datasets.index import Members


class PreparedCache:
    """Prepared payloads by dataset, sample and transform, in the block cache's tiers."""

    def __init__(self, cache: BlockCache, memory: MemoryTier | None):
        self.cache = cache
        self.memory = memory

    def keys(self, dataset: Dataset, transform: str, version: str, members: Members,
             samples: int) -> list[BlockKey | None]:
        """The key of each of ``samples`` positions whose ``members`` (the transform's fields, looked
        up) were found (``None`` for one with none found: it fails, nothing to keep)."""
        prepared = dataset_id(f"prepared:{dataset.url}")
        found = np.flatnonzero(members.found)
        first = np.full(samples, np.iinfo(np.int64).max, np.int64)  # each sample's lowest member offset
        np.minimum.at(first, members.position[found], members.offset[found])
        shard = np.full(samples, -1, np.int64)
        shard[members.position[found]] = members.shard[found]  # a sample lies in one shard
        streams: dict[tuple[int, int], str] = {}
        out: list[BlockKey | None] = []
        for code, offset in zip(shard.tolist(), first.tolist()):
            if code < 0:
                out.append(None)
                continue
            high = offset >> 32  # a block number is 32 bits: a shard's every 4 GiB is a stream of its own
            stream = streams.get((code, high))
            if stream is None:
                name = f"{dataset.shard_ids[code]}\0{transform}\0{version}\0{high}"
                stream = streams[code, high] = hashlib.sha1(name.encode()).hexdigest()[:20]
            out.append(BlockKey(prepared, stream, offset & 0xFFFFFFFF))
        return out

    @property
    def keeps(self) -> bool:
        """Whether anything is kept (a cache of size 0, or a disabled one, keeps nothing)."""
        return self.cache.capacity > 0 and self.cache.writable

    async def get(self, keys: list[BlockKey]) -> list[bytes | None]:
        """Each key's payload, or ``None``: from RAM, else from disk in a thread."""
        if not self.keeps:
            return [None] * len(keys)
        found = self.memory.get_many(keys) if self.memory is not None else [None] * len(keys)
        missing = [i for i, payload in enumerate(found) if payload is None]
        if missing:
            for i, payload in zip(missing, await asyncio.to_thread(self._read, [keys[i] for i in missing])):
                found[i] = payload
        return found

    def _read(self, keys: list[BlockKey]) -> list[bytes | None]:
        out = []
        for key in keys:
            parts = self.cache.read(key, None)
            payload = None if parts is None else bytes(parts[0])
            if payload is not None and self.memory is not None and self.memory.admits(key):
                self.memory.put(key, payload)
            out.append(payload)
        return out

    async def put(self, entries: list[tuple[BlockKey, bytes]]) -> None:
        """Keep new payloads (on disk, in a thread); one the cache cannot keep is simply not kept."""
        if entries and self.keeps:
            await asyncio.to_thread(self._write, entries)

    def _write(self, entries: list[tuple[BlockKey, bytes]]) -> None:
        for key, payload in entries:
            self.cache.write(key, payload)

