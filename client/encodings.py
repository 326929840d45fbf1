"""Decoders for the fields of MosaicML Streaming (MDS) and LitData datasets, by encoding.

A dataset served in place from MDS or LitData shards names each field's encoding in its info
(``"encodings"``: the name its ``index.json`` gives, MDS ``column_encodings`` or LitData
``config.data_format``), and its fields arrive as those encodings' raw bytes. The decoders here
turn them into what the peer's own reader returns for them (``streaming``'s
``mds/encodings.py``, ``litdata``'s ``serializers.py``): the same types, dtypes, shapes and
values. Neither peer is imported: images go through Pillow, tensors through torch, both
imported on first use, so a bare client install can still decode the rest.

Each registry maps an encoding's name to a function of its arguments (the text after the
first ``:``, ``ndarray:float32:3,4``) that returns the decoder; an encoding a registry lacks
(MDS ``pkl``, LitData ``json``, ``audio``, ``video``, ...) has no decoder and stays bytes.
"""

from __future__ import annotations

import io
import json
import struct
from collections.abc import Callable, Mapping
from decimal import Decimal
from functools import partial
from typing import Any

import numpy as np

Decoder = Callable[[bytes], Any]
MakeDecoder = Callable[[str], Decoder]
"""Turns an encoding's arguments (``""`` when it has none) into its decoder."""


def _plain(decoder: Decoder) -> MakeDecoder:
    """An encoding that takes no arguments."""
    def make(args: str) -> Decoder:
        if args:
            raise ValueError(f"takes no arguments, got {args!r}")
        return decoder
    return make


def _any_args(decoder: Decoder) -> MakeDecoder:
    """An encoding whose argument does not change how it decodes (LitData's file extensions)."""
    return lambda args: decoder


# Decoders both peers share.

def as_bytes(data: bytes) -> bytes:
    """The bytes as stored (MDS ``bytes``, LitData ``bytes`` and ``file``)."""
    return data


def utf8(data: bytes) -> str:
    """UTF-8 text (MDS ``str``, LitData ``str`` and ``text``)."""
    return bytes(data).decode("utf-8")


def pil_raw(data: bytes) -> Any:
    """A ``PIL.Image`` from its raw pixels (MDS and LitData ``pil``): ``width, height`` and the
    mode's length as uint32, the mode's name, then ``Image.tobytes()``."""
    width, height, mode_size = np.frombuffer(data[:12], np.uint32)
    mode = bytes(data[12:12 + mode_size]).decode("utf-8")
    return _pillow().frombytes(mode, (width, height), data[12 + mode_size:])


def open_image(data: bytes) -> Any:
    """An image file opened by Pillow, its pixels decoded when read (MDS ``jpeg`` and ``png``)."""
    return _pillow().open(io.BytesIO(data))


def _counted(data: bytes, first: int) -> list[bytes]:
    """The parts of a list framed as a uint32 count at ``first - 4``, the parts' uint32 sizes,
    then the parts."""
    view = memoryview(data)
    count = int(np.frombuffer(view[first - 4:first], np.uint32)[0])
    sizes = np.frombuffer(view[first:first + 4 * count], np.uint32)
    ends = (first + 4 * count + np.cumsum(sizes)).tolist()
    return [bytes(view[start:end]) for start, end in zip([first + 4 * count, *ends], ends)]


def _image_array(data: bytes) -> list[bytes]:
    """The images of a ``jpeg_array`` (both peers): a uint32 count, uint32 sizes, the images."""
    count = int(np.frombuffer(data[:4], np.uint32)[0]) if len(data) >= 4 else 0
    if count == 0:
        raise ValueError("a jpeg_array value needs a count of at least one image")
    if len(data) < 4 + 4 * count:
        raise ValueError(f"a jpeg_array value of {len(data)} bytes is too short for the sizes of {count} images")
    return _counted(data, 4)


def _pillow() -> Any:
    try:
        from PIL import Image
    except ImportError:
        raise ImportError("decoding images needs Pillow (pip install pillow)") from None
    return Image


# MDS (streaming/base/format/mds/encodings.py).

def mds_int(data: bytes) -> int:
    """MDS ``int``: an int64, as a Python int."""
    return int(np.frombuffer(data, np.int64)[0])


def mds_scalar(dtype: str, data: bytes) -> Any:
    """MDS ``uint8`` ... ``float64``: a NumPy scalar of that dtype."""
    return np.frombuffer(data, dtype)[0]


def mds_str_int(data: bytes) -> int:
    """MDS ``str_int``: decimal digits."""
    return int(utf8(data))


def mds_str_float(data: bytes) -> float:
    """MDS ``str_float``: a float as text."""
    return float(utf8(data))


def mds_str_decimal(data: bytes) -> Decimal:
    """MDS ``str_decimal``: a ``Decimal`` as text."""
    return Decimal(utf8(data))


def mds_json(data: bytes) -> Any:
    """MDS ``json``: a UTF-8 JSON document."""
    return json.loads(utf8(data))


def mds_jpeg_array(data: bytes) -> list:
    """MDS ``jpeg_array``: a list of JPEGs opened by Pillow."""
    return [open_image(part) for part in _image_array(data)]


def mds_list(decode: Decoder, data: bytes) -> list:
    """MDS ``list[pil]``, ``list[jpeg]``, ``list[png]``: a uint32 left for later use, then a
    counted list of images."""
    return [decode(part) for part in _counted(data, 8)]


MDS_SHAPE_DTYPES = ("uint8", "uint16", "uint32", "uint64")
"""An MDS ``ndarray``'s shape dtype, by the low two bits of the byte before the shape."""
MDS_VALUE_DTYPES = {8: "uint8", 9: "int8", 16: "uint16", 17: "int16", 18: "float16", 32: "uint32", 33: "int32",
                    34: "float32", 64: "uint64", 65: "int64", 66: "float64"}
"""An MDS ``ndarray``'s value dtype, by the byte that names it where the encoding does not."""


def mds_ndarray(dtype: str | None, shape: tuple[int, ...] | None, data: bytes) -> np.ndarray:
    """MDS ``ndarray[:dtype[:shape]]``: ``[dtype byte]`` where the encoding names no dtype,
    ``[ndim << 2 | shape dtype][shape]`` where it names no shape, then the values. A
    read-only array over the bytes, as the peer returns it."""
    view, at = memoryview(data), 0
    if dtype is None:
        dtype, at = MDS_VALUE_DTYPES[view[0]], 1
    if shape is None:
        ndim, shape_dtype = view[at] >> 2, MDS_SHAPE_DTYPES[view[at] & 3]
        end = at + 1 + ndim * np.dtype(shape_dtype).itemsize
        shape, at = tuple(np.frombuffer(view[at + 1:end], shape_dtype).tolist()), end
    return np.frombuffer(view[at:], dtype).reshape(shape)


def _mds_ndarray_args(args: str) -> Decoder:
    """``ndarray``'s arguments, as MDS reads them: ``[dtype[:d0,d1,...]]``."""
    parts = args.split(":") if args else []
    if len(parts) > 2 or (parts and parts[0] not in MDS_VALUE_DTYPES.values()):
        raise ValueError(f"expected [dtype[:shape]] with a dtype of {sorted(MDS_VALUE_DTYPES.values())}, "
                         f"got {args!r}")
    shape = tuple(int(d) for d in parts[1].split(",")) if len(parts) == 2 else None
    if shape is not None and min(shape) < 1:
        raise ValueError(f"every dimension must be at least 1, got {args!r}")
    return partial(mds_ndarray, parts[0] if parts else None, shape)


MDS: dict[str, MakeDecoder] = {
    "bytes": _plain(as_bytes),
    "str": _plain(utf8),
    "int": _plain(mds_int),
    **{name: _plain(partial(mds_scalar, name)) for name in MDS_VALUE_DTYPES.values()},  # the same eleven
    "str_int": _plain(mds_str_int),
    "str_float": _plain(mds_str_float),
    "str_decimal": _plain(mds_str_decimal),
    "json": _plain(mds_json),
    "ndarray": _mds_ndarray_args,
    "pil": _plain(pil_raw),
    "jpeg": _plain(open_image),
    "png": _plain(open_image),
    "jpeg_array": _plain(mds_jpeg_array),
    "jpegarray": _plain(mds_jpeg_array),
    "list[pil]": _plain(partial(mds_list, pil_raw)),
    "list[jpeg]": _plain(partial(mds_list, open_image)),
    "list[png]": _plain(partial(mds_list, open_image)),
}
"""MDS encodings by name (``pkl`` is left out: unpickling runs code, so it stays bytes)."""


# LitData (litdata/streaming/serializers.py).

def litdata_int(data: bytes) -> int:
    """LitData ``int``: a little-endian int64."""
    return struct.unpack("<q", data)[0]


def litdata_float(data: bytes) -> float:
    """LitData ``float``: a little-endian float64."""
    return struct.unpack("<d", data)[0]


def litdata_bool(data: bytes) -> bool:
    """LitData ``bool``: one byte, true when not zero."""
    return data[0] != 0


def litdata_image(data: bytes) -> Any:
    """LitData ``jpeg`` and ``image``: a ``(3, height, width)`` uint8 RGB tensor, turned by a
    JPEG's EXIF orientation as the peer turns it (which decodes with torchvision; Pillow here)."""
    import torch

    image = open_image(data)
    from PIL import ImageOps  # Pillow is there: open_image needs it

    if image.format == "JPEG":
        image = ImageOps.exif_transpose(image)
    return torch.from_numpy(np.array(image.convert("RGB"))).permute(2, 0, 1).contiguous()


def litdata_jpeg_array(data: bytes) -> list:
    """LitData ``jpeg_array``: a list of images as ``jpeg`` decodes each."""
    return [litdata_image(part) for part in _image_array(data)]


LITDATA_NUMPY_DTYPES = ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "float16",
                        "float32", "float64", "complex64", "complex128", "bool")
"""LitData's NumPy dtypes by the index its formats store (``no_header_numpy:9`` is float32);
the indices after these (object, bytes, str, void) cannot be read from a buffer."""
LITDATA_TORCH_DTYPES = ("float32", "float32", "float64", "float64", "complex64", "complex64", "complex128",
                        "complex128", "float16", "float16", "bfloat16", "uint8", "int8", "int16", "int16", "int32",
                        "int32", "int64", "int64", "bool", "uint16")
"""LitData's torch dtypes by index (names of ``torch`` attributes: torch is imported on first use)."""


def litdata_numpy(data: bytes) -> np.ndarray:
    """LitData ``numpy``: uint32 dtype index, ndim and dimensions, then the values (a writable copy)."""
    view = memoryview(data)
    dtype_index, ndim = np.frombuffer(view[:8], np.uint32).tolist()
    shape = np.frombuffer(view[8:8 + 4 * ndim], np.uint32).tolist()
    return np.frombuffer(view[8 + 4 * ndim:], LITDATA_NUMPY_DTYPES[dtype_index]).reshape(shape).copy()


def litdata_no_header_numpy(dtype: str, data: bytes) -> np.ndarray:
    """LitData ``no_header_numpy:N``: the values alone, one dimension (a writable copy)."""
    return np.frombuffer(data, dtype).copy()


def litdata_tensor(data: bytes) -> Any:
    """LitData ``tensor``: big-endian uint32 dtype index, rank and dimensions, then the values.

    A tensor over a copy of the bytes: the peer's lies over its read-only buffer (torch warns,
    and an in-place operation would write into the sample's ``bytes``)."""
    import torch

    dtype_index, rank = struct.unpack_from(">II", data)
    shape = struct.unpack_from(f">{rank}I", data, 8)
    dtype = getattr(torch, LITDATA_TORCH_DTYPES[dtype_index])
    values = memoryview(data)[8 + 4 * rank:]
    if not values:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(values), dtype=dtype).reshape(shape)


def litdata_no_header_tensor(dtype: str, data: bytes) -> Any:
    """LitData ``no_header_tensor:N``: the values alone, one dimension (over a copy of the bytes)."""
    import torch

    if not data:
        return torch.empty((0,), dtype=getattr(torch, dtype))
    return torch.frombuffer(bytearray(data), dtype=getattr(torch, dtype))


def _dtype_index(dtypes: tuple[str, ...], decode: Callable[[str, bytes], Any]) -> MakeDecoder:
    """An encoding whose argument is the index of its dtype in ``dtypes``."""
    def make(args: str) -> Decoder:
        if not args.isdigit() or int(args) >= len(dtypes):
            raise ValueError(f"expected a dtype index below {len(dtypes)}, got {args!r}")
        return partial(decode, dtypes[int(args)])
    return make


LITDATA: dict[str, MakeDecoder] = {
    "str": _plain(utf8),
    "text": _plain(utf8),
    "bool": _plain(litdata_bool),
    "int": _plain(litdata_int),
    "float": _plain(litdata_float),
    "bytes": _plain(as_bytes),
    "file": _any_args(as_bytes),
    "pil": _plain(pil_raw),
    "jpeg": _plain(litdata_image),
    "image": _any_args(litdata_image),
    "jpeg_array": _plain(litdata_jpeg_array),
    "numpy": _plain(litdata_numpy),
    "no_header_numpy": _dtype_index(LITDATA_NUMPY_DTYPES, litdata_no_header_numpy),
    "tensor": _plain(litdata_tensor),
    "no_header_tensor": _dtype_index(LITDATA_TORCH_DTYPES, litdata_no_header_tensor),
}
"""LitData formats by serializer name."""

LITDATA_SERIALIZERS = frozenset({
    "str", "text", "bool", "int", "float", "video", "audio", "image", "nifti", "mesh", "pdf", "graph", "tifffile",
    "file", "pil", "jpeg", "jpeg_array", "bytes", "no_header_numpy", "numpy", "no_header_tensor", "tensor", "json",
    "pickle"})
"""Every serializer LitData 0.2.76 names: its reader takes ``a:b``'s serializer to be ``b`` when
``b`` is one of these (``file:jpeg`` decodes as ``jpeg``), else ``a``."""


def _litdata_split(encoding: str) -> tuple[str, str]:
    name, _, args = encoding.partition(":")
    return (args, "") if args in LITDATA_SERIALIZERS else (name, args)


def _mds_split(encoding: str) -> tuple[str, str]:
    name, _, args = encoding.partition(":")
    return name, args


LAYOUTS: dict[str, tuple[dict[str, MakeDecoder], Callable[[str], tuple[str, str]]]] = {
    "mds": (MDS, _mds_split),
    "litdata": (LITDATA, _litdata_split),
}
"""Each layout's registry, and how it reads an encoding as a name and its arguments."""


def decoder_for(layout: str, encoding: str) -> Decoder | None:
    """The decoder of ``encoding`` in ``layout``'s registry; ``None`` for one it lacks (the field
    stays bytes). An encoding it knows with arguments it cannot read is a ``ValueError``."""
    if layout not in LAYOUTS:
        return None
    registry, split = LAYOUTS[layout]
    name, args = split(encoding)
    make = registry.get(name)
    if make is None:
        return None
    try:
        return make(args)
    except ValueError as exc:
        raise ValueError(f"{layout} encoding {encoding!r}: {exc}") from None


def field_decoders(info: Mapping[str, Any] | None) -> dict[str, Decoder] | None:
    """Each field's decoder from a dataset's info (``Client.info``) where it names the fields'
    encodings; ``None`` where it does not (tar and object layouts, older services). Fields whose
    encoding has no decoder are left out."""
    encodings = (info or {}).get("encodings")
    if not encodings:
        return None
    decoders = {}
    for field, encoding in encodings.items():
        try:
            decoder = decoder_for(info.get("layout", ""), encoding)
        except ValueError as exc:
            raise ValueError(f"field {field!r}: {exc}") from None
        if decoder is not None:
            decoders[field] = decoder
    return decoders
