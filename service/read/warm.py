"""The lean warm path: a group's blocks all held in RAM, and where each member lies in them.

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
from functools import cached_property

import numpy as np

from shardfeed.service.cache.names import BlockKey
from shardfeed.service.datasets.dataset import Dataset
from shardfeed.service.datasets.index import Index, Members
from shardfeed.service.datasets.mapped import member_scratch
from shardfeed.service.read.coalescer import Coalescer
from shardfeed.tar import BLOCK, names_member

_UNKNOWN, _VERBATIM, _BUILT = 0, 1, 2


class HeaderMemo:
    """Per index member: whether the shard's own header names it ``<key>.<field>`` exactly.

    One byte per member of the index (bounded by it), learnt the first time a member is
    framed from RAM, by any worker of the host for all of them when the index is mapped
    (``mapped.member_scratch``); one per ``Index`` and dataset version, so a reloaded dataset
    starts afresh.
    """

    _memos: weakref.WeakKeyDictionary[Index, np.ndarray] = weakref.WeakKeyDictionary()

    @classmethod
    def named(cls, dataset: Dataset, members: Members, held: np.ndarray, blocks: list[memoryview],
              block: np.ndarray, header: np.ndarray) -> np.ndarray:
        """bool per row: a ``held`` row (a mask) whose own header, at ``header`` in its first
        block (negative: not there), names it as a batch does."""
        candidate = held & (members.row >= 0) & (header >= 0)
        if not candidate.any():  # e.g. members of no index (GetBatch's objects), whose memo is empty
            return candidate
        index = dataset.index
        memo = cls._memos.get(index)
        if memo is None:
            memo = cls._memos[index] = member_scratch(index, f"headers-{dataset.version}")
        state = np.where(candidate, memo[members.row], _BUILT)  # row -1 reads a state masked out here
        unknown = np.flatnonzero(state == _UNKNOWN)
        if len(unknown):
            keys = index.keys(members.sample[unknown])
            fields = index.fields
            for r, key, field in zip(unknown.tolist(), keys, members.field[unknown].tolist()):
                found = names_member(blocks[block[r]], int(header[r]), f"{key}.{fields[field]}".encode(),
                                     int(members.size[r]))
                memo[members.row[r]] = _VERBATIM if found else _BUILT
            state = np.where(candidate, memo[members.row], _BUILT)
        return state == _VERBATIM


BUILT, VERBATIM, VERBATIM_SPILLED = 0, 1, 2
"""How a held row goes out: a header built for it, then its data; its shard's own range (header,
data, padding) in one block; or that range over several blocks."""


_NUMBER_BITS = 32
"""A block of a dataset is one int64, ``shard << _NUMBER_BITS | number`` (a shard has fewer than
2**32 blocks): a batch's distinct blocks are then one ``np.unique``, not a set of tuples."""
_NUMBER_MASK = (1 << _NUMBER_BITS) - 1


def _code(shard: np.ndarray, number: np.ndarray) -> np.ndarray:
    return (shard.astype(np.int64) << _NUMBER_BITS) | number


class _Layout:
    """Where each member row lies in its shard's blocks (all arrays by row)."""

    def __init__(self, members: Members, block_size: int):
        self.members = members
        self.block_size = block_size
        first, self.local = np.divmod(members.offset, block_size)  # the data's offset in its first block
        self.first = _code(members.shard, first)  # its first block
        self.end = self.local + members.size  # its data's end, counted from there

    def blocks(self, held: np.ndarray) -> np.ndarray:
        """The distinct blocks that the ``held`` rows (a mask) lie in, as sorted ``_code``s."""
        code = self.first if held.all() else self.first[held]
        over = np.flatnonzero(self.end > self.block_size)  # members over several blocks (never an empty one)
        if len(over):  # each block after their first (a few rows: fewer numpy calls in a loop)
            more = ((self.end[over] - 1) // self.block_size).tolist()
            code = np.concatenate([code, [first + k for first, n in zip(self.first[over].tolist(), more)
                                          for k in range(1, n + 1)]])
        return _distinct(code)


def _distinct(codes: np.ndarray) -> np.ndarray:
    """``np.unique(codes)``, several times faster on a batch's few hundred codes (numpy 2's
    ``unique`` hashes them before it sorts)."""
    codes = np.sort(codes)
    keep = np.empty(len(codes), bool)
    keep[:1] = True
    np.not_equal(codes[1:], codes[:-1], out=keep[1:])
    return codes[keep]


class HeldGroup:
    """The RAM-held blocks of a batch's member rows, and how to frame each row from them.

    ``codes``: the distinct blocks of the ``held`` rows (sorted ``_code``s); ``views``: those
    blocks, in that order. What only members framed one by one need (per-row lists, blocks by
    code) is made on first use: a batch of verbatim members never needs it."""

    def __init__(self, layout: _Layout, held: np.ndarray, codes: np.ndarray, views: list[memoryview],
                 dataset: Dataset):
        members = self._members = layout.members
        self.block_size = layout.block_size
        self._codes = codes
        self._views = views
        self._held, self._dataset = held, dataset
        # Each row's first block, and its verbatim range from there (header, data, padding).
        block = np.searchsorted(codes, layout.first)
        if views:
            np.minimum(block, len(views) - 1, out=block)  # rows not held point past the end: any block will do
        self._block = block
        self._start = layout.local - BLOCK
        self._stop = layout.end + (-members.size % BLOCK)
        self._range_bytes = self._stop - self._start

    @cached_property
    def kind(self) -> np.ndarray:
        """Per row, how it goes out in a tar (``BUILT``, ``VERBATIM``, ``VERBATIM_SPILLED``): asked
        only by the tar framing (the Arrow one sends payloads alone)."""
        views = self._views
        if not views:
            return np.full(len(self._members), BUILT)
        lengths = np.fromiter(map(len, views), np.int64, len(views))
        kind = np.where(self._stop <= lengths[self._block], VERBATIM, VERBATIM_SPILLED)
        kind[~HeaderMemo.named(self._dataset, self._members, self._held, views, self._block, self._start)] = BUILT
        return kind

    @cached_property
    def shard(self) -> list[int]:
        return self._members.shard.tolist()

    @cached_property
    def offset(self) -> list[int]:
        return self._members.offset.tolist()

    @cached_property
    def size(self) -> list[int]:
        """Per row, its payload size (lists: members framed one by one read them row by row)."""
        return self._members.size.tolist()

    @cached_property
    def _block_of_code(self) -> dict[int, memoryview]:
        return dict(zip(self._codes.tolist(), self._views))

    def runs(self, lo: int, hi: int) -> list[tuple[int, int, int]]:
        """Rows ``[lo, hi)`` as runs ``(start, stop, kind)`` of rows of one kind."""
        if hi <= lo:
            return []
        kind = self.kind
        cuts = (np.flatnonzero(kind[lo + 1:hi] != kind[lo:hi - 1]) + 1 + lo).tolist()
        bounds = [lo, *cuts, hi]
        return [(a, z, int(kind[a])) for a, z in zip(bounds, bounds[1:])]

    def verbatim_bytes(self, rows: np.ndarray | None = None) -> int:
        """The bytes of the verbatim ranges of ``rows`` (a mask of rows of a verbatim kind; all rows
        by default)."""
        return int((self._range_bytes if rows is None else self._range_bytes[rows]).sum())

    def ranges(self, lo: int, hi: int) -> list[memoryview]:
        """The tar bytes of rows ``[lo, hi)``, all ``VERBATIM``: one slice per member."""
        views = self._views
        return [views[b][a:z] for b, a, z in zip(self._block[lo:hi].tolist(), self._start[lo:hi].tolist(),
                                                 self._stop[lo:hi].tolist())]

    def spilled(self, row: int) -> list[memoryview]:
        """The shard's own header and data of a ``VERBATIM_SPILLED`` row, over consecutive blocks
        (its padding is the framer's: the block after its data may not be held)."""
        data = self.data(row)
        local = self.offset[row] % self.block_size
        return [self._views[int(self._block[row])][int(self._start[row]):local + len(data[0])], *data[1:]]

    def payloads(self, rows: np.ndarray) -> list[memoryview]:
        """The payloads of member ``rows`` one after another, as slices of their blocks: one per
        member in one block (cut with numpy, not row by row), several for one over blocks, none for
        an empty one."""
        local = self._start[rows] + BLOCK
        end = local + self._members.size[rows]
        views = self._views
        out = [views[b][a:z] for b, a, z in zip(self._block[rows].tolist(), local.tolist(), end.tolist())]
        others = np.flatnonzero((end > self.block_size) | (end == local))  # over blocks, or empty
        for k in others[::-1].tolist():  # from the last: the places before it stay put
            out[k:k + 1] = self.data(int(rows[k]))
        return out

    def data(self, row: int) -> list[memoryview]:
        """The payload of member ``row``, as slices of one or more blocks (none when empty)."""
        size, offset = self.size[row], self.offset[row]
        if size == 0:
            return []
        bs = self.block_size
        first = offset // bs
        local = offset - first * bs
        shard = self.shard[row] << _NUMBER_BITS
        block = self._block_of_code[shard | first]
        if local + size <= bs:
            return [block[local:local + size]]
        parts = [block[local:]]  # a member over several blocks
        end = offset + size
        for number in range(first + 1, (end - 1) // bs + 1):
            parts.append(self._block_of_code[shard | number][:min(bs, end - number * bs)])
        return parts


def held_group(coalescer: Coalescer, dataset: Dataset, members: Members) -> HeldGroup | None:
    """The group's blocks if the RAM tier holds every one (and this host owns them); else ``None``."""
    if coalescer.memory is None:
        return None
    held = members.found & (members.size > 0)  # rows with bytes in a block
    if coalescer.cluster is not None and held.any():
        owners = coalescer.cluster.owners(dataset.url, dataset.index.shards, members.shard[held])
        if (coalescer.cluster.host_of(owners) != coalescer.cluster.host).any():  # siblings' blocks: siblings.py
            return None
    layout = _Layout(members, coalescer.block_size)
    codes = layout.blocks(held)
    ids = dataset.shard_ids
    new_key = tuple.__new__  # BlockKey(...) would run its Python __new__ once per block
    keys = [new_key(BlockKey, (dataset.id, ids[shard], number))
            for shard, number in zip((codes >> _NUMBER_BITS).tolist(), (codes & _NUMBER_MASK).tolist())]
    views = coalescer.held_blocks(keys, all_or_none=True)
    if len(views) != len(keys):
        return None
    return HeldGroup(layout, held, codes, list(views.values()), dataset)


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
