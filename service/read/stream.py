"""Batch responses: the requested members, as one stream in request order (a tar, or an Arrow
IPC stream: the framing, ``framing.TarFraming`` or ``arrow.ArrowFraming``, says how each group
goes out).

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

from shardfeed.service.datasets.dataset import Dataset
from shardfeed.service.datasets.index import Members
from shardfeed.service.read.coalescer import Coalescer
from shardfeed.service.read.framing import TarFraming
from shardfeed.service.read.planner import pieces, take
from shardfeed.service.read.warm import HeldGroup, held_group
from shardfeed.service.stores import StoreError

HELD_GROUP_BYTES = 16 * 1024 * 1024
"""Group size of a batch held in RAM: its parts are views of held blocks, so a group costs no
memory, and fewer, larger groups cost less per sample."""


class SampleFailed(Exception):
    """A sample of a batch without ``continue_on_error`` could not be read."""

    def __init__(self, dataset: str, sample: int, cause: BaseException | None):
        super().__init__(f"sample {sample} of dataset {dataset!r} could not be read: {cause}")
        self.sample = sample
        self.cause = cause


def batch_groups(members: Members, n_positions: int, group_bytes: int, held: bool) -> list[tuple[int, int]]:
    """Member row ranges ``[lo, hi)`` of consecutive samples with about ``group_bytes`` of payload
    (at least ``HELD_GROUP_BYTES`` when the batch is ``held`` in RAM): how ``stream_batch`` cuts
    the batch into groups."""
    if held:
        group_bytes = max(group_bytes, HELD_GROUP_BYTES)
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
                       continue_on_error: bool, framing=TarFraming(), held: HeldGroup | None = None,
                       base: int = 0, looked: bool = False) -> tuple[list, int]:
    """The parts (bytes and views) of one group of member rows, as ``framing`` frames them, and
    how many samples it served.

    A group whose blocks are all in RAM is framed from them at once (``warm.py``): from
    ``held``, the whole batch's, where its rows start at ``base``; any other group is looked
    for in RAM (unless ``looked``: just done) and read through the coalescer. ``framing`` frames
    either."""
    if held is None and not looked:
        held, base = held_group(coalescer, dataset, members), 0
    if held is not None and members.found.all():
        return framing.held(held, base, dataset, members, indices), _count_positions(members)
    if held is None:
        payloads = await coalescer.read_members(dataset, members)
        failed_rows = [i for i, p in enumerate(payloads) if p is None or isinstance(p, StoreError)]

        def data(row: int) -> tuple:  # a member over blocks: its pieces, unjoined, as held blocks' views go
            return pieces(payloads[row])
    else:
        payloads = None
        failed_rows = np.flatnonzero(~members.found).tolist()

        def data(row: int) -> list:
            return held.data(base + row)
    # A sample fails as a whole: find, per position, whether any of its members failed.
    failed: dict[int, StoreError | None] = {}  # position -> its first failed member's error (None: not indexed)
    for row, position in zip(failed_rows, members.position[failed_rows].tolist()):
        failed.setdefault(position, None if payloads is None else payloads[row])
    if failed and not continue_on_error:
        position = min(failed)
        raise SampleFailed(dataset.name, int(indices[position]), failed[position])
    return framing.read(dataset, members, indices, data, failed)


def _count_positions(members: Members) -> int:
    """Samples in a group whose members were all found (its positions are consecutive)."""
    return int(members.position[-1] - members.position[0]) + 1 if len(members) else 0


async def stream_batch(coalescer: Coalescer, dataset: Dataset, members: Members, indices: np.ndarray, *,
                       continue_on_error: bool, group_bytes: int, prefetch: int,
                       on_served=None, framing=TarFraming(), held: HeldGroup | None = None,
                       looked: bool = False) -> AsyncIterator[list[bytes | memoryview]]:
    """Yield the batch's stream as the parts of one group at a time (bytes and views of blocks,
    unjoined: ``chunks_of`` or a gathered write sends them), from ``framing``'s head to its end
    marker.

    ``framing``: a tar of ``SampleNames`` by default (``TarFraming``). ``held``: the batch's blocks,
    all held in RAM (``held_group``); then nothing is read. ``looked``: the whole batch was
    just looked for in RAM and ``held`` is what was found, so a batch of one group is not
    looked for again."""
    groups = batch_groups(members, len(indices), group_bytes, held is not None)
    head = framing.head()

    def sent(parts: list, served: int, last: bool) -> list:
        if head:
            parts[:0] = head
            head.clear()
        if on_served is not None:  # the head counted as sent, as an instant answer counts it
            on_served(served, sum(map(len, parts)))
        if last:
            parts.append(framing.end())
        return parts

    if held is not None:  # all in RAM: each group is framed as it is sent, nothing to read ahead
        for number, (lo, hi) in enumerate(groups, 1):
            group = members if hi - lo == len(members) else take(members, slice(lo, hi))  # one group: no copy
            parts, served = await render_group(coalescer, dataset, group, indices, continue_on_error, framing, held, lo)
            yield sent(parts, served, number == len(groups))
        return
    if len(groups) > 1:
        coalescer.prefetch(dataset, members)
    pending: deque[asyncio.Task] = deque()
    upcoming = iter(groups)

    def start_next() -> None:
        for lo, hi in upcoming:
            pending.append(asyncio.create_task(
                render_group(coalescer, dataset, take(members, slice(lo, hi)), indices, continue_on_error, framing,
                             looked=looked and len(groups) == 1)))
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
