"""Whether a reopened dataset's index still describes its changed shards.

A writer replaces a shard, then ``index.parquet`` (or the index first). A listing taken between
the two pairs the new shard with the old index: every read of that shard carries the new ETag
and succeeds, at the old layout's offsets. The versioned cache cannot see it: those are wrong
bytes of the right version (the chaos benchmark's overwrite fault served 56 once, under load).

So a reopened dataset (``served.py``) has the tar headers of the first and last members of each
shard whose version or index rows changed (its extent, as a cheap stand-in) read first: the 512
bytes before a member's data must be a tar header of that size, and of that name where the name
fits there. The dataset is adopted either way, for its other shards; a shard that disagrees is
read at a version no store holds (``disagreeing``), so its reads fail with ``ObjectChanged``
(a 409 ``dataset_changed`` the client retries), never wrong bytes, and the reopening that
failure asks for finds the writer done. A shard whose headers cannot be read (cut short, gone)
is left to its reads, which fail on their own. At most ``CHECKED`` shards are read, at once.
"""

from __future__ import annotations

import asyncio
import logging
import random
from dataclasses import replace

import numpy as np

from shardfeed.service.cache.names import shard_id
from shardfeed.service.datasets.dataset import Dataset
from shardfeed.service.stores import StoreError
from shardfeed.tar import BLOCK, TarFormatError, parse_header

log = logging.getLogger("shardfeed.datasets")

CHECKED = 64
"""Changed shards whose headers are read at most per reopening (a random choice of them)."""


def disagreeing(version: str | None) -> str:
    """The version a disagreeing shard is read at: never an ETag, so every read of it fails."""
    return f"index-disagrees-{version}"


def changed_shards(old: Dataset, new: Dataset) -> list[int]:
    """Codes (in ``new``) of the shards whose version or extent differs from ``old``'s."""
    before = {path: (version, int(extent)) for path, version, extent
              in zip(old.index.shards, old.versions, old.extents)}
    return [code for code, (path, version, extent) in enumerate(zip(new.index.shards, new.versions, new.extents))
            if before.get(path) not in (None, (version, int(extent)))]


async def agreed(old: Dataset, new: Dataset) -> Dataset:
    """``new``, with each changed shard that does not hold its members where ``new``'s index
    says read at a ``disagreeing`` version (tar layouts; loose objects have no headers)."""
    if new.index.layout != "tar" or not new.versions:
        return new
    codes = changed_shards(old, new)
    if len(codes) > CHECKED:
        codes = random.sample(codes, CHECKED)
    run_starts, run_shards = new.index.shard_runs()
    ends = [*run_starts[1:].tolist(), len(new.index)]
    runs: dict[int, tuple[int, int]] = {}  # shard code -> (first sample, last sample) of its first run
    for start, end, code in zip(run_starts.tolist(), ends, run_shards.tolist()):
        runs.setdefault(code, (start, end - 1))
    checked = [(code, sample, edge) for code in codes if code in runs
               for sample, edge in zip(runs[code], (np.argmin, np.argmax))]
    found = await asyncio.gather(*(_check_member(new, *check) for check in checked))
    bad = sorted({code for (code, _, _), why in zip(checked, found) if why})
    if not bad:
        return new
    log.warning("dataset %s: %s; the store is between writing the shard and index.parquet: %d shard(s) "
                "fail their reads until they agree", new.name, next(why for why in found if why), len(bad))
    versions, shard_ids = list(new.versions), list(new.shard_ids)
    for code in bad:
        versions[code] = disagreeing(versions[code])
        shard_ids[code] = shard_id(new.index.shards[code], versions[code])
    return replace(new, versions=versions, shard_ids=shard_ids)


async def _check_member(dataset: Dataset, code: int, sample: int, edge) -> str | None:
    """Why the member of ``sample`` in shard ``code`` that ``edge`` picks by offset (``np.argmin``:
    its first, ``np.argmax``: its last) is not where the index says, or None."""
    members = dataset.index.lookup(np.array([sample]))
    row = int(edge(members.offset))
    offset, size = int(members.offset[row]), int(members.size[row])
    path = dataset.index.shards[code]
    if offset < BLOCK:
        return f"{path}: a member lies at offset {offset}, before any tar header"
    try:
        header = await dataset.store.read_range(path, offset - BLOCK, BLOCK, dataset.shard_version(code))
    except StoreError:  # cut short, gone, replaced again: its reads say so themselves (a 503, a 412)
        return None
    try:
        name, found, _ = parse_header(header)
    except TarFormatError:
        return f"{path}: no tar header before offset {offset}"
    want = f"{dataset.index.key(sample)}.{dataset.index.fields[int(members.field[row])]}".encode()
    if found != size or (len(want) < 100 and name != want):
        return f"{path}: the header before offset {offset} is {name[:100]!r} of {found} bytes, not {want!r}"
    return None
