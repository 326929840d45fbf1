"""The planner: requested members -> the block pieces that hold their bytes -> merged store reads,
and back: each member's pieces put together (``assemble``), unjoined: a member over several blocks
is its ``Parts``, which a framing sends one after another as the warm path sends block views.

Pure, vectorised functions; the coalescer runs the plan.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from shardfeed.service.datasets.index import Members
from shardfeed.service.stores import StoreError


@dataclass
class Pieces:
    """One row per (member, block) overlap, in member order then block order."""

    member: np.ndarray  # row in the Members the plan was made from
    shard: np.ndarray
    block: np.ndarray
    start: np.ndarray  # byte range within the block
    end: np.ndarray

    def __len__(self) -> int:
        return len(self.member)

    def needs(self) -> dict[tuple[int, int], int]:
        """Bytes wanted of each ``(shard, block)``."""
        out: dict[tuple[int, int], int] = defaultdict(int)
        for shard, block, size in zip(self.shard.tolist(), self.block.tolist(), (self.end - self.start).tolist()):
            out[shard, block] += size
        return out

    def spans(self, rows, block_size: int) -> list[tuple[int, int, int]]:
        """``(shard, start, end)`` in the shard of the pieces in ``rows`` (a list or slice)."""
        base = self.block[rows] * block_size
        return list(zip(self.shard[rows].tolist(), (base + self.start[rows]).tolist(),
                        (base + self.end[rows]).tolist()))


def plan_pieces(members: Members, block_size: int) -> Pieces:
    """Split each found, non-empty member into the aligned blocks it overlaps."""
    rows = np.flatnonzero(members.found & (members.size > 0))
    offset, size = members.offset[rows], members.size[rows]
    first = offset // block_size
    count = (offset + size - 1) // block_size - first + 1
    member = np.repeat(rows, count)
    # block = first block of the member + the piece's rank within the member
    rank = np.arange(int(count.sum())) - np.repeat(np.cumsum(count) - count, count)
    block = np.repeat(first, count) + rank
    base = block * block_size
    start = np.maximum(np.repeat(offset, count), base) - base
    end = np.minimum(np.repeat(offset + size, count), base + block_size) - base
    return Pieces(member, members.shard[member].astype(np.int64), block, start, end)


def merge_blocks(blocks: list[int], gap_blocks: int, max_blocks: int,
                 bridgeable: Callable[[int], bool] = lambda block: True) -> list[tuple[int, int]]:
    """Group sorted block numbers into inclusive runs ``(first, last)`` to fetch in one read.

    Blocks at most ``gap_blocks`` apart share a run when every block between them is
    ``bridgeable`` (not cached or being read already: those are read again otherwise);
    no run is longer than ``max_blocks``.
    """
    runs: list[tuple[int, int]] = []
    for block in blocks:
        if runs:
            first, last = runs[-1]
            if (block - last - 1 <= gap_blocks and block - first < max_blocks
                    and all(bridgeable(b) for b in range(last + 1, block))):
                runs[-1] = (first, block)
                continue
        runs.append((block, block))
    return runs


def take(members: Members, rows: np.ndarray | slice) -> Members:
    """The given rows of ``members`` (a boolean mask, row numbers, or a slice)."""
    return Members(**{name: array[rows] for name, array in vars(members).items()})


def distinct_blocks(members: Members, block_size: int) -> int:
    """How many distinct ``(shard, block)`` pairs the found ``members`` span."""
    found, offset = members.found, members.offset[members.found]
    first = offset // block_size
    spans = (offset + np.maximum(members.size[found], 1) - 1) // block_size - first + 1
    blocks = np.repeat(first - np.cumsum(spans) + spans, spans) + np.arange(spans.sum())  # each member's, in turn
    return np.unique(np.stack([np.repeat(members.shard[found].astype(np.int64), spans), blocks]), axis=1).shape[1]


class Parts(tuple):
    """The bytes of a member over several blocks: its pieces in order (views of the blocks, or
    bytes), never joined. ``len()`` counts the pieces; ``nbytes`` is the member's size. Joining
    them would copy every byte of almost every large member only to send it."""

    __slots__ = ()

    @property
    def nbytes(self) -> int:
        return sum(map(len, self))


Payload = bytes | memoryview | Parts
"""A member's bytes as ``Coalescer.read_members`` gives them: one piece, or ``Parts``."""


def pieces(payload: Payload) -> tuple:
    """A member's bytes as the pieces to send one after another."""
    return payload if isinstance(payload, Parts) else (payload,)


def size_of(payload: Payload) -> int:
    """A member's size in bytes (``len`` of ``Parts`` counts its pieces)."""
    return payload.nbytes if isinstance(payload, Parts) else len(payload)


def joined(payload: Payload) -> bytes:
    """A member's bytes as one ``bytes``, for a reader that needs them whole (``Parts`` copied into one)."""
    return b"".join(pieces(payload))


def assemble(members: Members, piece_member: np.ndarray, piece_bytes: dict) -> list[Payload | StoreError | None]:
    """Each member's pieces, as one piece or ``Parts``; a member with a failed piece becomes that error."""
    out: list = [None] * len(members.found)
    found = members.found
    for row in np.flatnonzero(found & (members.size == 0)).tolist():
        out[row] = b""
    parts: list = []
    current = -1
    for i, row in enumerate(piece_member.tolist()):
        if row != current:
            if parts:
                out[current] = _member_of(parts)
            parts, current = [], row
        parts.append(piece_bytes[i])
    if parts:
        out[current] = _member_of(parts)
    return out


def _member_of(parts: list) -> Payload | StoreError:
    for part in parts:
        if isinstance(part, StoreError):
            return part
    return parts[0] if len(parts) == 1 else Parts(parts)
