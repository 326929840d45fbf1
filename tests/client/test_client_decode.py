"""Decoders chosen by field extension, overridable per field."""

from __future__ import annotations

import io

import numpy as np
import pytest

from shardfeed.client import MISSING
from shardfeed.client.decode import make_decoder


def npy(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, array)
    return buf.getvalue()


def test_builtin_decoders_turn_fields_into_values_and_leave_the_rest_as_bytes():
    image = np.arange(6, dtype=np.float32).reshape(2, 3)
    sample = {"__key__": "k", "__index__": 1, "seg.npy": npy(image), "cls": b" 7\n", "txt": "é".encode(),
              "json": b'{"a": [1]}', "jpg": b"\xff\xd8"}
    out = make_decoder(True)(sample)
    assert np.array_equal(out["seg.npy"], image) and out["seg.npy"].dtype == np.float32
    assert (out["cls"], out["txt"], out["json"], out["jpg"]) == (7, "é", {"a": [1]}, b"\xff\xd8")
    assert (out["__key__"], out["__index__"]) == ("k", 1)


def test_a_mapping_overrides_by_field_name_or_extension_and_missing_samples_pass_through():
    decode = make_decoder({"cls": lambda b: int(b) + 100, "jpg": len})
    assert decode({"__key__": "k", "cls": b"1", "jpg": b"abc"}) == {"__key__": "k", "cls": 101, "jpg": 3}
    missing = {"__key__": None, "__index__": 3, MISSING: True}
    assert decode(missing) == missing
    assert make_decoder(False) is None


def test_bad_decoder_arguments_are_refused():
    with pytest.raises(TypeError, match="not callable"):
        make_decoder({"cls": 3})
    with pytest.raises(TypeError, match="decode must be"):
        make_decoder("yes")
    with pytest.raises(ValueError, match="[Oo]bject arrays"):
        make_decoder(True)({"npy": npy(np.array([{"x": 1}], dtype=object))})
