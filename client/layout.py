"""Where each sample's bytes lie in a batch answer held whole in memory: one layout, two parsers.

A batch answer read into one buffer (the tensor and Arrow outputs) is described by
:class:`Columns`: the samples' keys, indices and which are missing, and per field each
sample's offset and length in the buffer (``ABSENT`` where it lacks the field). Torch-free,
NumPy only.

- A tar answer (``"format": "tar"``) gives its layout by being parsed:
  :meth:`BatchReader.spans <.samples.BatchReader.spans>` walks every header, a dict per
  sample, and :meth:`Columns.of_samples` turns those into columns.
- An Arrow answer (``"format": "arrow"``, :mod:`shardfeed.arrowipc`) states its layout
  before its data: :meth:`Columns.of_arrow` reads each record batch's offsets buffer as one
  array and its validity bitmap as another, nothing per member (a key is a slice of the key
  column's text). An answer of several datasets' parts is their streams one after the other
  (:meth:`Columns.of_arrows`).

A batch read in parts (routing) joins its parts' columns with :meth:`Columns.merged`, in
the order the samples were asked for, an array operation per part and field.

A transform's answer (``"transform"`` on the request) is an Arrow answer like any other: its
fields are the transform's outputs, each followed by its ``<name>.shape`` where its shape varies
(:func:`shardfeed.transforms.output_columns`); :attr:`.tensors.Batch.outputs` reads them typed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from shardfeed import arrowipc
from shardfeed.arrowipc import INDEX, KEY

from .errors import ShardfeedConnectionError, ShardfeedError

ABSENT = -1
"""The length of a field a sample lacks (or of every field of a missing sample)."""


@dataclass
class Columns:
    """The layout of a batch answer (or of a whole batch, once merged): ``keys`` (``None`` for a
    missing sample), ``indices`` (int64), ``missing`` (bool), and per field, in the order the
    fields came, ``offsets`` (int64: where each sample's bytes start in the buffer) and
    ``lengths`` (int64: ``ABSENT`` where the sample lacks the field)."""

    keys: list[str | None]
    indices: np.ndarray
    missing: np.ndarray
    offsets: dict[str, np.ndarray]
    lengths: dict[str, np.ndarray]

    def __len__(self) -> int:
        return len(self.keys)

    @classmethod
    def of_samples(cls, samples: list[dict]) -> Columns:
        """The columns of a parsed tar answer (:meth:`BatchReader.spans`: each field's payload as
        its ``(offset, size)`` in the answer)."""
        n = len(samples)
        offsets: dict[str, np.ndarray] = {}
        lengths: dict[str, np.ndarray] = {}
        for row, sample in enumerate(samples):
            for name, value in sample.items():
                if name.startswith("__"):
                    continue
                if name not in offsets:
                    offsets[name] = np.zeros(n, np.int64)
                    lengths[name] = np.full(n, ABSENT, np.int64)
                offsets[name][row], lengths[name][row] = value
        return cls([s["__key__"] for s in samples], np.array([s["__index__"] for s in samples], np.int64),
                   np.array([bool(s.get("__missing__")) for s in samples], bool), offsets, lengths)

    @classmethod
    def of_arrow(cls, body: memoryview, indices: Sequence[int], url: str) -> Columns:
        """The columns of an Arrow answer held whole in ``body``, which asked for ``indices``.

        A stream cut short (no end-of-stream marker, or fewer rows than asked) raises
        :class:`ShardfeedConnectionError`, as a cut tar answer does; anything else that is not
        the batch asked for, :class:`ShardfeedError`."""
        return cls.of_arrows(body, [indices], url)

    @classmethod
    def of_arrows(cls, body: memoryview, parts: Sequence[Sequence[int]], url: str) -> Columns:
        """The columns of an answer of several parts held whole in ``body``: an Arrow stream per part,
        one after the other, part ``p``'s asking for ``parts[p]``; the rows in part order. Errors as
        :meth:`of_arrow`'s (bytes after the last stream too)."""
        columns, at = [], 0
        for indices in parts:
            part, at = cls._of_stream(body, at, indices, url)
            columns.append(part)
        if at != len(body):
            raise ShardfeedError(f"malformed batch response from {url}: {len(body) - at} bytes after its "
                                 f"{len(parts)} Arrow stream{'s' if len(parts) > 1 else ''}")
        if len(columns) == 1:
            return columns[0]
        bounds = np.cumsum([0, *(len(indices) for indices in parts)]).tolist()
        return cls.merged(columns, [0] * len(columns), [range(a, b) for a, b in zip(bounds, bounds[1:])])

    @classmethod
    def _of_stream(cls, body: memoryview, start: int, indices: Sequence[int], url: str) -> tuple[Columns, int]:
        """The columns of the Arrow stream at ``start`` in ``body``, which asked for ``indices``
        (offsets in ``body``), and where the stream ends."""
        try:
            stream = arrowipc.read_stream(body, start)
        except arrowipc.ArrowFormatError as exc:
            raise ShardfeedError(f"malformed batch response from {url}: {exc}") from None
        if not stream.ended or stream.total < len(indices):
            raise ShardfeedConnectionError(url, f"response ended after {stream.total} of {len(indices)} samples"
                                                f"{'' if stream.ended else ', without its end-of-stream marker'}")
        names = [c.name for c in stream.columns]
        if names[:2] != [KEY, INDEX] or [c.type for c in stream.columns[:2]] != [arrowipc.LARGE_UTF8, arrowipc.INT]:
            raise ShardfeedError(f"malformed batch response from {url}: its columns are {names[:8]}, "
                                 f"not {KEY} (large_utf8), {INDEX} (int64), then the fields")
        try:
            index = stream.integers(body, 1)
            if not np.array_equal(index, indices):
                raise ShardfeedError(f"malformed batch response from {url}: its samples are not those asked for "
                                     f"({index[:5].tolist()}... for {list(indices[:5])}...)")
            present = stream.valid(body, 0)
            offsets, lengths = {}, {}
            for number, column in enumerate(stream.columns[2:], 2):
                if column.type not in (arrowipc.BINARY, arrowipc.LARGE_BINARY):
                    raise ShardfeedError(f"malformed batch response from {url}: field {column.name!r} is not binary")
                offsets[column.name], sizes = stream.spans(body, number)
                valid = stream.valid(body, number)
                lengths[column.name] = sizes if valid.all() else np.where(valid, sizes, ABSENT)
            keys = _keys(*stream.spans(body, 0), present, body)
        except arrowipc.ArrowFormatError as exc:
            raise ShardfeedError(f"malformed batch response from {url}: {exc}") from None
        return cls(keys, index, ~present, offsets, lengths), stream.end

    @classmethod
    def merged(cls, parts: Sequence[Columns], starts: Sequence[int], positions: Sequence[Sequence[int]]) -> Columns:
        """One batch of its parts' columns: part ``p``'s answer at ``starts[p]`` in the buffer, its
        rows at ``positions[p]`` of the batch (:class:`~.routing.Part`). Fields are those of any
        part, in the order they first came; a part without a field has it ``ABSENT``."""
        if len(parts) == 1 and np.array_equal(positions[0], np.arange(len(parts[0]))):  # the batch, in order
            part, start = parts[0], int(starts[0])
            return cls(part.keys, part.indices, part.missing, {k: v + start for k, v in part.offsets.items()},
                       part.lengths)
        n = sum(len(p) for p in parts)
        keys = np.empty(n, object)
        indices, missing = np.empty(n, np.int64), np.empty(n, bool)
        names = list(dict.fromkeys(name for part in parts for name in part.offsets))
        offsets = {name: np.zeros(n, np.int64) for name in names}
        lengths = {name: np.full(n, ABSENT, np.int64) for name in names}
        for part, start, rows in zip(parts, starts, positions):
            rows = np.asarray(rows, np.intp)
            keys[rows] = part.keys
            indices[rows], missing[rows] = part.indices, part.missing
            for name in part.offsets:
                offsets[name][rows] = part.offsets[name] + int(start)
                lengths[name][rows] = part.lengths[name]
        return cls(keys.tolist(), indices, missing, offsets, lengths)


def _keys(starts: np.ndarray, lengths: np.ndarray, present: np.ndarray, body: memoryview) -> list[str | None]:
    """The key column's strings, ``None`` for a null: their text gathered and decoded at once, then
    a slice of it per row (of its bytes, each decoded, where a key is not ASCII)."""
    raw = arrowipc.gather(body, "u1", starts, lengths).tobytes()
    ends = np.concatenate([[0], np.cumsum(lengths)]).tolist()
    text = raw.decode("utf-8", "replace")
    source = text if text.isascii() else raw
    keys = [source[a:b] for a, b in zip(ends, ends[1:])]
    if source is not text:
        keys = [k.decode("utf-8", "replace") for k in keys]
    if not present.all():
        keys = [k if p else None for k, p in zip(keys, present.tolist())]
    return keys
