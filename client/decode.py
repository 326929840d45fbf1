"""Decoders: turn a sample's field bytes into values, chosen by the field's extension or encoding.

Samples arrive as raw bytes. ``decode=True`` applies the built-in decoders below; a
mapping adds to or overrides them, keyed by field name (``"seg.npy"``) or by the last
extension (``"npy"``). A dataset whose info names its fields' encodings (MDS and LitData
shards served in place) is decoded field by field by those encodings instead
(:mod:`.encodings`), and a mapping overrides them by field name alone. Fields without a
decoder stay bytes; ``__key__``/``__index__`` and placeholders of missing samples are left
alone.
"""

from __future__ import annotations

import io
import json
from collections.abc import Mapping
from typing import Any

import numpy as np

from .encodings import Decoder, field_decoders
from .samples import MISSING


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
    """Applies decoders to the fields of a sample dict (picklable for DataLoader workers).

    A field's decoder is the one keyed by its name, else (``by_extension``) by its last extension.
    """

    def __init__(self, decoders: Mapping[str, Decoder], by_extension: bool = True):
        self.decoders = dict(decoders)
        self.by_extension = by_extension

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
        if fn is None and self.by_extension:
            fn = self.decoders.get(field.rsplit(".", 1)[-1])
        return fn


def make_decoder(decode: bool | Mapping[str, Decoder], info: Mapping[str, Any] | None = None) -> SampleDecoder | None:
    """The decoder for a ``decode=`` argument: ``False`` (raw bytes), ``True`` (built-ins),
    or a mapping of field name or extension to a function of the bytes (merged over the
    built-ins).

    ``info`` is the dataset's (``Client.info``): where it names the fields' encodings, each
    field's encoding picks its decoder in place of the built-ins, and the mapping overrides
    them by field name (extensions mean nothing there: ``meta.label`` is a field's name)."""
    if decode is False:
        return None
    if isinstance(decode, Mapping):
        for key, fn in decode.items():
            if not callable(fn):
                raise TypeError(f"decoder for {key!r} is not callable: {fn!r}")
    elif decode is not True:
        raise TypeError(f"decode must be True, False or a mapping of field to function, not {decode!r}")
    overrides = decode if isinstance(decode, Mapping) else {}
    by_encoding = field_decoders(info)
    if by_encoding is None:
        return SampleDecoder({**BUILTIN, **overrides})
    return SampleDecoder({**by_encoding, **overrides}, by_extension=False)
