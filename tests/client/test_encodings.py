"""MDS and LitData decoders (client/encodings.py) against the peers' own encoders and decoders.

Every value is written by the peer's encoder (``mds_encode``, a LitData serializer) and read
back both by the peer's decoder and by ours: the same type, dtype, shape and value, empty
values, grayscale and RGB images and several dtypes and shapes included. Then ``decode=``
given a dataset info that names its fields' encodings. Each peer is skipped where it is not
installed (``make .venv/bin/shardfeed`` installs neither).
"""

from __future__ import annotations

import io
import pickle
import warnings
from copy import copy
from decimal import Decimal

import numpy as np
import pytest
import torch
from PIL import Image

from shardfeed.benchmarks.loaders import import_streaming
from shardfeed.client import MISSING
from shardfeed.client.decode import make_decoder
from shardfeed.client.encodings import LITDATA, LITDATA_SERIALIZERS, MDS, decoder_for, field_decoders, litdata_image


@pytest.fixture(scope="module")
def mds():
    """Streaming's MDS encodings module."""
    if import_streaming() is None:
        pytest.skip("mosaicml-streaming is not installed")
    from streaming.base.format.mds import encodings
    return encodings


@pytest.fixture(scope="module")
def litdata():
    """LitData's serializers module."""
    return pytest.importorskip("litdata.streaming.serializers")


def image(mode: str, size: tuple[int, int] = (7, 5), seed: int = 0) -> Image.Image:
    """A noisy image of ``mode`` (``L``, ``RGB``, ``RGBA``), ``size`` = (width, height)."""
    bands = len(mode)
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], bands), dtype=np.uint8)
    return Image.fromarray(pixels[..., 0] if bands == 1 else pixels, mode)


def assert_same(ours, theirs) -> None:
    """The same Python value: type, and dtype, shape and bytes for arrays, tensors and images."""
    assert type(ours) is type(theirs), (type(ours), type(theirs))
    if isinstance(theirs, np.ndarray):
        assert (ours.dtype, ours.shape) == (theirs.dtype, theirs.shape)
        assert ours.tobytes() == theirs.tobytes()
    elif isinstance(theirs, torch.Tensor):
        assert (ours.dtype, ours.shape) == (theirs.dtype, theirs.shape)
        assert torch.equal(ours, theirs)
    elif isinstance(theirs, Image.Image):
        assert (ours.mode, ours.size, ours.format) == (theirs.mode, theirs.size, theirs.format)
        assert ours.tobytes() == theirs.tobytes()
    elif isinstance(theirs, list):
        assert len(ours) == len(theirs)
        for a, b in zip(ours, theirs):
            assert_same(a, b)
    else:
        assert ours == theirs and repr(ours) == repr(theirs)  # numpy scalars: the same dtype too


ARRAYS = [np.array([7], np.uint8), np.arange(-6, 6, dtype=np.int16).reshape(3, 4),
          np.linspace(-1, 1, 30, dtype=np.float32).reshape(2, 3, 5), np.arange(300, dtype=np.float64),
          np.full((1, 70000), 3, np.int64), np.array([[0.5]], np.float16)]

MDS_VALUES = {
    "bytes": [b"", b"\x00\xff raw"],
    "str": ["", "héllo, 世界"],
    "int": [0, -5, 2**62],
    **{name: [0, 7, 100] for name in ("uint8", "uint16", "uint32", "uint64")},
    **{name: [0, -7, 100] for name in ("int8", "int16", "int32", "int64")},
    **{name: [0.0, -1.5, 3.25] for name in ("float16", "float32", "float64")},
    "str_int": [0, -12345678901234567890],
    "str_float": [0.0, -1.5e300],
    "str_decimal": [Decimal("0.00"), Decimal("-1.2345678901234567890")],
    "json": ["", {}, [], {"a": [1, 2.5, None, "x"]}],
    "ndarray": ARRAYS,
    "pil": [image("L"), image("RGB"), image("RGBA", (1, 1))],
    "jpeg": [image("L"), image("RGB", (16, 9))],
    "png": [image("L"), image("RGB"), image("RGBA")],
    "jpeg_array": [[image("L")], [image("RGB"), image("L", (2, 3))]],
    "list[pil]": [[], [image("L"), image("RGB", seed=1)]],
    "list[jpeg]": [[image("RGB")]],
    "list[png]": [[image("L"), image("RGBA", seed=2)]],
}


@pytest.mark.parametrize("encoding", sorted(MDS_VALUES))
def test_each_mds_decoder_gives_what_streaming_gives(mds, encoding):
    for value in MDS_VALUES[encoding]:
        if encoding == "jpeg_array":
            value = [mds.mds_encode("jpeg", i) for i in value]  # it takes the JPEGs' bytes
        data = mds.mds_encode(encoding, value)
        assert_same(decoder_for("mds", encoding)(data), mds.mds_decode(encoding, data))


@pytest.mark.parametrize("array", ARRAYS, ids=lambda a: f"{a.dtype}{list(a.shape)}")
def test_mds_ndarrays_with_their_dtype_and_shape_in_the_encoding(mds, array):
    shape = ",".join(map(str, array.shape))
    for encoding in (f"ndarray:{array.dtype}", f"ndarray:{array.dtype}:{shape}"):
        data = mds.mds_encode(encoding, array)
        ours = decoder_for("mds", encoding)(data)
        assert_same(ours, mds.mds_decode(encoding, data))
        assert np.array_equal(ours, array) and not ours.flags.writeable  # a view of the bytes, as the peer's


def test_every_mds_encoding_but_pickle_has_a_decoder(mds):
    assert set(MDS) == mds.get_mds_encodings() - {"pkl"}
    assert decoder_for("mds", "pkl") is None


def litdata_encode(litdata, name: str, value) -> tuple[bytes, str]:
    """``value`` as LitData's serializer ``name`` writes it, and the format its index names."""
    data, written = litdata._get_serializers(None)[name].serialize(value)
    return data, written or name


def litdata_decode(litdata, data_format: str, data: bytes):
    """``data`` as LitData's reader decodes a leaf of ``data_format`` (item_loader.py's setup)."""
    from litdata.streaming.item_loader import PyTreeLoader

    loader = PyTreeLoader()
    loader._serializers = litdata._get_serializers(None)
    serializer = copy(loader._serializers[loader._data_format_to_key(data_format)])
    serializer.setup(data_format)
    return serializer.deserialize(data)


def tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.arange(int(np.prod(shape)), dtype=torch.int64).reshape(shape).to(dtype)


LITDATA_VALUES = {
    "str": ["", "héllo"],
    "bool": [True, False],
    "int": [0, -5, 2**62],
    "float": [0.0, -1.5e300],
    "bytes": [b"", b"\x00\xff raw"],
    "pil": [image("L"), image("RGB"), image("RGBA", (3, 8))],
    "numpy": [np.arange(6, dtype=np.int8).reshape(2, 3), np.linspace(0, 1, 8).reshape(4, 1, 2),
              np.zeros((0, 3), np.uint16), np.array([[True, False], [False, True]])],
    "no_header_numpy": [np.arange(4, dtype=np.int64), np.array([], np.float32), np.array([1.5, -2], np.float32),
                        np.array([255, 0], np.uint8), np.array([True, False])],
    "tensor": [tensor((2, 3), torch.int64), tensor((0, 4), torch.float32), tensor((), torch.float64),
               tensor((2, 2, 2), torch.float16), tensor((3, 1), torch.bool), tensor((2, 2), torch.uint8)],
    "no_header_tensor": [tensor((5,), torch.int32), tensor((3,), torch.float64), tensor((0,), torch.float32),
                         tensor((4,), torch.uint8), tensor((2,), torch.int16)],
}


@pytest.mark.parametrize("name", sorted(LITDATA_VALUES))
def test_each_litdata_decoder_gives_what_litdata_gives(litdata, name):
    for value in LITDATA_VALUES[name]:
        data, data_format = litdata_encode(litdata, name, value)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # torch's about tensors over read-only bytes, which the peer's get
            ours = decoder_for("litdata", data_format)(data)
        assert_same(ours, litdata_decode(litdata, data_format, data))
        if isinstance(ours, (np.ndarray, torch.Tensor)):  # copies: writable, not views of the sample's bytes
            assert ours.numpy().flags.writeable if isinstance(ours, torch.Tensor) else ours.flags.writeable


def exif_jpeg(path, mode: str, orientation: int) -> Image.Image:
    """A JPEG file carrying an EXIF orientation, opened (LitData's serializer reads its file)."""
    exif = Image.Exif()
    exif[0x0112] = orientation
    image(mode, (9, 4)).save(path, format="JPEG", exif=exif)
    return Image.open(path)


@pytest.mark.parametrize("mode", ["L", "RGB"])
def test_litdata_jpegs_decode_as_litdata_decodes_them(litdata, tmp_path, mode):
    # With an EXIF marker LitData turns the image by its orientation with Pillow, as we do.
    data, data_format = litdata_encode(litdata, "jpeg", exif_jpeg(tmp_path / "turned.jpg", mode, 6))
    ours = decoder_for("litdata", data_format)(data)
    assert_same(ours, litdata_decode(litdata, data_format, data))
    assert ours.shape == (3, 9, 4)
    # Without one it decodes with torchvision (no wheel works with the CPU torch here): the same
    # libjpeg decode into RGB, which Pillow gives.
    data, data_format = litdata_encode(litdata, "jpeg", image(mode, (9, 4)))
    ours = decoder_for("litdata", data_format)(data)
    pixels = np.array(Image.open(io.BytesIO(data)).convert("RGB"))
    assert_same(ours, torch.from_numpy(pixels).permute(2, 0, 1).contiguous())
    images, data_format = litdata_encode(litdata, "jpeg_array", [image(mode), image("RGB", (3, 3))])
    assert [d.shape for d in decoder_for("litdata", data_format)(images)] == [(3, 5, 7), (3, 3, 3)]


def test_litdata_reads_a_format_as_its_argument_where_that_names_a_serializer(litdata, tmp_path):
    (tmp_path / "note.txt").write_bytes(b"plain")
    data, data_format = litdata_encode(litdata, "file", str(tmp_path / "note.txt"))
    assert data_format == "file:txt"
    assert_same(decoder_for("litdata", data_format)(data), litdata_decode(litdata, data_format, data))
    assert decoder_for("litdata", "file:jpeg") is decoder_for("litdata", "image:png") is litdata_image
    assert decoder_for("litdata", "file:pdf") is None  # pdf has no decoder here: bytes


def test_litdata_encodings_without_a_decoder_stay_bytes(litdata):
    for data_format in ("json", "pickle", "audio", "video", "graph", "tifffile", "nifti:nii"):
        assert decoder_for("litdata", data_format) is None
    assert set(LITDATA) <= LITDATA_SERIALIZERS == set(litdata._SERIALIZERS)  # the names its reader knows


def test_arguments_an_encoding_does_not_take_are_refused():
    with pytest.raises(ValueError, match="mds encoding 'ndarray:float99'.*dtype"):
        decoder_for("mds", "ndarray:float99")
    with pytest.raises(ValueError, match="at least 1"):
        decoder_for("mds", "ndarray:uint8:0,3")
    with pytest.raises(ValueError, match="'int:8'.*no arguments"):
        decoder_for("mds", "int:8")
    with pytest.raises(ValueError, match="dtype index below 14, got '14'"):  # object arrays: not from a buffer
        decoder_for("litdata", "no_header_numpy:14")
    assert decoder_for("parquet", "int") is None  # a layout without decoders: bytes


def int64(n: int) -> bytes:
    return np.int64(n).tobytes()


MDS_INFO = {"name": "d", "layout": "mds",
            "encodings": {"label": "int", "caption": "str", "blob": "pkl", "json": "bytes", "emb": "ndarray:uint8"}}


def test_decode_true_picks_each_mds_field_by_its_encoding_not_its_extension():
    sample = {"__key__": "000001", "__index__": 1, "label": int64(3), "caption": "été".encode(),
              "blob": b"\x80\x04K\x01.", "json": b"[1]", "emb": b"\x04\x02\x01\x02", "cls": b"4"}
    out = make_decoder(True, MDS_INFO)(sample)
    assert (out["label"], out["caption"]) == (3, "été")
    assert out["emb"].tolist() == [1, 2]
    # pkl has no decoder, "json" is a bytes column, "cls" is no column: bytes, whatever the names say
    assert (out["blob"], out["json"], out["cls"]) == (b"\x80\x04K\x01.", b"[1]", b"4")
    assert (out["__key__"], out["__index__"]) == ("000001", 1)


def test_a_mapping_overrides_encodings_by_field_name_only():
    info = {"layout": "litdata", "encodings": {"label": "int", "meta.label": "str", "meta.raw": "pickle"}}
    decode = make_decoder({"label": lambda b: "mine", "raw": len}, info)
    out = decode({"__key__": "k", "label": int64(1), "meta.label": b"x", "meta.raw": b"abc"})
    assert out == {"__key__": "k", "label": "mine", "meta.label": "x", "meta.raw": b"abc"}
    missing = {"__key__": None, "__index__": 3, MISSING: True}
    assert decode(missing) == missing


def test_datasets_without_encodings_keep_the_decoders_by_extension():
    sample = {"__key__": "k", "cls": b"7", "seg.json": b"[1]"}
    for info in (None, {"layout": "tar", "encodings": {}}, {"name": "old service"}):
        assert make_decoder(True, info)(sample) == {"__key__": "k", "cls": 7, "seg.json": [1]}
    assert field_decoders({"layout": "objects", "encodings": {}}) is None


def test_a_field_whose_encoding_is_malformed_is_named():
    with pytest.raises(ValueError, match="field 'emb': mds encoding 'ndarray:f4'"):
        make_decoder(True, {"layout": "mds", "encodings": {"emb": "ndarray:f4"}})


def test_the_sample_decoder_pickles_for_dataloader_workers():
    info = {"layout": "litdata", "encodings": {"x": "no_header_numpy:9", "t": "no_header_tensor:17", "n": "int"}}
    decode = pickle.loads(pickle.dumps(make_decoder(True, info)))
    out = decode({"x": np.float32([1, 2]).tobytes(), "t": int64(5), "n": int64(-2)})
    assert out["x"].dtype == np.float32 and out["x"].tolist() == [1, 2]
    assert out["t"].dtype == torch.int64 and out["t"].tolist() == [5] and out["n"] == -2
