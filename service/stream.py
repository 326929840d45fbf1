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
                       continue_on_error: bool, names=SampleNames) -> tuple[bytes, int]:
    """The tar bytes of one group of member rows, and how many samples it served."""
    payloads = await coalescer.read_members(dataset, members)
    # A sample fails as a whole: find, per position, whether any of its members failed.
    failed_rows = [i for i, p in enumerate(payloads) if p is None or isinstance(p, StoreError)]
    failed_positions: dict[int, StoreError | None] = {}  # position -> its first failed member's error
    for row, position in zip(failed_rows, members.position[failed_rows].tolist()):
        failed_positions.setdefault(position, payloads[row])
    positions = members.position.tolist()
    first = positions[0] if positions else 0
    samples = indices[first:positions[-1] + 1] if positions else indices[:0]
    naming = names(dataset, first, samples)  # the group's positions are consecutive
    out: list = []
    served = 0
    current = -1
    for position, field, payload in zip(positions, members.field.tolist(), payloads):
        if position != current:
            current = position
            sample = int(samples[position - first])
            if position in failed_positions:
                cause = failed_positions[position]
                if not continue_on_error:
                    raise SampleFailed(dataset.name, sample, cause)
                out.append(member_header(naming.missing(position, cause), 0))
                continue
            served += 1
        elif position in failed_positions:
            continue
        size = len(payload)
        out.append(member_header(naming.member(position, field), size))
        out.append(payload)
        if size % 512:
            out.append(_PAD[:padding(size)])
    return b"".join(out), served


async def stream_batch(coalescer: Coalescer, dataset: Dataset, members: Members, indices: np.ndarray, *,
                       continue_on_error: bool, group_bytes: int, prefetch: int,
                       on_served=None, names=SampleNames) -> AsyncIterator[bytes]:
    """Yield the batch's tar stream, one group at a time, ending with the end-of-archive marker.

    ``names`` names the members (``SampleNames`` by default)."""
    groups = _groups(members, len(indices), group_bytes)
    if len(groups) > 1:
        coalescer.prefetch(dataset, members)
    pending: deque[asyncio.Task] = deque()
    upcoming = iter(groups)

    def start_next() -> None:
        for lo, hi in upcoming:
            pending.append(asyncio.create_task(
                render_group(coalescer, dataset, take(members, slice(lo, hi)), indices, continue_on_error,
                             names)))
            return

    try:
        for _ in range(max(1, prefetch)):
            start_next()
        while pending:
            chunk, served = await pending.popleft()
            start_next()
            if on_served is not None:
                on_served(served, len(chunk))
            if not pending:
                chunk += END_OF_ARCHIVE
            yield chunk
    finally:
        for task in pending:  # client went away or a sample failed: stop reading ahead
            task.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
