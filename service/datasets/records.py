"""Records: the samples of MosaicML Streaming's MDS shards and LitData's chunks, where each
field lies in one, and a peer's dataset as its ``index.json`` describes it (``PeerLayout``).

Both peers lay a shard out the same way: ``num_samples`` (uint32), ``num_samples + 1`` uint32
offsets of the samples (from the shard's start), then the samples. A sample is one *record*:
a header of uint32 sizes, then its columns' bytes back to back, in column order::

    MDS      a size for each variable-size column only (a fixed-size one, ``column_sizes``,
             is as long in every record)
    LitData  a size for every leaf of the item's pytree

The shard's header says where each record lies, but only each record's own header says where
its fields lie. So the index (``peerindex.py``) is built from the shards' headers alone, one
row per field holding its *record*'s extent, and a batch finds its fields in the records'
headers when it reads them (``read/fields.py``, with ``RecordFormat.sizes``). Each field's
bytes are the column's encoded bytes, what the peer's own decoder is given.

(LitData writes items of plain values alone as empty records and an Arrow file after them:
``arrowfooter.py`` finds each field's own extent there, and those fields need no placing.)
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from shardfeed.service.datasets.indexfile import IndexFormatError


@dataclass(frozen=True)
class Column:
    """One field of a record."""

    name: str
    """The field's name: the MDS column's, or the LitData leaf's (``peerindex.leaf_names``)."""
    encoding: str
    """How the peer encoded its values (``int``, ``jpeg``, ``no_header_numpy:10``, ...): what
    the client's ``decode=`` decodes it by."""
    size: int | None
    """Its bytes in every record, when the record's header does not say (MDS fixed-size columns)."""


@dataclass(frozen=True)
class RecordFormat:
    """The columns of a dataset's records, in record order, and how a record's header sizes them."""

    layout: str
    columns: tuple[Column, ...]

    @cached_property
    def sized(self) -> np.ndarray:
        """bool per column: the record's header holds its size."""
        return np.array([c.size is None for c in self.columns], bool)

    @cached_property
    def header_bytes(self) -> int:
        """Bytes of a record's header."""
        return 4 * int(self.sized.sum())

    @cached_property
    def least_bytes(self) -> int:
        """Bytes of the smallest record: its header and its fixed-size columns."""
        return self.header_bytes + sum(c.size for c in self.columns if c.size is not None)

    @cached_property
    def encodings(self) -> dict[str, str]:
        return {c.name: c.encoding for c in self.columns}

    def sizes(self, headers: np.ndarray) -> np.ndarray:
        """(records, columns) int64: each column's size in each record, from the records'
        headers (``(records, header_bytes // 4)`` uint32)."""
        sizes = np.empty((len(headers), len(self.columns)), np.int64)
        sized = self.sized
        sizes[:, sized] = headers
        sizes[:, ~sized] = [c.size for c in self.columns if c.size is not None]
        return sizes

    def check(self, sizes: np.ndarray, record_sizes: np.ndarray, shards: np.ndarray, names: list[str]) -> None:
        """``IndexFormatError`` naming the shard of the first record whose header disagrees with
        the record's extent in its shard's header."""
        bad = self.header_bytes + sizes.sum(axis=1) != record_sizes
        if bad.any():
            at = int(np.flatnonzero(bad)[0])
            raise IndexFormatError(
                f"{names[int(shards[at])]}: a record's header sizes its fields at "
                f"{self.header_bytes + int(sizes[at].sum())} bytes, the shard's header at {int(record_sizes[at])}")


@dataclass(frozen=True)
class PeerShard:
    """One shard as ``index.json`` names it."""

    name: str
    """The raw (uncompressed) shard's path under the root: the index's shard name."""
    samples: int
    raw_size: int | None
    """Its raw bytes, when ``index.json`` says."""
    stored: str
    """The object holding it: ``name`` itself, or its compressed form."""
    codec: str | None = None
    """The peer's compression of ``stored`` (``zstd``, ``gz:9``, ...); None: stored raw."""
    frames: bool = False
    """LitData's framed zstd layout: frames compressed one by one, read one by one."""
    digests: tuple[tuple[str, str], ...] = ()
    """``(algorithm, hex digest)`` of ``stored`` as ``index.json`` records them (MDS's ``hashes``)."""


@dataclass(frozen=True)
class PeerLayout:
    format: RecordFormat
    shards: tuple[PeerShard, ...]

    @property
    def compressed(self) -> dict[str, PeerShard]:
        """The shards stored compressed, by raw name."""
        return {shard.name: shard for shard in self.shards if shard.codec is not None}


def field_names(names: list[str], where: str) -> list[str]:
    """Column names as fields: lowercased (as tar members' are), and distinct."""
    fields = [name.lower() for name in names]
    if len(set(fields)) < len(fields) or "" in fields:
        raise IndexFormatError(f"{where}: columns {names} are not distinct non-empty names once lowercased")
    return fields
