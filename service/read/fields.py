"""Fields of records: where each member a batch wants lies in its record, for the layouts whose
index holds records, not fields (MDS, LitData: ``datasets/records.py``).

The first batch to read a record reads its header (a few bytes at the record's start) and learns
its fields' sizes, kept per index member for every process of the host (``mapped.member_scratch``:
4 bytes a member, the size plus one, 0 until learnt). It reads them from the RAM tier when that
holds them (``placed_from_ram``: a plan read the records ahead), deciding without awaiting as the
warm path does; else through the coalescer (``located``), the records' whole blocks asked for at
once. From then on ``known`` places the record's members with numpy alone. A dataset whose index
holds its fields' own extents (tar shards, loose objects, LitData's Arrow-footer chunks) has
nothing to learn: its members pass as they are.
"""

from __future__ import annotations

import weakref

import numpy as np

from shardfeed.service.datasets.dataset import Dataset
from shardfeed.service.datasets.index import Index, Members
from shardfeed.service.datasets.mapped import member_scratch
from shardfeed.service.read.coalescer import Coalescer
from shardfeed.service.read.planner import joined
from shardfeed.service.read.warm import held_group
from shardfeed.service.stores import StoreError

_memos: weakref.WeakKeyDictionary[Index, np.ndarray] = weakref.WeakKeyDictionary()


def _memo(dataset: Dataset) -> np.ndarray:
    memo = _memos.get(dataset.index)
    if memo is None:
        memo = _memos[dataset.index] = member_scratch(dataset.index, f"fields-{dataset.version}", np.uint32)
    return memo


def _record_rows(dataset: Dataset, members: Members) -> tuple[np.ndarray, np.ndarray]:
    """Per member: its record's first index row, and its column (its row's place after it)."""
    first = dataset.index.first_rows(members.sample).astype(np.int64)
    return first, members.row - first


def known(dataset: Dataset, members: Members) -> Members | None:
    """``members`` at their fields' own extents, or None while a record's header is not learnt."""
    records = dataset.records
    if records is None or not len(members):
        return members
    first, column = _record_rows(dataset, members)
    k = len(records.columns)
    sizes = _memo(dataset)[first[:, None] + np.arange(k)].astype(np.int64) - 1
    if (sizes < 0).any():
        return None
    before = np.cumsum(sizes, axis=1) - sizes
    rows = np.arange(len(members))
    return Members(position=members.position, sample=members.sample, field=members.field, shard=members.shard,
                   offset=members.offset + records.header_bytes + before[rows, column],
                   size=sizes[rows, column], found=members.found, row=members.row)


def known_member(dataset: Dataset, sample: int, field: str) -> tuple[int, int, int] | None:
    """``Index.member``: ``(shard code, offset, size)`` of one member, at its field's own extent;
    None when the sample has no such field or its record's header is not learnt yet."""
    member = dataset.index.member(sample, field)
    if member is None or dataset.records is None:
        return member
    code = dataset.index.field_codes([field])
    members = Members(position=np.zeros(1, np.int64), sample=np.array([sample]), field=code,
                      shard=np.array([member[0]]), offset=np.array([member[1]]), size=np.array([member[2]]),
                      found=np.ones(1, bool), row=dataset.index.first_rows(np.array([sample])).astype(np.int64)
                      + dataset.index.sample_fields(sample).index(field))
    placed = known(dataset, members)
    return None if placed is None else (member[0], int(placed.offset[0]), int(placed.size[0]))


def placed_from_ram(coalescer: Coalescer, dataset: Dataset, members: Members) -> Members | None:
    """``known``, the headers of records not learnt yet read from the RAM tier when it holds them
    all (blocks read ahead by a plan, or by an earlier batch), without waiting: how a batch
    decides on the warm path. None when a header is not in RAM."""
    found = known(dataset, members)
    if found is not None:
        return found
    heads, extents = _heads(dataset, members)
    held = held_group(coalescer, dataset, heads)
    if held is None:
        return None
    _learn(dataset, heads, extents, [b"".join(held.data(i)) for i in range(len(heads))])
    return known(dataset, members)


async def located(coalescer: Coalescer, dataset: Dataset, members: Members) -> Members:
    """``members`` at their fields' own extents, the headers of records not learnt yet read now
    (their whole records' blocks asked for at once). Raises the ``StoreError`` of a header that
    could not be read, and ``IndexFormatError`` naming a shard whose record disagrees with it."""
    found = known(dataset, members)
    if found is not None:
        return found
    heads, extents = _heads(dataset, members)
    if dataset.records.header_bytes:
        coalescer.prefetch(dataset, members)
    payloads = await coalescer.read_members(dataset, heads)
    for payload in payloads:
        if isinstance(payload, StoreError):
            raise payload
    _learn(dataset, heads, extents, payloads)
    return known(dataset, members)


def _heads(dataset: Dataset, members: Members) -> tuple[Members, np.ndarray]:
    """One member per record of ``members`` not learnt yet, its header's bytes (its ``row``: the
    record's first index row), and each record's whole size."""
    first, _ = _record_rows(dataset, members)
    unknown = _memo(dataset)[first] == 0
    rows, at = np.unique(first[unknown], return_index=True)
    wanted = np.flatnonzero(unknown)[at]
    n = len(rows)
    return Members(position=np.arange(n), sample=members.sample[wanted], field=members.field[wanted],
                   shard=members.shard[wanted], offset=members.offset[wanted],
                   size=np.minimum(members.size[wanted], dataset.records.header_bytes), found=np.ones(n, bool),
                   row=rows), members.size[wanted]


def _learn(dataset: Dataset, heads: Members, extents: np.ndarray, payloads: list) -> None:
    """Remember the sizes of the fields of ``heads``' records (``extents`` bytes each), from their
    headers' bytes (``payloads``: empty ones where the header holds no size); ``IndexFormatError``
    naming the shard of a record whose header disagrees with its extent."""
    records = dataset.records
    headers = np.zeros((len(heads), records.header_bytes // 4), np.uint32)
    for i, payload in enumerate(payloads):
        head = joined(payload)  # a few bytes, read as numbers: one piece even over two blocks
        if len(head) < records.header_bytes:  # a record shorter than its header: check() names it
            head += bytes(records.header_bytes - len(head))
        headers[i] = np.frombuffer(head, "<u4")
    sizes = records.sizes(headers)
    records.check(sizes, extents, heads.shard, dataset.index.shards)
    _memo(dataset)[heads.row[:, None] + np.arange(len(records.columns))] = sizes + 1
