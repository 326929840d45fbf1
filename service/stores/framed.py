"""LitData's framed zstd chunk (``LDFZ01``), and the raw chunk it stands for.

LitData (0.2.7x; ``compression="zstd"``, ``compression_level="batch"``, the default for zstd)
writes a pytree chunk as ``chunk-R-N.bin`` laid out as (``litdata/streaming/framed_zstd.py``)::

    "LDFZ01\\0\\0", version u16 (1), flags u16, num_items u32, frame_rows u32, n_frames u32   24 bytes
    offsets u32[num_items + 1]     each item's start in the items' bytes laid end to end (0 first)
    frames[n_frames]               first_item u32, n_items u32, compressed_off u64 (in the file),
                                   compressed_len u32, uncompressed_len u32: 24 bytes each
    the frames                     each an independent zstd frame of its items' bytes

The raw chunk it stands for is LitData's uncompressed layout, byte for byte the chunk its writer
packed before framing it: ``num_items`` (u32), ``num_items + 1`` u32 offsets in the chunk
(``header + offsets[i]``, ``header = 4 * (num_items + 2)``), then the items' bytes, which are the
frames decompressed one after another. So raw offsets mean what they mean in an uncompressed
chunk; the raw header is made here from the table, and raw bytes [a, b) past it need only the
frames that overlap them.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

MAGIC = b"LDFZ01\0\0"
PREFIX = struct.Struct("<8sHHIII")
FRAME = np.dtype([("first_item", "<u4"), ("n_items", "<u4"), ("compressed_off", "<u8"),
                  ("compressed_len", "<u4"), ("uncompressed_len", "<u4")])


class FrameTableError(ValueError):
    """The bytes are not an ``LDFZ01`` chunk's table, or a table that contradicts itself."""


def is_framed(head: bytes) -> bool:
    """Whether a chunk's first bytes open an ``LDFZ01`` chunk."""
    return head[:len(MAGIC)] == MAGIC


def table_size(head: bytes) -> int:
    """How many bytes from the start of the chunk its table takes, from its first 24."""
    if len(head) < PREFIX.size or not is_framed(head):
        raise FrameTableError("no LDFZ01 magic at the start")
    _, version, _, items, _, frames = PREFIX.unpack_from(head)
    if version != 1:
        raise FrameTableError(f"LDFZ01 version {version} is not understood (1 is)")
    return PREFIX.size + 4 * (items + 1) + FRAME.itemsize * frames


@dataclass(frozen=True, eq=False)
class FrameTable:
    """A framed chunk's table, and where each frame's bytes lie in the raw chunk."""

    items: int
    offsets: np.ndarray  # int64, items + 1: the items' starts in their bytes laid end to end
    frames: np.ndarray  # FRAME records
    starts: np.ndarray  # int64, frames + 1: each frame's first byte in the raw chunk, then its size

    @classmethod
    def parse(cls, head: bytes) -> FrameTable:
        """The table at the start of ``head`` (at least ``table_size(head)`` bytes), checked."""
        end = table_size(head)
        if len(head) < end:
            raise FrameTableError(f"table of {end} bytes cut short at {len(head)}")
        _, _, _, items, rows, count = PREFIX.unpack_from(head)
        if items == 0 or count == 0 or rows == 0:
            raise FrameTableError(f"no items ({items} items, {count} frames of {rows})")
        offsets = np.frombuffer(head, "<u4", items + 1, PREFIX.size).astype(np.int64)
        frames = np.frombuffer(head, FRAME, count, PREFIX.size + 4 * (items + 1)).copy()
        first = frames["first_item"].astype(np.int64)
        taken = frames["n_items"].astype(np.int64)
        bounds = np.concatenate([first, [items]])
        header = 4 * (items + 2)
        if (offsets[0] != 0 or np.any(np.diff(offsets) < 0) or first[0] != 0 or np.any(taken == 0)
                or np.any(first + taken != bounds[1:])):
            raise FrameTableError("offsets or frames out of order, or frames that do not cover the items")
        if np.any(frames["uncompressed_len"] != offsets[bounds[1:]] - offsets[first]):
            raise FrameTableError("a frame's uncompressed size disagrees with its items' offsets")
        if np.any(frames["compressed_off"] < end) or np.any(frames["compressed_len"] == 0):
            raise FrameTableError("a frame lies inside the table, or is empty")
        if header + offsets[-1] > 0xFFFFFFFF:
            raise FrameTableError("the raw chunk's offsets would not fit in 32 bits")
        return cls(items, offsets, frames, header + offsets[bounds])

    @property
    def header_size(self) -> int:
        return int(self.starts[0])

    @property
    def raw_size(self) -> int:
        return int(self.starts[-1])

    @property
    def nbytes(self) -> int:
        return self.offsets.nbytes + self.frames.nbytes + self.starts.nbytes

    def header(self) -> bytes:
        """The raw chunk's header: ``num_items``, then its offsets in the chunk."""
        offsets = (self.offsets + self.header_size).astype("<u4")
        return struct.pack("<I", self.items) + offsets.tobytes()

    def overlapping(self, start: int, end: int) -> range:
        """The frames whose raw bytes overlap raw bytes [start, end) (none for an empty range)."""
        if end <= start:
            return range(0)
        first = int(np.searchsorted(self.starts, start, "right")) - 1
        last = int(np.searchsorted(self.starts, end, "left"))
        return range(max(first, 0), min(last, len(self.frames)))
