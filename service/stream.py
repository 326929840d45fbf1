"""Batch responses: the requested members, framed as a tar stream in request order.

The batch is cut into groups of about ``group_bytes`` of payload along sample
boundaries. A few groups are read ahead concurrently (``prefetch_groups``) while the
oldest is sent, so the first bytes leave before the last shard range arrives, memory
per request stays bounded, and a client that reads slowly slows the reads (the send
awaits, so no further group starts).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator

import numpy as np

from shardfeed.tar import END_OF_ARCHIVE, member_header, padding

from .coalescer import Coalescer
from .datasets import Dataset
from .index import Members
from .planner import take
from .stores import StoreError
from .warm import BUILT, VERBATIM, VERBATIM_SPILLED, HeldGroup, held_group

_PAD = b"\0" * 512
HELD_GROUP_BYTES = 16 * 1024 * 1024
"""Group size of a batch held in RAM: its parts are views of held blocks, so a group costs no
memory, and fewer, larger groups cost less per sample."""
LARGE_PART = 256 * 1024
"""A part this large is sent as its own chunk, uncopied; smaller ones are joined into one."""


class SampleFailed(Exception):
    """A sample of a batch without ``continue_on_error`` could not be read."""

    def __init__(self, dataset: str, sample: int, cause: BaseException | None):
        super().__init__(f"sample {sample} of dataset {dataset!r} could not be read: {cause}")
        self.sample = sample
        self.cause = cause


def missing_name(dataset: str, sample: int) -> str:
    """The zero-length placeholder member for a sample that could not be served."""
    return f"__404__/{dataset}/{sample}"


class SampleNames:
    """``/v1/batch`` member names: ``<key>.<field>``, and ``missing_name`` for a failed sample.

    A batch stream takes a factory of names per group, ``names(dataset, first, samples)``
    (``first``: the group's first request position, ``samples``: its sample numbers),
    so another API (GetBatch) can name the same members its own way.
    """

    shard_names = True
    """Members are named as the shards' own headers name them (``warm.py`` may send those)."""

    def __init__(self, dataset: Dataset, first: int, samples: np.ndarray):
        self.dataset_name = dataset.name
        self.fields = dataset.index.fields
        self.first = first
        self.samples = samples
        self.keys = dataset.index.keys(samples)

    def member(self, position: int, field: int) -> str:
        return f"{self.keys[position - self.first]}.{self.fields[field]}"

    def missing(self, position: int, cause: BaseException | None) -> str:
        return missing_name(self.dataset_name, int(self.samples[position - self.first]))


def _groups(members: Members, n_positions: int, group_bytes: int) -> list[tuple[int, int]]:
    """Member row ranges ``[lo, hi)`` of consecutive samples with about ``group_bytes`` of payload."""
    if int(members.size.sum()) < group_bytes:  # the usual warm batch: one group, nothing to cut
        return [(0, len(members.position))]
    per_position = np.bincount(members.position, weights=members.size, minlength=n_positions)
    starts = np.cumsum(per_position) - per_position
    group_of_position = (starts // max(group_bytes, 1)).astype(np.int64)
    cuts = np.flatnonzero(np.diff(group_of_position)) + 1  # first position of each new group
    position_rows = np.searchsorted(members.position, np.arange(n_positions + 1))
    bounds = [0, *position_rows[cuts].tolist(), len(members.position)]
    return [(lo, hi) for lo, hi in zip(bounds, bounds[1:]) if hi > lo] or [(0, 0)]


async def render_group(coalescer: Coalescer, dataset: Dataset, members: Members, indices: np.ndarray,
                       continue_on_error: bool, names=SampleNames, held: HeldGroup | None = None,
                       base: int = 0) -> tuple[list, int]:
    """The tar parts (bytes and views) of one group of member rows, and how many samples it served.

    A group whose blocks are all in RAM is framed from them at once (``warm.py``): from
    ``held``, the whole batch's, where its rows start at ``base``; any other group is read
    through the coalescer first."""
    if held is None:
        held, base = held_group(coalescer, dataset, members), 0
    if held is not None and members.found.all():
        return _held_parts(held, base, dataset, members, indices, names), _count_positions(members)
    if held is None:
        payloads = await coalescer.read_members(dataset, members)
        failed_rows = [i for i, p in enumerate(payloads) if p is None or isinstance(p, StoreError)]
    else:
        payloads = None
        failed_rows = np.flatnonzero(~members.found).tolist()
    # A sample fails as a whole: find, per position, whether any of its members failed.
    failed_positions: dict[int, StoreError | None] = {}  # position -> its first failed member's error
    for row, position in zip(failed_rows, members.position[failed_rows].tolist()):
        failed_positions.setdefault(position, None if payloads is None else payloads[row])
    positions = members.position.tolist()
    first = positions[0] if positions else 0
    samples = indices[first:positions[-1] + 1] if positions else indices[:0]
    naming = names(dataset, first, samples)  # the group's positions are consecutive
    out: list = []
    served = 0
    current = -1
    for row, (position, field) in enumerate(zip(positions, members.field.tolist())):
        if position != current:
            current = position
            if position in failed_positions:
                cause = failed_positions[position]  # None: the index lacks the member
                if not continue_on_error:
                    raise SampleFailed(dataset.name, int(samples[position - first]), cause)
                out.append(member_header(naming.missing(position, cause), 0))
                continue
            served += 1
        elif position in failed_positions:
            continue
        if held is not None:
            out += held.frame(base + row, naming.member(position, field))
            size = held.size[base + row]
        else:
            payload = payloads[row]
            size = len(payload)
            out.append(member_header(naming.member(position, field), size))
            out.append(payload)
        if size % 512:
            out.append(_PAD[:padding(size)])
    return out, served


def _count_positions(members: Members) -> int:
    """Samples in a group whose members were all found (its positions are consecutive)."""
    return int(members.position[-1] - members.position[0]) + 1 if len(members) else 0


def _held_parts(held: HeldGroup, base: int, dataset: Dataset, members: Members, indices: np.ndarray,
                names) -> list:
    """The tar parts of a group of found members all held in RAM: members whose shard headers
    name them go out as the shards' own byte ranges (runs of them at once); the others are
    framed one by one."""
    n = len(members)
    runs = held.runs(base, base + n) if names.shard_names else [(base, base + n, BUILT)]
    naming = None
    out: list = []
    for lo, hi, kind in runs:
        if kind == VERBATIM:
            out += held.ranges(lo, hi)
        elif kind == VERBATIM_SPILLED:
            for at in range(lo, hi):
                out += held.spilled(at)
        else:
            if naming is None:  # a first member framed one by one
                positions, fields = members.position.tolist(), members.field.tolist()
                first = positions[0]
                naming = names(dataset, first, indices[first:positions[-1] + 1])
            for at in range(lo, hi):
                out += held.frame(at, naming.member(positions[at - base], fields[at - base]))
                if held.size[at] % 512:
                    out.append(_PAD[:padding(held.size[at])])
    return out


def held_stream(dataset: Dataset, members: Members, indices: np.ndarray, held: HeldGroup) -> list:
    """The whole tar stream of a batch whose members were all found and are all held in RAM
    (``held``, from ``held_group``), as parts: what ``stream_batch`` yields for it, in one list."""
    return [*_held_parts(held, 0, dataset, members, indices, SampleNames), END_OF_ARCHIVE]


def chunks_of(parts: list, large: int = LARGE_PART) -> list:
    """``parts`` as few chunks to send: runs of small parts joined, a part of ``large`` bytes
    or more passed as it is (a join would copy it only to send it)."""
    chunks, run = [], []
    for part in parts:
        if len(part) >= large:
            if run:
                chunks.append(b"".join(run))
                run = []
            chunks.append(part)
        else:
            run.append(part)
    if run or not chunks:
        chunks.append(b"".join(run))
    return chunks


def stream_length(dataset: Dataset, members: Members, indices: np.ndarray, held: HeldGroup | None = None) -> int:
    """The exact length of the batch's tar stream if every member found is served.

    Known up front when RAM holds every block of the batch (``held_group``: the stream is
    then framed from those very bytes and cannot fail), and sent as ``Content-Length``, it
    spares the HTTP server a copy of every chunk (chunked framing joins each chunk with
    its size line)."""
    found = members.found.all()
    if held is not None and found and not (held.kind == BUILT).any():  # the usual warm batch: shard ranges only
        return len(END_OF_ARCHIVE) + held.verbatim_bytes()
    index = dataset.index
    total = len(END_OF_ARCHIVE)
    if found:  # the usual case: no placeholder to size, every row served
        rows = np.ones(len(members), bool)
    else:
        missing = np.unique(members.position[~members.found])
        total += sum(len(member_header(missing_name(dataset.name, int(indices[p])), 0)) for p in missing.tolist())
        rows = ~np.isin(members.position, missing)
    if held is not None:  # a member sent as its shard's own range is that many bytes, whatever its name
        verbatim = rows & (held.kind != BUILT)
        total += held.verbatim_bytes(verbatim)
        rows &= ~verbatim
    if not rows.any():
        return total
    size = members.size[rows]
    total += int((size + (-size % 512)).sum())
    positions = members.position[rows]
    wanted = np.unique(positions)
    key_bytes = np.zeros(len(indices), np.int64)
    key_bytes[wanted] = [len(k.encode()) for k in index.keys(indices[wanted])]
    field_bytes = np.array([len(f.encode()) for f in index.fields], np.int64)
    name_bytes = key_bytes[positions] + 1 + field_bytes[members.field[rows]]
    total += 512 * len(name_bytes)
    for n in name_bytes[name_bytes > 100].tolist():  # a PAX record first (its length depends on the name's only)
        total += len(member_header("n" * n, 0)) - 512
    return total


async def stream_batch(coalescer: Coalescer, dataset: Dataset, members: Members, indices: np.ndarray, *,
                       continue_on_error: bool, group_bytes: int, prefetch: int,
                       on_served=None, names=SampleNames, held: HeldGroup | None = None,
                       ) -> AsyncIterator[list[bytes | memoryview]]:
    """Yield the batch's tar stream as the parts of one group at a time (bytes and views of
    blocks, unjoined: ``chunks_of`` or a gathered write sends them), ending with the
    end-of-archive marker.

    ``names`` names the members (``SampleNames`` by default). ``held``: the batch's blocks,
    all held in RAM (``held_group``); then nothing is read."""
    groups = _groups(members, len(indices), group_bytes if held is None else max(group_bytes, HELD_GROUP_BYTES))

    def sent(parts: list, served: int, last: bool) -> list:
        if on_served is not None:
            on_served(served, sum(map(len, parts)))
        if last:
            parts.append(END_OF_ARCHIVE)
        return parts

    if held is not None:  # all in RAM: each group is framed as it is sent, nothing to read ahead
        for number, (lo, hi) in enumerate(groups, 1):
            group = members if hi - lo == len(members) else take(members, slice(lo, hi))  # one group: no copy
            parts, served = await render_group(coalescer, dataset, group, indices, continue_on_error, names, held, lo)
            yield sent(parts, served, number == len(groups))
        return
    if len(groups) > 1:
        coalescer.prefetch(dataset, members)
    pending: deque[asyncio.Task] = deque()
    upcoming = iter(groups)

    def start_next() -> None:
        for lo, hi in upcoming:
            pending.append(asyncio.create_task(
                render_group(coalescer, dataset, take(members, slice(lo, hi)), indices, continue_on_error, names)))
            return

    try:
        for _ in range(max(1, prefetch)):
            start_next()
        while pending:
            parts, served = await pending.popleft()
            start_next()
            yield sent(parts, served, not pending)
    finally:
        for task in pending:  # client went away or a sample failed: stop reading ahead
            task.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
