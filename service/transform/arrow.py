"""A transformed batch as an Arrow IPC stream: one record batch, a row per sample.

Columns: ``__key__`` (large_utf8), ``__index__`` (int64), then for each declared output, in
declared order, a ``large_binary`` column named as the output, each cell the array's bytes (C
order, little-endian); right after an output with a ``None`` dimension, ``<name>.shape``
(large_binary), each cell its ``ndim`` int64 little-endian dimensions. A failed sample
(``continue_on_error``) is a null in every column but ``__index__``.

The whole batch is computed before its first byte, so the stream is framed at once, its length
known; each cell goes out as a view of the array the pool's answer holds (nothing copied).
"""

from __future__ import annotations

import numpy as np

from shardfeed.arrowipc import END_OF_STREAM, BodyLayout, record_batch_message, validity_bitmap
from shardfeed.service.read.arrow import schema_message
from shardfeed.transforms.base import SHAPE, Transform, output_columns


def frame(transform: Transform, indices: np.ndarray, key_offsets: np.ndarray, key_text: np.ndarray,
          rows: list[dict[str, np.ndarray] | None]) -> list:
    """The stream's parts (bytes and views): its schema, one record batch of ``rows`` (each
    sample's checked outputs, ``None`` for a failed one), its end."""
    n = len(rows)
    served = np.array([row is not None for row in rows], bool)
    everyone = bool(served.all())
    validity = b"" if everyone else validity_bitmap(served)
    nulls = n - int(served.sum())
    nodes = [(n, nulls), (n, 0)]
    buffers: list[tuple[int, list]] = [
        (len(validity), [validity]), *_whole(key_offsets.astype("<i8", copy=False)), *_whole(key_text),
        (0, []), *_whole(np.asarray(indices).astype("<i8", copy=False))]
    names = output_columns(transform.outputs)
    for column in names:
        output, shape = column.removesuffix(SHAPE), column.endswith(SHAPE)  # output names have no dot
        cells = [None if row is None else _cell(row[output], shape) for row in rows]
        sizes = np.array([0 if cell is None else len(cell) for cell in cells], np.int64)
        offsets = np.zeros(n + 1, "<i8")
        np.cumsum(sizes, out=offsets[1:])
        nodes.append((n, nulls))
        buffers += [(len(validity), [validity]), *_whole(offsets),
                    (int(offsets[-1]), [cell for cell in cells if cell is not None and len(cell)])]
    body = BodyLayout.of([length for length, _ in buffers])
    out = [schema_message(tuple(names)),
           record_batch_message(n, np.array(nodes, np.int64), body)]
    for (_, parts), gap in zip(buffers, body.gaps):
        out += [part for part in parts if len(part)]
        if gap:
            out.append(bytes(gap))
    out.append(END_OF_STREAM)
    return out


def _whole(array: np.ndarray) -> list[tuple[int, list]]:
    view = memoryview(np.ascontiguousarray(array)).cast("B")
    return [(len(view), [view])]


def _cell(array: np.ndarray, shape: bool) -> memoryview | bytes:
    """One cell: the array's bytes (a view: ``checked`` made it C-contiguous little-endian), or its dims."""
    if shape:
        return np.asarray(array.shape, "<i8").tobytes()
    return memoryview(np.ascontiguousarray(array).reshape(-1)).cast("B") if array.size else b""

