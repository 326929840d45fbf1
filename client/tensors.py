"""Batches as tensors: a batch's bytes in one ``torch.uint8`` buffer, read there from the socket.

The bytes output (:mod:`.samples`) makes a Python ``bytes`` per member, and a DataLoader
worker then pickles each one through a pipe to the training process. This output does
neither: the service says how long its answer is (``Content-Length``, or its
``X-Shardfeed-Length`` estimate on a streamed answer), so the client allocates one buffer, in
shared memory inside a DataLoader worker, and ``recv_into`` puts the body there (the head is
peeked at, so not even its first bytes are read elsewhere). :meth:`BatchReader.spans
<.samples.BatchReader.spans>`, the same parser as the bytes output's, then finds each member
in place. The DataLoader hands the shared buffer to the training process as a file
descriptor, and ``pin_memory``/``.to(device)`` move it as one copy.

    batch = client.get_batch_tensors("train", [17, 4, 9])
    batch["jpg"][0]           # a zero-copy uint8 view of sample 17's jpg
    batch["cls"].stacked()    # fixed-size fields as one 2-D tensor (a view when evenly spaced)
    batch.to("cuda", non_blocking=True)

Views share the buffer's memory and keep it alive (as any tensor view does): a view stays
valid as long as it is held, and writing through it changes the batch. A batch read in parts
(routing: one request per owning worker or replica) lies in one buffer too, each part's
answer in its own stretch of it.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch.utils.data._utils.collate import default_collate_fn_map

from . import shm
from .routing import merge_order

if TYPE_CHECKING:
    from .base import PartRequest
    from .transport.sync import Response

ABSENT = -1
"""The length of a field a sample lacks (or of every field of a missing sample)."""
GUESS = 1 << 20
"""Bytes allocated for an answer that states no length; the buffer grows if it is longer."""
LENGTH_HEADER = "x-shardfeed-length"
"""A streamed batch answer's expected length (a tensor batch's buffer is sized by it)."""


def allocate(size: int, shared: bool) -> tuple[torch.Tensor, shm.Lease | None]:
    """An uninitialised uint8 tensor, in shared memory when ``shared`` (moving one there later
    would copy it): then from this process's pool of segments where one is free (its lease)."""
    if not shared:
        return torch.empty(size, dtype=torch.uint8), None
    return shm.lease(size)


class Region:
    """Where one answer is read: a stretch of the batch's buffer (a :class:`~.transport.base.Sink`). An
    answer longer than the stretch moves to a tensor of its own, grown by doubling."""

    def __init__(self, tensor: torch.Tensor, shared: bool):
        self.tensor = tensor
        self.shared = shared
        self.filled = 0
        self.moved = False
        self._memory = memoryview(tensor.numpy())

    def space(self, wanted: int) -> memoryview:
        if self.filled == len(self.tensor):
            self._grow(self.filled + wanted)
        return self._memory[self.filled:self.filled + wanted]

    def wrote(self, n: int) -> None:
        self.filled += n

    def write(self, data: bytes) -> None:
        at = 0
        while at < len(data):
            view = self.space(len(data) - at)
            view[:] = data[at:at + len(view)]
            self.wrote(len(view))
            at += len(view)

    def data(self) -> memoryview:
        return self._memory[:self.filled]

    def _grow(self, at_least: int) -> None:
        bigger = allocate(max(at_least, 2 * len(self.tensor), GUESS), self.shared)[0]
        bigger[:self.filled] = self.tensor[:self.filled]
        self.tensor, self.moved = bigger, True
        self._memory = memoryview(bigger.numpy())


class Regions:
    """One buffer for the answers of a batch's parts, a stretch each, sized as announced."""

    def __init__(self, sizes: Sequence[int], shared: bool):
        self.shared = shared
        self.starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        self.buffer, self.lease = allocate(int(self.starts[-1]), shared)
        self.regions = [Region(self.buffer[int(a):int(b)], shared) for a, b in zip(self.starts, self.starts[1:])]

    def joined(self) -> tuple[torch.Tensor, shm.Lease | None, np.ndarray]:
        """The buffer holding every answer (and its lease), and where each answer starts in it.
        The usual case is the buffer read into; an answer longer than announced costs one copy."""
        if not any(r.moved for r in self.regions):
            return self.buffer, self.lease, self.starts[:-1]
        starts = np.concatenate([[0], np.cumsum([r.filled for r in self.regions])]).astype(np.int64)
        buffer, lease = allocate(int(starts[-1]), self.shared)
        for region, start in zip(self.regions, starts.tolist()):
            buffer[start:start + region.filled] = region.tensor[:region.filled]
        return buffer, lease, starts[:-1]


def announced_length(headers: Mapping[str, str], default: int) -> int:
    """A batch answer's length as its head states it (``Content-Length``, else the service's
    estimate, ``LENGTH_HEADER``); ``default`` when it states none a number."""
    for name in ("content-length", LENGTH_HEADER):
        value = headers.get(name, "")
        if value.isdigit():
            return int(value)
    return default


def regions_for(responses: Sequence[Response], shared: bool) -> Regions:
    """Where the answers of a batch's parts are read: one buffer, sized as their heads say."""
    return Regions([announced_length(r.headers, GUESS) for r in responses], shared)


def batch_of(requests: Sequence[PartRequest], regions: Regions) -> Batch:
    """The batch of the parts' answers read into ``regions``, parsed in place."""
    samples = [request.reader.spans(region.data()) for request, region in zip(requests, regions.regions)]
    buffer, lease, starts = regions.joined()
    return Batch.of(buffer, samples, starts.tolist(), merge_order([r.part for r in requests]), lease)


def _as_tensor(attr: str, doc: str) -> property:
    """A read-only property: the numpy array in ``attr`` as a tensor sharing its memory."""
    return property(lambda self: torch.from_numpy(getattr(self, attr)), doc=doc)


class Field:
    """One field of a :class:`Batch`: ``field[i]`` is sample ``i``'s bytes as a uint8 view of
    the batch's buffer (``None`` where the sample lacks it)."""

    def __init__(self, buffer: torch.Tensor, name: str, offsets: np.ndarray, lengths: np.ndarray):
        self.buffer = buffer
        self.name = name
        self._offsets = offsets
        self._lengths = lengths

    offsets = _as_tensor("_offsets", "Where each sample's bytes start in the buffer (int64).")
    lengths = _as_tensor("_lengths", "Each sample's byte count (int64; ``ABSENT``, -1, where it lacks the field).")

    def __len__(self) -> int:
        return len(self._offsets)

    def __getitem__(self, i: int) -> torch.Tensor | None:
        length = int(self._lengths[i])
        if length == ABSENT:
            return None
        start = int(self._offsets[i])
        return self.buffer[start:start + length]

    def __iter__(self) -> Iterator[torch.Tensor | None]:
        buffer = self.buffer
        for start, length in zip(self._offsets.tolist(), self._lengths.tolist()):
            yield None if length == ABSENT else buffer[start:start + length]

    def view(self, dtype: torch.dtype) -> list[torch.Tensor | None]:
        """Each sample's bytes read as ``dtype`` (token ids, float records), without a copy:
        members start 512-byte aligned in the buffer."""
        return [None if v is None else v.view(dtype) for v in self]

    def stacked(self, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        """Every sample's bytes as one ``(len, size)`` tensor of ``dtype`` (fixed-size fields:
        labels, embeddings, token windows): a view of the buffer when the samples lie evenly
        spaced in it (the usual batch, its samples alike), else a copy. ``ValueError`` when the
        sizes differ or a sample lacks the field."""
        lengths = self._lengths
        if len(lengths) == 0:
            return torch.empty((0, 0), dtype=dtype)
        size = int(lengths[0])
        if size == ABSENT or (lengths != size).any():
            raise ValueError(f"field {self.name!r} is not one size in every sample of the batch "
                             f"(sizes {sorted(set(lengths.tolist()))[:5]}): use batch[{self.name!r}][i]")
        steps = np.diff(self._offsets)
        if len(steps) and (steps != steps[0]).any():
            rows = torch.stack([self.buffer[o:o + size] for o in self._offsets.tolist()])
        else:
            step = int(steps[0]) if len(steps) else size
            rows = self.buffer.as_strided((len(lengths), size), (step, 1), int(self._offsets[0]))
        return rows if dtype == torch.uint8 else rows.view(dtype)


class Batch:
    """A batch whose bytes lie in one uint8 tensor, ``buffer``: ``batch["jpg"][i]`` is a view.

    ``len(batch)`` samples; ``keys`` (``None`` for a missing sample), ``indices`` (int64
    tensor), ``missing`` (bool tensor: samples the service could not serve, with
    ``continue_on_error``), ``fields`` (names, in the order they came), ``shared``. ``batch[i]`` and
    iteration give sample dicts, ``{"__key__", "__index__", "<field>": view}``, as the bytes
    output does with ``bytes``. :meth:`pin_memory` and :meth:`to` move the buffer as one copy
    (``DataLoader(pin_memory=True)`` calls the former), the offsets staying on the host.
    """

    def __init__(self, buffer: torch.Tensor, keys: list[str | None], indices: np.ndarray, missing: np.ndarray,
                 offsets: dict[str, np.ndarray], lengths: dict[str, np.ndarray], lease: shm.Lease | None = None,
                 pooled: bool = False):
        self.buffer = buffer
        self._lease = lease
        self._pooled = pooled or lease is not None  # over a segment of a pool (shm.py), here or elsewhere
        self.keys = keys
        self._indices = indices
        self._missing = missing
        self._offsets = offsets
        self._lengths = lengths

    @classmethod
    def of(cls, buffer: torch.Tensor, samples: list[list[dict]], starts: Sequence[int],
           order: list[tuple[int, int]] | None = None, lease: shm.Lease | None = None) -> Batch:
        """A batch from the parsed answers of its parts (:meth:`BatchReader.spans`: payloads
        as ``(offset, size)`` in each answer), the answer of part ``p`` at ``starts[p]`` in
        ``buffer`` (``lease``: a pooled shared buffer's); ``order``: each position's
        ``(part, row)`` (:func:`~.routing.merge_order`)."""
        if order is None:
            order = [(0, row) for row in range(len(samples[0]))]
        n = len(order)
        keys: list[str | None] = [None] * n
        indices = np.empty(n, np.int64)
        missing = np.zeros(n, bool)
        offsets: dict[str, np.ndarray] = {}
        lengths: dict[str, np.ndarray] = {}
        for position, (part, row) in enumerate(order):
            sample = samples[part][row]
            keys[position] = sample["__key__"]
            indices[position] = sample["__index__"]
            if sample.get("__missing__"):
                missing[position] = True
                continue
            base = starts[part]
            for name, value in sample.items():
                if name.startswith("__"):
                    continue
                if name not in offsets:
                    offsets[name] = np.zeros(n, np.int64)
                    lengths[name] = np.full(n, ABSENT, np.int64)
                offsets[name][position] = base + value[0]
                lengths[name][position] = value[1]
        return cls(buffer, keys, indices, missing, offsets, lengths, lease)

    def __reduce__(self) -> tuple:
        # A pooled buffer travels as its segment's name (the receiver maps it: :mod:`.shm`);
        # any other as a tensor, which torch's pickler for processes shares.
        arrays = (self.keys, self._indices, self._missing, self._offsets, self._lengths)
        found = shm.reduce(self._lease) if self._lease is not None else None
        if found is not None:
            return _attached_batch, (*found, *arrays)
        return Batch, (self.buffer, *arrays)

    @property
    def shared(self) -> bool:
        """Whether the buffer lies in shared memory (another process can map it uncopied)."""
        return self._pooled or self.buffer.is_shared()

    @property
    def fields(self) -> list[str]:
        return list(self._offsets)

    indices = _as_tensor("_indices", "The samples' indices (int64).")
    missing = _as_tensor("_missing", "Which samples the service could not serve (bool).")

    def __len__(self) -> int:
        return len(self.keys)

    def __getitem__(self, item: str | int) -> Any:
        if isinstance(item, str):
            if item not in self._offsets:
                raise KeyError(f"no field {item!r} in this batch (fields: {', '.join(self._offsets) or 'none'})")
            return Field(self.buffer, item, self._offsets[item], self._lengths[item])
        return self._sample(range(len(self))[item])

    def __iter__(self) -> Iterator[dict]:
        return (self._sample(i) for i in range(len(self)))

    def _sample(self, i: int) -> dict:
        sample: dict[str, Any] = {"__key__": self.keys[i], "__index__": int(self._indices[i])}
        if self._missing[i]:
            sample["__missing__"] = True
            return sample
        for name, offsets in self._offsets.items():
            length = int(self._lengths[name][i])
            if length != ABSENT:
                sample[name] = self.buffer[int(offsets[i]):int(offsets[i]) + length]
        return sample

    def _with(self, buffer: torch.Tensor) -> Batch:
        return Batch(buffer, self.keys, self._indices, self._missing, self._offsets, self._lengths)

    def pin_memory(self) -> Batch:
        """The batch in page-locked memory (one copy), for ``.to(device, non_blocking=True)``."""
        return self._with(self.buffer.pin_memory())

    def to(self, device: Any, non_blocking: bool = False) -> Batch:
        """The batch with its buffer on ``device`` (one copy); views then live there too."""
        return self._with(self.buffer.to(device, non_blocking=non_blocking))

    def __repr__(self) -> str:
        return (f"Batch({len(self)} samples, fields {self.fields}, {self.buffer.numel()} bytes "
                f"on {self.buffer.device}{', shared' if self.shared else ''})")


def _attached_batch(path: str, size: int, *arrays: Any) -> Batch:
    """A batch received from another process, over the pooled segment at ``path``."""
    return Batch(shm.attach(path, size), *arrays, pooled=True)


def _collate_batches(batches: Sequence[Batch], *, collate_fn_map: Any = None) -> Batch:
    """``default_collate`` of what a map-style dataset's ``__getitems__`` returns with
    ``output="tensors"``: the list holding its one ``Batch``, handed on as it is."""
    if len(batches) != 1:
        raise TypeError(f"default_collate got {len(batches)} tensor Batches: a DataLoader batch is one")
    return batches[0]


default_collate_fn_map[Batch] = _collate_batches
