"""Tar framing of a batch: member names, headers, the shards' own ranges, padding.

``TarFraming`` frames a batch stream as a tar (the default format, and GetBatch's), whichever
way its bytes came; ``arrow.py``'s ``ArrowFraming`` is its sibling for ``"format": "arrow"``,
with the same entry points (``head``, ``held``, ``read``, ``end``, ``length``), so ``stream.py``
sends either. The tar's are:

    held_parts     a group whose blocks are all in RAM (``warm.HeldGroup`` says where each
                   member lies): a member whose shard header names it as the batch does goes
                   out as the shard's own header + data + padding range (runs of them at
                   once); any other gets a built header, its data, its padding
    read_parts     a group read through the coalescer, or held with members the index lacks:
                   a built header and padding per member, and a zero-length placeholder for
                   a sample that failed (``continue_on_error``)
    stream_length  the stream's exact length, known before its first byte when RAM holds it
    chunks_of      parts joined into few chunks to send

Names come from a naming class: ``SampleNames`` for ``/v1/batch``, GetBatch's own for
``/v1/ml/moss``. The tar primitives (header bytes, padding sizes, the end marker) are
``shardfeed/tar.py``'s, shared with the client and the dataset tools.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from shardfeed.service.datasets.dataset import Dataset
from shardfeed.service.datasets.index import Members
from shardfeed.service.read.warm import BUILT, VERBATIM, VERBATIM_SPILLED, HeldGroup
from shardfeed.tar import BLOCK, END_OF_ARCHIVE, frame, member_header, padding

_PAD = bytes(BLOCK)
LARGE_PART = 256 * 1024
"""A part this large is sent as its own chunk, uncopied; smaller ones are joined into one."""


def missing_name(dataset: str, sample: int) -> str:
    """The zero-length placeholder member for a sample that could not be served."""
    return f"__404__/{dataset}/{sample}"


class SampleNames:
    """``/v1/batch`` member names: ``<key>.<field>``, and ``missing_name`` for a failed sample.

    A batch stream takes a factory of names per group, ``names(dataset, first, samples)``
    (``first``: the group's first request position, ``samples``: its sample numbers),
    so another API (GetBatch) can name the same members its own way.
    """

    shard_names = True
    """Members are named as the shards' own headers name them (``held_parts`` may send those)."""

    def __init__(self, dataset: Dataset, first: int, samples: np.ndarray):
        self.dataset_name = dataset.name
        self.fields = dataset.index.fields
        self.first = first
        self.samples = samples
        self.keys = dataset.index.keys(samples)

    def member(self, position: int, field: int) -> str:
        return f"{self.keys[position - self.first]}.{self.fields[field]}"

    def missing(self, position: int, cause: BaseException | None) -> str:
        return missing_name(self.dataset_name, int(self.samples[position - self.first]))


def _naming(names, dataset: Dataset, members: Members, indices: np.ndarray):
    """The group's naming (its positions are consecutive)."""
    positions = members.position
    first = int(positions[0]) if len(positions) else 0
    return names(dataset, first, indices[first:int(positions[-1]) + 1] if len(positions) else indices[:0])


def held_parts(held: HeldGroup, base: int, dataset: Dataset, members: Members, indices: np.ndarray,
               names) -> list:
    """The tar parts of a group of found members all held in RAM, whose rows start at ``base``
    in ``held``: members whose shard headers name them go out as the shards' own byte ranges
    (runs of them at once); the others are framed one by one."""
    n = len(members)
    runs = held.runs(base, base + n) if names.shard_names else [(base, base + n, BUILT)]
    naming = None
    out: list = []
    for lo, hi, kind in runs:
        if kind == VERBATIM:
            out += held.ranges(lo, hi)
        elif kind == VERBATIM_SPILLED:
            for at in range(lo, hi):
                out += held.spilled(at)
                if held.size[at] % BLOCK:  # as in the shard: the block after its data may not be held
                    out.append(_PAD[:padding(held.size[at])])
        else:
            if naming is None:  # a first member framed one by one
                positions, fields = members.position.tolist(), members.field.tolist()
                naming = _naming(names, dataset, members, indices)
            for at in range(lo, hi):
                out += frame(naming.member(positions[at - base], fields[at - base]), *held.data(at))
    return out


def read_parts(dataset: Dataset, members: Members, indices: np.ndarray, data: Callable[[int], Sequence],
               failed: dict[int, BaseException | None], names) -> tuple[list, int]:
    """The tar parts of a group member by member, and how many samples it served.

    ``data(row)``: the payload of member row ``row`` as parts. ``failed``: the positions of
    samples that could not be served, with the first cause (``None``: the index lacks a
    member); each becomes one zero-length placeholder, its other members left out."""
    naming = _naming(names, dataset, members, indices)
    out: list = []
    served = 0
    current = -1
    for row, (position, field) in enumerate(zip(members.position.tolist(), members.field.tolist())):
        if position != current:
            current = position
            if position in failed:
                out.append(member_header(naming.missing(position, failed[position]), 0))
                continue
            served += 1
        elif position in failed:
            continue
        out += frame(naming.member(position, field), *data(row))
    return out, served


class TarFraming:
    """A batch as a tar stream, its members named by ``names`` (``SampleNames`` by default)."""

    def __init__(self, names=SampleNames):
        self.names = names

    def head(self) -> list:
        return []

    def end(self) -> bytes:
        return END_OF_ARCHIVE

    def held(self, held: HeldGroup, base: int, dataset: Dataset, members: Members, indices: np.ndarray) -> list:
        return held_parts(held, base, dataset, members, indices, self.names)

    def read(self, dataset: Dataset, members: Members, indices: np.ndarray, data: Callable[[int], Sequence],
             failed: dict[int, BaseException | None]) -> tuple[list, int]:
        return read_parts(dataset, members, indices, data, failed, self.names)

    def length(self, dataset: Dataset, members: Members, indices: np.ndarray, held: HeldGroup | None,
               groups: list[tuple[int, int]]) -> int:
        """``stream_length`` (a tar's length does not depend on how the batch is cut into groups)."""
        return stream_length(dataset, members, indices, held)


def chunks_of(parts: list, large: int = LARGE_PART) -> list:
    """``parts`` as few chunks to send: runs of small parts joined, a part of ``large`` bytes
    or more passed as it is (a join would copy it only to send it)."""
    chunks, run = [], []
    for part in parts:
        if len(part) >= large:
            if run:
                chunks.append(b"".join(run))
                run = []
            chunks.append(part)
        else:
            run.append(part)
    if run or not chunks:
        chunks.append(b"".join(run))
    return chunks


def stream_length(dataset: Dataset, members: Members, indices: np.ndarray, held: HeldGroup | None = None) -> int:
    """The exact length of the batch's tar stream if every member found is served.

    Known up front when RAM holds every block of the batch (``held_group``: the stream is
    then framed from those very bytes and cannot fail), and sent as ``Content-Length``, it
    spares the HTTP server a copy of every chunk (chunked framing joins each chunk with
    its size line)."""
    found = members.found.all()
    if held is not None and found and not (held.kind == BUILT).any():  # the usual warm batch: shard ranges only
        return len(END_OF_ARCHIVE) + held.verbatim_bytes()
    index = dataset.index
    total = len(END_OF_ARCHIVE)
    if found:  # the usual case: no placeholder to size, every row served
        rows = np.ones(len(members), bool)
    else:
        missing = np.unique(members.position[~members.found])
        total += sum(len(member_header(missing_name(dataset.name, int(indices[p])), 0)) for p in missing.tolist())
        rows = ~np.isin(members.position, missing)
    if held is not None:  # a member sent as its shard's own range is that many bytes, whatever its name
        verbatim = rows & (held.kind != BUILT)
        total += held.verbatim_bytes(verbatim)
        rows &= ~verbatim
    if not rows.any():
        return total
    size = members.size[rows]
    total += int((size + (-size % 512)).sum())
    positions = members.position[rows]
    wanted = np.unique(positions)
    key_bytes = np.zeros(len(indices), np.int64)
    key_bytes[wanted] = [len(k.encode()) for k in index.keys(indices[wanted])]
    field_bytes = np.array([len(f.encode()) for f in index.fields], np.int64)
    name_bytes = key_bytes[positions] + 1 + field_bytes[members.field[rows]]
    total += 512 * len(name_bytes)
    for n in name_bytes[name_bytes > 100].tolist():  # a PAX record first (its length depends on the name's only)
        total += len(member_header("n" * n, 0)) - 512
    return total
