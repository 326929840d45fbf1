"""How cached blocks are named: a block's key.

A block is its dataset's URL and its shard's version digested (``dataset_id``,
``shard_id``) and its number; with the block size, that is its name in the slabs
(``slabs.block_name``), so a block of a replaced object or of another block size is never
taken for the one asked for.
"""

from __future__ import annotations

import hashlib
from typing import NamedTuple


class BlockKey(NamedTuple):
    dataset: str  # dataset_id() of the dataset URL
    shard: str  # shard_id() of the shard path
    block: int


def dataset_id(url: str) -> str:
    """A short stable name for a dataset URL."""
    return hashlib.sha1(url.encode()).hexdigest()[:12]


def shard_id(path: str, etag: str | None = None, size: int | None = None) -> str:
    """A short stable name for a version of a shard (part of its blocks' file names): the
    path, and the object's ETag and size where known, so the blocks of a replaced object
    are never taken for the new one's."""
    name = path if etag is None else f"{path}\0{etag}\0{size}"
    return hashlib.sha1(name.encode()).hexdigest()[:20]
