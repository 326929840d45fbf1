"""Batches as tensors: a batch's bytes in one ``torch.uint8`` buffer, read there from the socket.

The bytes output (:mod:`.samples`) makes a Python ``bytes`` per member, and a DataLoader
worker then pickles each one through a pipe to the training process. This output does
neither: the service says how long its answer is (``Content-Length``, or its
``X-Shardfeed-Length`` estimate on a streamed answer), so the client allocates one buffer, in
shared memory inside a DataLoader worker, and ``recv_into`` puts the body there (the head is
peeked at, so not even its first bytes are read elsewhere; :mod:`.answers`). The answer is
asked for as an Arrow IPC stream (``"format": "arrow"``), whose metadata states where every
sample's bytes lie, so nothing is parsed per member (:meth:`Columns.of_arrow
<.layout.Columns.of_arrow>`); from a service without that format, as a tar that the bytes
output's own parser walks in place (:meth:`BatchReader.spans <.samples.BatchReader.spans>`).
Both give the same :class:`~.layout.Columns`, so a batch is the same either way: a second
output of the client's parser, not a fork of it. The DataLoader hands the shared buffer to the
training process as a file descriptor, and ``pin_memory``/``.to(device)`` move it as one copy.

    batch = client.get_batch_tensors("train", [17, 4, 9])
    batch["jpg"][0]           # a zero-copy uint8 view of sample 17's jpg
    batch["cls"].stacked()    # fixed-size fields as one 2-D tensor (a view when evenly spaced)
    batch.to("cuda", non_blocking=True)

A transform's batch (``transform=``: run by the service, or by :mod:`.transformed` in the
DataLoader workers, laid out alike) has the transform's outputs as its fields, and
:attr:`Batch.outputs` reads them as the dtypes and shapes it declares: ``batch.outputs["image"]``
is a ``(n, 3, 224, 224)`` uint8 view of the buffer.

Views share the buffer's memory and keep it alive (as any tensor view does): a view stays
valid as long as it is held, and writing through it changes the batch. A batch read in parts
(routing: one request per owning worker or replica) lies in one buffer too, each part's
answer in its own stretch of it. In an Arrow answer a field's samples lie one after the other
(a fixed-size field evenly spaced, so ``stacked()`` is a view within a record batch); in a tar
answer each member starts 512-byte aligned, after its header.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from functools import cached_property
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch.utils.data._utils.collate import default_collate_fn_map

from shardfeed.transforms import SHAPE, Output

from . import shm
from .answers import Allocate, Regions
from .errors import ShardfeedError
from .base import outputs_of
from .layout import ABSENT, Columns

if TYPE_CHECKING:
    from .base import PartRequest

Outputs = dict[str, "torch.Tensor | list[torch.Tensor | None]"]
"""A transform's outputs by name: a stacked tensor where the shape is fixed, else a tensor per sample."""


def allocator(shared: bool) -> Allocate:
    """Where a tensor batch's answers are read (:mod:`.answers`): an uninitialised uint8 tensor, in
    shared memory when ``shared`` (moving one there later would copy it), then from this process's
    pool of segments where one is free. What holds the array is the tensor and its lease."""
    def allocate(size: int) -> tuple[np.ndarray, tuple[torch.Tensor, shm.Lease | None]]:
        tensor, lease = shm.lease(size) if shared else (torch.empty(size, dtype=torch.uint8), None)
        return tensor.numpy(), (tensor, lease)
    return allocate


def batch_of(requests: Sequence[PartRequest], regions: Regions) -> Batch:
    """The batch of the parts' answers read into ``regions``, laid out in place (either format)."""
    parts = [request.columns(region.data()) for request, region in zip(requests, regions.regions)]
    _, (buffer, lease), starts = regions.joined()
    columns = Columns.merged(parts, starts.tolist(), [r.part.positions for r in requests])
    return Batch.of(buffer, columns, lease, outputs_of(requests))


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
        """Each sample's bytes read as ``dtype`` (token ids, float records), without a copy where
        they start at a multiple of its size in the buffer: always in a tar answer (members
        start 512-byte aligned), in an Arrow answer when the samples before it in its record
        batch are whole multiples of it (a column's values start 64-byte aligned, then each
        sample's bytes follow the last's; 8-byte aligned in a mixed batch's later datasets, whose
        streams follow the one before's 8-byte end marker in their owner's answer); else that
        sample's bytes are copied first."""
        size = torch.empty(0, dtype=dtype).element_size()
        return [None if v is None else (v if v.storage_offset() % size == 0 else v.clone()).view(dtype)
                for v in self]

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
    ``continue_on_error``), ``fields`` (names, in the order they came), ``shared``; a mixture's
    batch also ``streams`` (int64 tensor: each sample's stream, numbered as the mixture's streams
    are; ``None`` otherwise). ``batch[i]`` and iteration give sample dicts, ``{"__key__",
    "__index__", "<field>": view}`` (and ``"__stream__"`` in a mixture's), as the bytes output
    does with ``bytes`` (a transform's batch: its outputs, typed). :meth:`pin_memory` and
    :meth:`to` move the buffer as one copy (``DataLoader(pin_memory=True)`` calls the former),
    the offsets staying on the host.
    A transform's batch also has ``declared`` (its outputs' dtypes and shapes, ``None`` for
    another batch) and :attr:`outputs`, them as typed tensors.
    """

    def __init__(self, buffer: torch.Tensor, keys: list[str | None], indices: np.ndarray, missing: np.ndarray,
                 offsets: dict[str, np.ndarray], lengths: dict[str, np.ndarray], lease: shm.Lease | None = None,
                 pooled: bool = False, streams: np.ndarray | None = None,
                 declared: Mapping[str, Output] | None = None):
        self.buffer = buffer
        self._lease = lease
        self._pooled = pooled or lease is not None  # over a segment of a pool (shm.py), here or elsewhere
        self.keys = keys
        self._indices = indices
        self._missing = missing
        self._offsets = offsets
        self._lengths = lengths
        self._streams = streams
        self.declared = declared

    @classmethod
    def of(cls, buffer: torch.Tensor, columns: Columns, lease: shm.Lease | None = None,
           declared: Mapping[str, Output] | None = None) -> Batch:
        """A batch over ``buffer`` laid out as ``columns`` (offsets in ``buffer``; ``lease``: a
        pooled shared buffer's; ``declared``: a transform's outputs, its fields)."""
        return cls(buffer, columns.keys, columns.indices, columns.missing, columns.offsets, columns.lengths, lease,
                   declared=declared)

    def __reduce__(self) -> tuple:
        # A pooled buffer travels as its segment's name (the receiver maps it: :mod:`.shm`);
        # any other as a tensor, which torch's pickler for processes shares.
        arrays = (self.keys, self._indices, self._missing, self._offsets, self._lengths)
        found = shm.reduce(self._lease) if self._lease is not None else None
        if found is not None:
            return _attached_batch, (*found, self._streams, self.declared, *arrays)
        return _batch, (self.buffer, self._streams, self.declared, *arrays)

    @property
    def shared(self) -> bool:
        """Whether the buffer lies in shared memory (another process can map it uncopied)."""
        return self._pooled or self.buffer.is_shared()

    @property
    def fields(self) -> list[str]:
        return list(self._offsets)

    indices = _as_tensor("_indices", "The samples' indices (int64).")
    missing = _as_tensor("_missing", "Which samples the service could not serve (bool).")

    @property
    def streams(self) -> torch.Tensor | None:
        """In a mixture's batch, each sample's stream (int64); else ``None``."""
        return None if self._streams is None else torch.from_numpy(self._streams)

    @cached_property
    def outputs(self) -> Outputs:
        """A transform's batch's outputs by name, each as its declared dtype: ``(n, *shape)`` where
        the shape is fixed (a view of the buffer when its samples lie evenly spaced there, as in one
        answer's record batch; else a copy; a missing sample's row zeros, see :attr:`missing`), else
        a list of one tensor per sample, shaped as its ``<name>.shape`` field says (``None`` for a
        missing sample). ``TypeError`` for a batch of no transform."""
        if self.declared is None:
            raise TypeError("this batch is not a transform's: its fields are bytes (batch[name][i])")
        return {name: self._stacked(name, output) if output.fixed else self._each(name, output)
                for name, output in self.declared.items()}

    def _stacked(self, name: str, output: Output) -> torch.Tensor:
        """Output ``name`` (of a fixed shape) as one ``(n, *shape)`` tensor."""
        dtype, size = _dtype(output.dtype), np.dtype(output.dtype).itemsize * math.prod(output.shape)
        lengths = self._lengths[name]
        present = lengths != ABSENT
        if (lengths[present] != size).any():
            wrong = int(lengths[present][lengths[present] != size][0])
            raise ShardfeedError(f"output {name!r}: a sample of {wrong} bytes, not one {output.dtype} array of "
                                 f"shape {output.shape} ({size} bytes)")
        if not len(self):
            return self.buffer.new_empty((0, *output.shape), dtype=dtype)
        if present.all():
            rows = self[name].stacked()
        else:  # a missing sample's row: zeros
            rows = self.buffer.new_zeros((len(self), size))
            field = self[name]
            for i in np.flatnonzero(present).tolist():
                rows[i] = field[i]
        return _typed(rows, dtype).reshape(len(self), *output.shape)

    def _each(self, name: str, output: Output) -> list[torch.Tensor | None]:
        """Output ``name`` (of a varying shape) as a tensor per sample, shaped by its ``.shape`` field."""
        dtype, itemsize = _dtype(output.dtype), np.dtype(output.dtype).itemsize
        shapes = self[name + SHAPE]
        out: list[torch.Tensor | None] = []
        for i, data in enumerate(self[name]):
            if data is None:
                out.append(None)
                continue
            dims = shapes[i]
            shape = () if dims is None else tuple(_typed(dims, torch.int64).tolist())
            if dims is None or len(shape) != len(output.shape) or math.prod(shape) * itemsize != len(data):
                raise ShardfeedError(f"output {name!r}: sample {int(self._indices[i])} has {len(data)} bytes and "
                                     f"shape {shape}, not a {output.dtype} array of shape {output.shape}")
            out.append(_typed(data, dtype).reshape(shape))
        return out

    def with_streams(self, streams: np.ndarray) -> Batch:
        """This batch, its samples' streams told (a mixture's batch, made by ``client/torch.py``)."""
        self._streams = streams
        return self

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
        if self._streams is not None:
            sample["__stream__"] = int(self._streams[i])
        if self._missing[i]:
            sample["__missing__"] = True
            return sample
        if self.declared is not None:  # a transform's: its outputs, typed
            return {**sample, **{name: output[i] for name, output in self.outputs.items()}}
        for name, offsets in self._offsets.items():
            length = int(self._lengths[name][i])
            if length != ABSENT:
                sample[name] = self.buffer[int(offsets[i]):int(offsets[i]) + length]
        return sample

    def _with(self, buffer: torch.Tensor) -> Batch:
        return Batch(buffer, self.keys, self._indices, self._missing, self._offsets, self._lengths,
                     streams=self._streams, declared=self.declared)

    def pin_memory(self) -> Batch:
        """The batch in page-locked memory (one copy), for ``.to(device, non_blocking=True)``."""
        return self._with(self.buffer.pin_memory())

    def to(self, device: Any, non_blocking: bool = False) -> Batch:
        """The batch with its buffer on ``device`` (one copy); views then live there too."""
        return self._with(self.buffer.to(device, non_blocking=non_blocking))

    def __repr__(self) -> str:
        return (f"Batch({len(self)} samples, fields {self.fields}, {self.buffer.numel()} bytes "
                f"on {self.buffer.device}{', shared' if self.shared else ''})")


def _attached_batch(path: str, size: int, streams: np.ndarray | None, declared: Mapping[str, Output] | None,
                    *arrays: Any) -> Batch:
    """A batch received from another process, over the pooled segment at ``path``."""
    return Batch(shm.attach(path, size), *arrays, pooled=True, streams=streams, declared=declared)


def _batch(buffer: torch.Tensor, streams: np.ndarray | None, declared: Mapping[str, Output] | None,
           *arrays: Any) -> Batch:
    """A batch received from another process, its buffer a tensor torch's pickler shared."""
    return Batch(buffer, *arrays, streams=streams, declared=declared)


def _dtype(name: str) -> torch.dtype:
    """The torch dtype of a numpy dtype's name (an output's declared dtype)."""
    return torch.from_numpy(np.empty(0, np.dtype(name))).dtype


def _typed(data: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """uint8 ``data`` (its last dimension whole elements) read as ``dtype``: a view where its place
    in the buffer is a multiple of the element's size, else a copy first."""
    if dtype == torch.uint8:
        return data
    try:
        return data.view(dtype)
    except RuntimeError:  # not aligned to the element's size in the buffer
        return data.clone().view(dtype)


def one_batch(batches: Sequence[Any], *, collate_fn_map: Any = None) -> Any:
    """``default_collate`` of what a map-style dataset's ``__getitems__`` returns with
    ``output="tensors"`` (or ``"arrow"``): the list holding its one batch, handed on as it is."""
    if len(batches) != 1:
        raise TypeError(f"default_collate got {len(batches)} {type(batches[0]).__name__}s: a DataLoader batch is one")
    return batches[0]


default_collate_fn_map[Batch] = one_batch
