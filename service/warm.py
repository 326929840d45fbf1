"""The lean warm path: frame a group of members straight from blocks held in RAM.

When every block a group needs is in the RAM tier (``memtier.py``), the group needs no
read at all: no thread hop, no future, no copy of a payload. Each member is a
``memoryview`` slice of its block, and in a WebDataset shard the member's own 512-byte
header sits right before its data; where that header already names the member exactly
as the batch does (``<key>.<field>``, same size, a plain file), header and data go out
as one verbatim range and no header is built. Otherwise (a PAX long name, a different
case or name, a member split across blocks) the header is built as usual.
"""

from __future__ import annotations

import numpy as np

from shardfeed.tar import BLOCK, member_header, names_member

from .cache import BlockKey
from .coalescer import Coalescer
from .datasets import Dataset
from .index import Members


class HeldGroup:
    """The RAM-held blocks of one group of member rows, and how to frame each row from them."""

    def __init__(self, blocks: dict[tuple[int, int], memoryview], members: Members, block_size: int):
        self.blocks = blocks
        self.block_size = block_size
        self.shard = members.shard.tolist()
        self.offset = members.offset.tolist()
        self.size = members.size.tolist()

    def frame(self, row: int, name: str) -> list:
        """Header and payload of member ``row`` named ``name`` (padding is the caller's)."""
        size, offset = self.size[row], self.offset[row]
        if size == 0:
            return [member_header(name, 0)]
        bs = self.block_size
        first = offset // bs
        local = offset - first * bs
        block = self.blocks[(self.shard[row], first)]
        if local + size <= bs:
            header = local - BLOCK
            if header >= 0 and names_member(block.obj, header, name.encode(), size):
                return [block[header:local + size]]
            return [member_header(name, size), block[local:local + size]]
        parts = [member_header(name, size), block[local:]]  # a member over several blocks
        end = offset + size
        for number in range(first + 1, (end - 1) // bs + 1):
            parts.append(self.blocks[(self.shard[row], number)][:min(bs, end - number * bs)])
        return parts


def held_group(coalescer: Coalescer, dataset: Dataset, members: Members) -> HeldGroup | None:
    """The group's blocks if the RAM tier holds every one (and this host owns them); else ``None``."""
    if coalescer.memory is None:
        return None
    rows = np.flatnonzero(members.found & (members.size > 0))
    if coalescer.cluster is not None and len(rows):
        owners = coalescer.cluster.owners(dataset.url, dataset.index.shards, members.shard[rows])
        if (coalescer.cluster.host_of(owners) != coalescer.cluster.host).any():  # siblings' blocks: siblings.py
            return None
    bs = coalescer.block_size
    first = members.offset[rows] // bs
    last = (members.offset[rows] + members.size[rows] - 1) // bs
    shard = members.shard[rows].astype(np.int64)
    pairs = set(zip(shard.tolist(), first.tolist()))
    for r in np.flatnonzero(last > first).tolist():
        pairs.update((int(shard[r]), b) for b in range(int(first[r]) + 1, int(last[r]) + 1))
    ids = dataset.shard_ids
    keys = {pair: BlockKey(dataset.id, ids[pair[0]], pair[1]) for pair in pairs}
    held = coalescer.held_blocks(keys.values(), all_or_none=True)
    if len(held) != len(keys):
        return None
    return HeldGroup({pair: held[key] for pair, key in keys.items()}, members, bs)


def held_member(coalescer: Coalescer, dataset: Dataset, shard: int, offset: int, size: int) -> memoryview | None:
    """One member's bytes if they lie in one RAM-held block (and this host owns the shard)."""
    if coalescer.memory is None:
        return None
    if coalescer.cluster is not None and int(coalescer.cluster.host_of(coalescer.cluster.owners(
            dataset.url, dataset.index.shards, np.array([shard])))[0]) != coalescer.cluster.host:
        return None
    bs = coalescer.block_size
    number = offset // bs
    local = offset - number * bs
    if local + size > bs:
        return None
    held = coalescer.held_blocks([BlockKey(dataset.id, dataset.shard_ids[shard], number)])
    return next(iter(held.values()))[local:local + size] if held else None
