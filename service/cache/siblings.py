"""Sibling workers' blocks, read straight from their slabs: no hop.

With ``serve --workers N`` each worker caches only the shards it owns, in its own
directory (``cache_dir/worker-<i>``). A batch that reaches a worker has about (N-1)/N of
its members in shards of its siblings. Asking the owner for them over its Unix socket
costs a request, a response and a copy per sub-batch; on one host the owner's slabs are
right there, so this worker finds each block's place in the table the owner publishes
(``hints.py``), opens the slabs read-only and checks each slot exactly as the owner would
(``slabs.py``: the header names the block, the checksums hold). It never writes in a
sibling's directory: the owner stays the only one that caches its shards, so no block is
cached twice on disk.

A place the owner lets go of and writes again while it is read here fails those checks
and counts as absent. A block the owner has not cached (yet, or any more), one without a
hint, and one that fails its checks are left to the owner: the coalescer sends those
members over its socket as before, and the owner reads the block from the store and
caches it (or drops the bad slot and fetches it again).

Blocks read here enter this worker's RAM tier (``memtier.py``) so that the next batch
finds them on the lean warm path (``warm.py``) with no read at all. The trade-off: RAM,
not disk, may hold a hot block once per worker; ``--memory-cache`` stays the host's bound
(each worker gets ``1/N`` of it), so with N workers the RAM tier keeps a hot set of ``1/N``
of the flag rather than all of it, and blocks beyond it are read from the slabs (one
thread hop per group and a checksum over each block).

Every method here blocks: callers run them in a thread.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from shardfeed.buffers import BufferPool
from shardfeed.service.cache.hints import SiblingHints
from shardfeed.service.cache.names import BlockKey
from shardfeed.service.cache.slabs import BadBlock, NotThisBlock, Slabs, block_name
from shardfeed.service.observe.metrics import Metrics

log = logging.getLogger("shardfeed.siblings")


class SiblingBlocks:
    """Read-only access to the block caches of this host's sibling workers.

    Args:
        directories: per sibling node (its number in ``Cluster.peers``), its cache directory.
        block_size: bytes per block (the same for every worker of a host).
        metrics: ``sibling_blocks`` counts the blocks read, absent and found bad.
        buffers: where large reads land (``slabs.py``).
    """

    def __init__(self, directories: dict[int, Path], block_size: int, metrics: Metrics,
                 buffers: BufferPool | None = None):
        self.directories = directories
        self.block_size = block_size
        self.metrics = metrics
        self._hints = {node: SiblingHints(d) for node, d in directories.items()}
        self._slabs = {node: Slabs(d, block_size, buffers=buffers, writable=False) for node, d in directories.items()}
        self._last_warning = -1e9

    def __contains__(self, node: int) -> bool:
        return node in self.directories

    def read(self, node: int, wanted: dict[BlockKey, list[tuple[int, int]] | None]) -> dict[BlockKey, list]:
        """Bytes ``[start, end)`` of each block for each range (``None``: the whole block),
        verified, for the blocks ``node`` has in its cache; the others are left out."""
        hints, slabs = self._hints[node], self._slabs[node]
        out = {}
        counts = {"read": 0, "absent": 0, "bad": 0}
        for key, ranges in wanted.items():
            name = block_name(key.dataset, key.shard, self.block_size, key.block)
            result = "absent"
            for place in hints.places(name):
                try:
                    out[key] = slabs.read(place, name, ranges)
                    result = "read"
                    break
                except (FileNotFoundError, NotThisBlock):  # no slab yet, or a stale hint
                    continue
                except (OSError, BadBlock) as err:
                    result = "bad"
                    self._warn(f"sibling block {key} in {self.directories[node]} is unreadable ({err}): "
                               "asking its owner")
            counts[result] += 1
        for result, count in counts.items():
            if count:
                self.metrics.sibling_blocks.labels(result).inc(count)
        return out

    def close(self) -> None:
        for slabs in self._slabs.values():
            slabs.close()

    def _warn(self, message: str) -> None:
        # A bad block the owner still holds in RAM is met by every batch until the owner
        # reads its file again: warn now and then, not per batch.
        now = time.monotonic()
        if now - self._last_warning > 30:
            self._last_warning = now
            log.warning("%s", message)
