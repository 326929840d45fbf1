"""Whether an opened dataset's index describes its shards.

A writer replaces a shard, then ``index.parquet`` (or the index first). A listing taken between
the two pairs the new shard with the old index: every read of that shard carries the new ETag
and succeeds, at the old layout's offsets. The versioned cache cannot see it: those are wrong
bytes of the right version (the chaos benchmark's overwrite fault served some, under load).

So an opened dataset (``served.py``'s ``Opener``) has the tar headers of the first and last
members of some shards read first: on a reopening, each shard whose version or index rows
changed (its extent, as a cheap stand-in); on a first opening (a service or a restarted worker
starting while a writer is half-way), a random choice of them. The 512 bytes before a member's
data must be a tar header of that size, and of that name (WebDataset's key and field) where the
name fits there. The dataset is adopted either way, for its other shards; a shard that
disagrees is read at a version no store holds (``disagreeing``), so its reads fail with
``ObjectChanged`` (a 409 ``dataset_changed`` the client retries), never wrong bytes, and the
reopening that failure asks for finds the writer done. A shard whose headers cannot be read
(cut short, gone) is left to its reads, which fail on their own. At most ``CHECKED`` shards are
read per opening, at once.
"""

from __future__ import annotations

import asyncio
import logging
import random
from dataclasses import replace

import numpy as np

from shardfeed.service.cache.names import shard_id
from shardfeed.service.datasets.dataset import Dataset
from shardfeed.service.datasets.indexfile import split_member_name
from shardfeed.service.stores import StoreError
from shardfeed.tar import BLOCK, TarFormatError, parse_header

log = logging.getLogger("shardfeed.datasets")

CHECKED = 64
"""Shards whose headers are read at most per opening (a random choice of them when more changed,
or on a first opening of more)."""


def disagreeing(version: str | None) -> str:
    """The version a disagreeing shard is read at: never an ETag, so every read of it fails."""
    return f"index-disagrees-{version}"


def changed_shards(old: Dataset, new: Dataset) -> list[int]:
    """Codes (in ``new``) of the shards whose version or extent differs from ``old``'s."""
    before = {path: (version, int(extent)) for path, version, extent
              in zip(old.index.shards, old.versions, old.extents)}
    return [code for code, (path, version, extent) in enumerate(zip(new.index.shards, new.versions, new.extents))
            if before.get(path) not in (None, (version, int(extent)))]


async def agreed(old: Dataset | None, new: Dataset) -> Dataset:
    """``new``, with each shard changed since ``old`` (any shard on a first opening, ``old``
    None) that does not hold its members where ``new``'s index says read at a ``disagreeing``
    version (tar layouts; loose objects have no headers)."""
    if new.index.layout != "tar" or not new.versions:
        return new
    codes = changed_shards(old, new) if old is not None else range(len(new.index.shards))
    if len(codes) > CHECKED:
        codes = random.sample(codes, CHECKED)
    # Each chosen shard's first run of samples (``Index.shard_runs``): its first and last sample.
    run_starts, run_shards = new.index.shard_runs()
    ends = np.append(run_starts[1:], len(new.index))
    present, first_run = np.unique(run_shards, return_index=True)
    chosen = np.asarray(codes, dtype=present.dtype)
    at = np.minimum(np.searchsorted(present, chosen), max(len(present) - 1, 0))
    held = present[at] == chosen if len(present) else np.zeros(len(chosen), bool)
    runs = first_run[at[held]]
    checked = [(code, sample, edge) for code, start, end in zip(chosen[held].tolist(), run_starts[runs].tolist(),
                                                                (ends[runs] - 1).tolist())
               for sample, edge in ((start, np.argmin), (end, np.argmax))]
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
    want = dataset.index.key(sample), dataset.index.fields[int(members.field[row])]
    # A name of 100 bytes or more, or not ASCII, may be whole only in a GNU or PAX record before
    # the header: then the size alone is checked.
    whole = len(name) < 100 and all(part.isascii() for part in want)
    if found != size or (whole and split_member_name(name.decode(errors="replace")) != want):
        return f"{path}: the header before offset {offset} is {name[:100]!r} of {found} bytes, not {want}"
    return None
