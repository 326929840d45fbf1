"""A transform run in the DataLoader workers: the same :class:`~.tensors.Batch` the service's answer makes.

``ShardfeedDataset(..., transform=<a shardfeed.transforms.Transform>)`` runs the transform on the
GPU host, for A/B against the service or without spare CPU nodes: a batch's samples are read as
bytes (the transform's ``fields``), each is ``prepare``d and then :func:`~shardfeed.transforms.apply`\\ d
with its ``(seed, epoch, index)``, the functions the service's pool calls, and the outputs are laid
out in one uint8 buffer as the service's Arrow answer lays them out (:func:`lay_out`). So
``batch.outputs`` is the service's, byte for byte, and the batch crosses to the training process
in shared memory as any tensor batch does.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from shardfeed.arrowipc import aligned
from shardfeed.transforms import SHAPE, Transform, TransformError, apply

from .layout import ABSENT, Columns
from .samples import MISSING
from .tensors import Batch, allocator

Row = dict[str, np.ndarray]
"""One sample's outputs, as :func:`~shardfeed.transforms.apply` returns them."""


def transformed(transform: Transform, samples: Sequence[dict], seed: int, epoch: int, *,
                continue_on_error: bool = False, shared: bool = False) -> Batch:
    """The batch of ``transform``'s outputs for ``samples`` (sample dicts of bytes, as
    ``Client.get_batch`` gives them); ``shared``: in shared memory, as a DataLoader worker wants it.
    A sample the service could not serve is missing; so is one the transform fails on with
    ``continue_on_error``, else its ``TransformError`` names the sample and the stage that raised."""
    rows = [None if sample.get(MISSING) else outputs(transform, sample, seed, epoch, continue_on_error)
            for sample in samples]
    keys = [None if row is None else sample["__key__"] for sample, row in zip(samples, rows)]
    indices = np.array([sample["__index__"] for sample in samples], np.int64)
    return lay_out(transform, keys, indices, rows, shared)


def outputs(transform: Transform, sample: dict, seed: int, epoch: int, continue_on_error: bool) -> Row | None:
    """One sample's outputs; ``None`` when the transform fails on it with ``continue_on_error``."""
    index = sample["__index__"]
    stage = "prepare"
    try:
        prepared = transform.prepare({k: v for k, v in sample.items() if not k.startswith("__")})
        stage = "augment"
        return apply(transform, prepared, seed, epoch, index)
    except Exception as err:
        if continue_on_error:
            return None
        raise TransformError(f"sample {index} ({sample['__key__']!r}): {stage} raised "
                             f"{type(err).__name__}: {err}") from err


def lay_out(transform: Transform, keys: list[str | None], indices: np.ndarray, rows: list[Row | None],
            shared: bool) -> Batch:
    """The rows' outputs in one buffer as an Arrow answer holds them: a field per output and per
    varying output's shape (:func:`shardfeed.transforms.output_columns`), each starting 64-byte
    aligned, its samples one after the other (a fixed output's ``(n, *shape)`` is then a view); a
    missing row ``ABSENT`` in every field."""
    cells: dict[str, list[np.ndarray | None]] = {}
    for name, output in transform.outputs.items():
        cells[name] = [None if row is None else row[name] for row in rows]
        if not output.fixed:
            cells[name + SHAPE] = [None if row is None else np.asarray(row[name].shape, "<i8") for row in rows]
    sizes = {name: sum(a.nbytes for a in column if a is not None) for name, column in cells.items()}
    array, (buffer, lease) = allocator(shared)(sum(aligned(size) for size in sizes.values()))
    offsets, lengths, at = {}, {}, 0
    for name, column in cells.items():
        offsets[name], lengths[name] = np.full(len(rows), at, np.int64), np.full(len(rows), ABSENT, np.int64)
        for i, cell in enumerate(column):
            if cell is None:
                continue
            offsets[name][i], lengths[name][i] = at, cell.nbytes
            array[at:at + cell.nbytes] = cell.reshape(-1).view(np.uint8)
            at += cell.nbytes
        array[at:aligned(at)] = 0
        at = aligned(at)
    missing = np.array([row is None for row in rows], bool)
    return Batch.of(buffer, Columns(keys, indices, missing, offsets, lengths), lease, dict(transform.outputs))
