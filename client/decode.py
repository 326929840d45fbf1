"""Decoders: turn a sample's field bytes into values, chosen by the field's extension.

Samples arrive as raw bytes. ``decode=True`` applies the built-in decoders below; a
mapping adds to or overrides them, keyed by field name (``"seg.npy"``) or by the last
extension (``"npy"``). Fields without a decoder stay bytes; ``__key__``/``__index__``
and placeholders of missing samples are left alone.
"""

from __future__ import annotations

import io
import json
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from .samples import MISSING

Decoder = Callable[[bytes], Any]


def decode_npy(data: bytes) -> np.ndarray:
    """A ``.npy`` array (no pickled objects)."""
    return np.load(io.BytesIO(data), allow_pickle=False)


def decode_cls(data: bytes) -> int:
    """A ``.cls`` class label: a decimal integer as text."""
    return int(data)


def decode_text(data: bytes) -> str:
    """A ``.txt`` file as UTF-8 text."""
    return data.decode("utf-8")


def decode_json(data: bytes) -> Any:
    """A ``.json`` document."""
    return json.loads(data)


BUILTIN: dict[str, Decoder] = {
    "npy": decode_npy,
    "cls": decode_cls,
    "txt": decode_text,
    "json": decode_json,
}
"""The built-in decoders by extension."""


class SampleDecoder:
    """Applies decoders to the fields of a sample dict (picklable for DataLoader workers)."""

    def __init__(self, decoders: Mapping[str, Decoder]):
        self.decoders = dict(decoders)

    def __call__(self, sample: dict) -> dict:
        if sample.get(MISSING):
            return sample
        out = {}
        for field, value in sample.items():
            fn = None if field.startswith("__") else self._for(field)
            out[field] = value if fn is None else fn(value)
        return out

    def _for(self, field: str) -> Decoder | None:
        fn = self.decoders.get(field)
        if fn is None:
            fn = self.decoders.get(field.rsplit(".", 1)[-1])
        return fn


def make_decoder(decode: bool | Mapping[str, Decoder]) -> SampleDecoder | None:
    """The decoder for a ``decode=`` argument: ``False`` (raw bytes), ``True`` (built-ins),
    or a mapping of field name or extension to a function of the bytes (merged over the
    built-ins)."""
    if decode is False:
        return None
    if decode is True:
        return SampleDecoder(BUILTIN)
    if isinstance(decode, Mapping):
        for key, fn in decode.items():
            if not callable(fn):
                raise TypeError(f"decoder for {key!r} is not callable: {fn!r}")
        return SampleDecoder({**BUILTIN, **decode})
    raise TypeError(f"decode must be True, False or a mapping of field to function, not {decode!r}")
