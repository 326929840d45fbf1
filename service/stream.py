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
from .warm import HeldGroup, held_group

_PAD = b"\0" * 512


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
    per_position = np.bincount(members.position, weights=members.size, minlength=n_positions)
    starts = np.cumsum(per_position) - per_position
    group_of_position = (starts // max(group_bytes, 1)).astype(np.int64)
    cuts = np.flatnonzero(np.diff(group_of_position)) + 1  # first position of each new group
    position_rows = np.searchsorted(members.position, np.arange(n_positions + 1))
    bounds = [0, *position_rows[cuts].tolist(), len(members.position)]
    return [(lo, hi) for lo, hi in zip(bounds, bounds[1:]) if hi > lo] or [(0, 0)]


async def render_group(coalescer: Coalescer, dataset: Dataset, members: Members, indices: np.ndarray,
                       continue_on_error: bool, names=SampleNames, held: HeldGroup | None = None,
                       base: int = 0) -> tuple[bytes, int]:
    """The tar bytes of one group of member rows, and how many samples it served.

    A group whose blocks are all in RAM is framed from them at once (``warm.py``): from
    ``held``, the whole batch's, where its rows start at ``base``; any other group is read
    through the coalescer first."""
    if held is None:
        held, base = held_group(coalescer, dataset, members), 0
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
        name = naming.member(position, field)
        if held is not None:
            out += held.frame(base + row, name)
            size = held.size[base + row]
        else:
            payload = payloads[row]
            size = len(payload)
            out.append(member_header(name, size))
            out.append(payload)
        if size % 512:
            out.append(_PAD[:padding(size)])
    return b"".join(out), served


def stream_length(dataset: Dataset, members: Members, indices: np.ndarray) -> int:
    """The exact length of the batch's tar stream if every member found is served.

    Known up front when RAM holds every block of the batch (``held_group``: the stream is
    then framed from those very bytes and cannot fail), and sent as ``Content-Length``, it
    spares the HTTP server a copy of every chunk (chunked framing joins each chunk with
    its size line)."""
    index = dataset.index
    missing = np.unique(members.position[~members.found])
    total = len(END_OF_ARCHIVE) + sum(len(member_header(missing_name(dataset.name, int(indices[p])), 0))
                                      for p in missing.tolist())
    rows = ~np.isin(members.position, missing)
    size = members.size[rows]
    total += int((size + (-size % 512)).sum())
    key_bytes = np.array([len(k.encode()) for k in index.keys(indices)], np.int64)
    field_bytes = np.array([len(f.encode()) for f in index.fields], np.int64)
    name_bytes = key_bytes[members.position[rows]] + 1 + field_bytes[members.field[rows]]
    total += 512 * len(name_bytes)
    for n in name_bytes[name_bytes > 100].tolist():  # a PAX record first (its length depends on the name's only)
        total += len(member_header("n" * n, 0)) - 512
    return total


async def stream_batch(coalescer: Coalescer, dataset: Dataset, members: Members, indices: np.ndarray, *,
                       continue_on_error: bool, group_bytes: int, prefetch: int,
                       on_served=None, names=SampleNames, held: HeldGroup | None = None) -> AsyncIterator[bytes]:
    """Yield the batch's tar stream, one group at a time, ending with the end-of-archive marker.

    ``names`` names the members (``SampleNames`` by default). ``held``: the batch's blocks,
    all held in RAM (``held_group``); then nothing is read."""
    groups = _groups(members, len(indices), group_bytes)
    if held is None and len(groups) > 1:
        coalescer.prefetch(dataset, members)
    pending: deque[asyncio.Task] = deque()
    upcoming = iter(groups)

    def start_next() -> None:
        for lo, hi in upcoming:
            pending.append(asyncio.create_task(
                render_group(coalescer, dataset, take(members, slice(lo, hi)), indices, continue_on_error,
                             names, held, lo)))
            return

    try:
        for _ in range(max(1, prefetch)):
            start_next()
        while pending:
            chunk, served = await pending.popleft()
            start_next()
            if on_served is not None:
                on_served(served, len(chunk))
            yield chunk
            if not pending:
                yield END_OF_ARCHIVE  # on its own: appending would copy the whole last group
    finally:
        for task in pending:  # client went away or a sample failed: stop reading ahead
            task.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
