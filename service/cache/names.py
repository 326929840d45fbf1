"""How cached blocks are named: the key of a block and its file's name in the cache directory.

A block file is ``<dataset id>/<shard id>-<block size, hex>-<block number, hex>.blk``: the
dataset's URL and the shard's version digested (``dataset_id``, ``shard_id``), so a block
of a replaced object or of another block size is never taken for the one asked for.
"""

from __future__ import annotations

import hashlib
from typing import NamedTuple

SUFFIX = ".blk"


class BlockKey(NamedTuple):
    dataset: str  # dataset_id() of the dataset URL
    shard: str  # shard_id() of the shard path
    block: int

    def filename(self, block_size: int) -> str:
        return f"{self.dataset}/{self.shard}-{block_size:x}-{self.block:08x}{SUFFIX}"

    @classmethod
    def parse(cls, name: str) -> tuple[BlockKey, int]:
        """The key and block size of a file name made by ``filename``; ``ValueError`` for another name."""
        dataset, _, rest = name.partition("/")
        shard, block_size, block = rest.removesuffix(SUFFIX).split("-")
        if not (dataset and shard and name.endswith(SUFFIX)):
            raise ValueError(f"not a block file name: {name!r}")
        return cls(dataset, shard, int(block, 16)), int(block_size, 16)


def dataset_id(url: str) -> str:
    """A short stable name for a dataset URL (a directory of the cache)."""
    return hashlib.sha1(url.encode()).hexdigest()[:12]


def shard_id(path: str, etag: str | None = None, size: int | None = None) -> str:
    """A short stable name for a version of a shard (part of its blocks' file names): the
    path, and the object's ETag and size where known, so the blocks of a replaced object
    are never taken for the new one's."""
    name = path if etag is None else f"{path}\0{etag}\0{size}"
    return hashlib.sha1(name.encode()).hexdigest()[:20]
