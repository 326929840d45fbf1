"""Sibling workers' blocks, read straight from their cache directories: no hop.

With ``serve --workers N`` each worker caches only the shards it owns, in its own
directory (``cache_dir/worker-<i>``). A batch that reaches a worker has about (N-1)/N of
its members in shards of its siblings. Asking the owner for them over its Unix socket
costs a request, a response and a copy per sub-batch; on one host the owner's block files
are right there, so this worker opens them read-only and verifies them exactly as the
owner would (``blockfile.py``). It never writes, renames or unlinks in a sibling's
directory: the owner stays the only one that caches its shards, so no block is cached
twice on disk.

Files are replaced by rename and evicted by unlink, never changed in place, so a file
opened here reads whole and right even if the owner evicts it a moment later. A block the
owner has not cached (yet, or any more) and a block that fails its checks are left to the
owner: the coalescer sends those members over its socket as before, and the owner reads
the block from the store and caches it (or drops the bad file and fetches it again).

Blocks read here enter this worker's RAM tier (``memtier.py``) so that the next batch
finds them on the lean warm path (``warm.py``) with no read at all. The trade-off: RAM,
not disk, may hold a hot block once per worker; ``--memory-cache`` stays the host's bound
(each worker gets ``1/N`` of it), so with N workers the RAM tier keeps a hot set of ``1/N``
of the flag rather than all of it, and blocks beyond it are read from the files (one
thread hop per group and a checksum over each block). Mapping the sibling's files instead
(``mmap``) would share the page cache and hold nothing twice, but a mapping pins an
evicted file's disk space until it is dropped, and the bytes in RAM are served the same way.

Every method here blocks: callers run them in a thread.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from shardfeed.service.cache.blockfile import BadBlock, BlockFile
from shardfeed.service.cache.names import BlockKey
from shardfeed.service.observe.metrics import Metrics

log = logging.getLogger("shardfeed.siblings")


class SiblingBlocks:
    """Read-only access to the block caches of this host's sibling workers.

    Args:
        directories: per sibling node (its number in ``Cluster.peers``), its cache directory.
        block_size: bytes per block (the same for every worker of a host).
        metrics: ``sibling_blocks`` counts the blocks read, absent and found bad.
    """

    def __init__(self, directories: dict[int, Path], block_size: int, metrics: Metrics):
        self.directories = directories
        self.block_size = block_size
        self.metrics = metrics
        self._last_warning = -1e9

    def __contains__(self, node: int) -> bool:
        return node in self.directories

    def read(self, node: int, wanted: dict[BlockKey, list[tuple[int, int]] | None]) -> dict[BlockKey, list[bytes]]:
        """Bytes ``[start, end)`` of each block for each range (``None``: the whole block),
        verified, for the blocks ``node`` has in its cache directory; the others are left out."""
        directory = self.directories[node]
        out = {}
        counts = {"read": 0, "absent": 0, "bad": 0}
        for key, ranges in wanted.items():
            name = key.filename(self.block_size)
            try:
                out[key] = BlockFile(directory / name).read(ranges)
                counts["read"] += 1
            except FileNotFoundError:
                counts["absent"] += 1
            except (OSError, BadBlock) as err:
                counts["bad"] += 1
                self._warn(f"sibling block {directory / name} is unreadable ({err}): asking its owner")
        for result, count in counts.items():
            if count:
                self.metrics.sibling_blocks.labels(result).inc(count)
        return out

    def _warn(self, message: str) -> None:
        # A bad block the owner still holds in RAM is met by every batch until the owner
        # reads its file again: warn now and then, not per batch.
        now = time.monotonic()
        if now - self._last_warning > 30:
            self._last_warning = now
            log.warning("%s", message)
