"""Whether a reopened dataset's index still describes its shards.

A writer replaces a shard, then ``index.parquet`` (or the index first). A listing taken between
the two pairs the new shard with the old index: every read of that shard carries the new ETag
and succeeds, at the old layout's offsets. The versioned cache cannot see it: those are wrong
bytes of the right version (the chaos benchmark's overwrite fault served 56 once, under load).

So before a reopened dataset replaces the one being served (``served.py``), each shard whose
version or whose index rows changed (its extent, as a cheap stand-in) has the tar headers of
its first and last members read: the 512 bytes before a member's data must be a tar header of
that size, and of that name where the name fits there. A shard that fails means the store is between the two
writes: the reopening fails with ``IndexDisagrees``, the old dataset stays (its reads of the
replaced shard fail with ``ObjectChanged``, never wrong bytes), and the next reopening, on the
next such read or reload, finds the writer done. At most ``CHECKED`` shards are read, at once.
"""

from __future__ import annotations

import asyncio
import random

import numpy as np

from shardfeed.service.datasets.dataset import Dataset
from shardfeed.service.stores import StoreError
from shardfeed.tar import BLOCK, TarFormatError, parse_header

CHECKED = 64
"""Changed shards whose headers are read at most per reopening (a random choice of them)."""


class IndexDisagrees(StoreError):
    """A shard's members are not where the dataset's index says: its writer is not done."""


def changed_shards(old: Dataset, new: Dataset) -> list[int]:
    """Codes (in ``new``) of the shards whose version or extent differs from ``old``'s."""
    before = {path: (version, int(extent)) for path, version, extent
              in zip(old.index.shards, old.versions, old.extents)}
    return [code for code, (path, version, extent) in enumerate(zip(new.index.shards, new.versions, new.extents))
            if before.get(path) not in (None, (version, int(extent)))]


async def check_agreement(old: Dataset, new: Dataset) -> None:
    """Raise ``IndexDisagrees`` if a changed shard of ``new`` does not hold its first member
    where ``new``'s index says (tar layouts; loose objects have no headers to read)."""
    if new.index.layout != "tar":
        return
    codes = changed_shards(old, new)
    if len(codes) > CHECKED:
        codes = random.sample(codes, CHECKED)
    run_starts, run_shards = new.index.shard_runs()
    ends = [*run_starts[1:].tolist(), len(new.index)]
    runs: dict[int, tuple[int, int]] = {}  # shard code -> (first sample, last sample) of its first run
    for start, end, code in zip(run_starts.tolist(), ends, run_shards.tolist()):
        runs.setdefault(code, (start, end - 1))
    checks = [_check_member(new, code, sample, edge) for code in codes if code in runs
              for sample, edge in zip(runs[code], (np.argmin, np.argmax))]
    for disagreement in await asyncio.gather(*checks):
        if disagreement:
            raise IndexDisagrees(f"dataset {new.name}: {disagreement}; the store is between writing the "
                                 "shard and index.parquet: the dataset is served as it was until they agree")


async def _check_member(dataset: Dataset, code: int, sample: int, edge) -> str | None:
    """Why the member of ``sample`` in shard ``code`` that ``edge`` picks by offset (``np.argmin``:
    its first, ``np.argmax``: its last) is not where the index says, or None."""
    members = dataset.index.lookup(np.array([sample]))
    row = int(edge(members.offset))
    offset, size = int(members.offset[row]), int(members.size[row])
    path = dataset.index.shards[code]
    if offset < BLOCK:
        return f"{path}: a member lies at offset {offset}, before any tar header"
    header = await dataset.store.read_range(path, offset - BLOCK, BLOCK, dataset.shard_version(code))
    try:
        name, found, _ = parse_header(header)
    except TarFormatError:
        return f"{path}: no tar header before offset {offset}"
    want = f"{dataset.index.key(sample)}.{dataset.index.fields[int(members.field[row])]}".encode()
    if found != size or (len(want) < 100 and name != want):
        return f"{path}: the header before offset {offset} is {name[:100]!r} of {found} bytes, not {want!r}"
    return None
