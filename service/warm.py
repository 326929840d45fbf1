"""The lean warm path: frame a group of members straight from blocks held in RAM.

When every block a group needs is in the RAM tier (``memtier.py``), the group needs no
read at all: no thread hop, no future, no copy of a payload. Each member is a
``memoryview`` slice of its block. In a WebDataset shard the member's own 512-byte header
sits right before its data and its padding right after; where that header names the
member exactly as a batch does (``<key>.<field>``, same size, a plain file), header, data
and padding go out as one verbatim range, and nothing is built per member. Otherwise
(a PAX long name, a different case or name, a member split across blocks, another API's
names) the header is built as usual.

Whether a shard's header names its member is a fact about the shard, so it is checked
once per member and remembered (``HeaderMemo``): a warm batch of verbatim members is a
list of slices, sized and cut with numpy, and costs no Python work per byte or per name.
"""

from __future__ import annotations

import weakref

import numpy as np

from shardfeed.tar import BLOCK, member_header, names_member, padding

from .cache import BlockKey
from .coalescer import Coalescer
from .datasets import Dataset
from .index import Index, Members

_UNKNOWN, _VERBATIM, _BUILT = 0, 1, 2
_ZEROS = bytes(BLOCK)


class HeaderMemo:
    """Per index member: whether the shard's own header names it ``<key>.<field>`` exactly.

    One byte per member of the index (bounded by it), learnt the first time a member is
    framed from RAM; it lives as long as its ``Index``, so a reloaded dataset starts afresh.
    """

    _memos: weakref.WeakKeyDictionary[Index, np.ndarray] = weakref.WeakKeyDictionary()

    @classmethod
    def named(cls, dataset: Dataset, members: Members, blocks: list[memoryview], block: np.ndarray,
              header: np.ndarray) -> np.ndarray:
        """bool per row: at ``header`` in its first block (-1: not there) is the member's own
        header, naming it as a batch does."""
        named = np.zeros(len(members), bool)
        candidate = np.flatnonzero((members.row >= 0) & (members.size > 0) & (header >= 0))
        if not len(candidate):
            return named
        index = dataset.index
        memo = cls._memos.get(index)
        if memo is None:
            memo = cls._memos[index] = np.zeros(index.members, np.uint8)
        state = memo[members.row[candidate]]
        unknown = candidate[state == _UNKNOWN]
        if len(unknown):
            keys = index.keys(members.sample[unknown])
            fields = index.fields
            for r, key, field in zip(unknown.tolist(), keys, members.field[unknown].tolist()):
                found = names_member(blocks[block[r]].obj, int(header[r]), f"{key}.{fields[field]}".encode(),
                                     int(members.size[r]))
                memo[members.row[r]] = _VERBATIM if found else _BUILT
            state = memo[members.row[candidate]]
        named[candidate[state == _VERBATIM]] = True
        return named


BUILT, VERBATIM, VERBATIM_SPILLED = 0, 1, 2
"""How a held row goes out: a header built for it, then its data; its shard's own range (header,
data, padding) in one block; or that range over several blocks."""


class HeldGroup:
    """The RAM-held blocks of a batch's member rows, and how to frame each row from them."""

    def __init__(self, blocks: dict[tuple[int, int], memoryview], members: Members, block_size: int,
                 dataset: Dataset):
        self.blocks = blocks
        self.block_size = block_size
        self.shard = members.shard.tolist()
        self.offset = members.offset.tolist()
        self.size = members.size.tolist()
        # Each row's first block, and its verbatim range from there (header, data, padding).
        views = list(blocks.values())
        number = {pair: i for i, pair in enumerate(blocks)}
        first = members.offset // block_size
        block = np.array([number.get(pair, 0) for pair in zip(self.shard, first.tolist())], np.int64)
        local = members.offset - first * block_size
        start = local - BLOCK
        stop = local + members.size + (-members.size % BLOCK)
        self.kind = np.full(len(members), BUILT, np.int8)
        if views:
            lengths = np.array([len(v) for v in views], np.int64)
            named = HeaderMemo.named(dataset, members, views, block, start)
            self.kind[named] = np.where(stop[named] <= lengths[block[named]], VERBATIM, VERBATIM_SPILLED)
        self._views = views
        self._block, self._start, self._stop = block.tolist(), start.tolist(), stop.tolist()
        self._range_bytes = stop - start

    def runs(self, lo: int, hi: int) -> list[tuple[int, int, int]]:
        """Rows ``[lo, hi)`` as runs ``(start, stop, kind)`` of rows of one kind."""
        if hi <= lo:
            return []
        kind = self.kind
        cuts = (np.flatnonzero(np.diff(kind[lo:hi])) + 1 + lo).tolist()
        bounds = [lo, *cuts, hi]
        return [(a, z, int(kind[a])) for a, z in zip(bounds, bounds[1:])]

    def verbatim_bytes(self, rows: np.ndarray) -> int:
        """The bytes of the verbatim ranges of ``rows`` (a mask of rows of a verbatim kind)."""
        return int(self._range_bytes[rows].sum())

    def ranges(self, lo: int, hi: int) -> list[memoryview]:
        """The tar bytes of rows ``[lo, hi)``, all ``VERBATIM``: one slice per member."""
        views = self._views
        return [views[b][a:z] for b, a, z in zip(self._block[lo:hi], self._start[lo:hi], self._stop[lo:hi])]

    def spilled(self, row: int) -> list:
        """The tar bytes of a ``VERBATIM_SPILLED`` row: its header and data over consecutive
        blocks, then its padding (zeros, as in the shard: the block after its data may not be held)."""
        data = self.data(row)
        local = self.offset[row] % self.block_size
        return [self._views[self._block[row]][self._start[row]:local + len(data[0])], *data[1:],
                _ZEROS[:padding(self.size[row])]]

    def frame(self, row: int, name: str) -> list:
        """Header and payload of member ``row`` named ``name``, without its padding (the caller's)."""
        return [member_header(name, self.size[row]), *self.data(row)]

    def data(self, row: int) -> list[memoryview]:
        """The payload of member ``row``, as slices of one or more blocks (none when empty)."""
        size, offset = self.size[row], self.offset[row]
        if size == 0:
            return []
        bs = self.block_size
        first = offset // bs
        local = offset - first * bs
        block = self.blocks[(self.shard[row], first)]
        if local + size <= bs:
            return [block[local:local + size]]
        parts = [block[local:]]  # a member over several blocks
        end = offset + size
        for number in range(first + 1, (end - 1) // bs + 1):
            parts.append(self.blocks[(self.shard[row], number)][:min(bs, end - number * bs)])
        return parts


def held_group(coalescer: Coalescer, dataset: Dataset, members: Members) -> HeldGroup | None:
    """The group's blocks if the RAM tier holds every one (and this replica owns them); else ``None``."""
    if coalescer.memory is None:
        return None
    rows = np.flatnonzero(members.found & (members.size > 0))
    if coalescer.cluster is not None and len(rows):
        owners = coalescer.cluster.owners(dataset.url, dataset.index.shards, members.shard[rows])
        if (owners != coalescer.cluster.me).any():
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
    return HeldGroup({pair: held[key] for pair, key in keys.items()}, members, bs, dataset)


def held_member(coalescer: Coalescer, dataset: Dataset, shard: int, offset: int, size: int) -> memoryview | None:
    """One member's bytes if they lie in one RAM-held block (and this replica owns the shard)."""
    if coalescer.memory is None:
        return None
    if coalescer.cluster is not None and int(coalescer.cluster.owners(
            dataset.url, dataset.index.shards, np.array([shard]))[0]) != coalescer.cluster.me:
        return None
    bs = coalescer.block_size
    number = offset // bs
    local = offset - number * bs
    if local + size > bs:
        return None
    held = coalescer.held_blocks([BlockKey(dataset.id, dataset.shard_ids[shard], number)])
    return next(iter(held.values()))[local:local + size] if held else None
