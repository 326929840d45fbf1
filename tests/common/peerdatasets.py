"""Datasets written by the peers' own writers, and what the peers' own readers make of them.

MosaicML Streaming's ``MDSWriter`` and LitData's ``BinaryWriter`` write a dataset into a local
folder; the peer's own ``StreamingDataset`` then reads every sample back with its decode step
wrapped, so that a test compares what shardfeed serves with the bytes that the peer hands its
decoder for each sample and field, not with a second reading of the format written here. The
readers run on a copy of the folder: both write into the folder they read (see below).

What the writers put on disk (mosaicml-streaming 0.13.0, litdata 0.2.76), as seen here:

MDS (``mds_dataset``)
- ``index.json``: ``{"version": 2, "shards": [...]}``. A shard: ``column_names`` (sorted by name,
  whatever the order given to the writer), ``column_encodings``, ``column_sizes`` (the bytes of a
  fixed-size column, ``null`` for a variable one), ``samples``, ``compression`` (``null`` or
  ``"zstd"``; Streaming also writes ``gz``, ``bz2``, ``br``, ``snappy``, ``zstd:<level>``),
  ``format`` (``"mds"``), ``version`` (2), ``hashes``, ``size_limit``, ``raw_data`` and
  ``zip_data`` (each ``{"basename", "bytes", "hashes"}``; ``zip_data`` is ``null`` uncompressed).
- Files: ``shard.00000.mds``...; compressed, only ``shard.00000.mds.zstd``... (``.gz``, ``.br``...:
  the algorithm without its level; ``raw_data`` names the ``.mds`` that Streaming's reader writes
  beside it when it first reads the shard).
- A raw shard: ``num_samples`` (uint32), ``num_samples + 1`` uint32 offsets from the file's start,
  the shard's JSON (its ``index.json`` entry less ``samples``, ``raw_data`` and ``zip_data``), then
  the samples; a sample is a uint32 size for each variable-size column, in column order, then
  the columns' bytes.
- Fixed-size encodings: ``int`` (8 bytes), ``uint8``, ``float32``, ``ndarray:<dtype>:<shape>``.

LitData (``litdata_dataset``)
- ``index.json``: ``{"chunks": [...], "config": {...}, "updated_at": ...}``. ``config``:
  ``chunk_bytes``, ``chunk_size``, ``compression``, ``compression_level``,
  ``compression_batch_size``, ``data_format`` (a serializer name per leaf), ``data_spec`` (the
  item's pytree spec, a JSON string), ``encryption``, ``ipc_compression``, ``item_loader``
  (``"PyTreeLoader"``), ``types``. A chunk: ``chunk_bytes``, ``chunk_size`` (items), ``dim``,
  ``filename``.
- Leaves in pytree order: a dict's in insertion order (LitData's copy of torch's pytree flattens
  ``list(d.values())``, as torch's does; nothing sorts), nested dicts and tuples depth first. In a
  dict item, a list of plain values (``["a", "b"]``) is one ``json`` leaf (in LitData's own binary
  encoding, not JSON text); a list of arrays or images is a list of leaves. ``data_format`` comes
  from the first item: ``int`` and ``float`` (8 bytes), ``str``, ``bytes``, ``jpeg`` (a
  ``JpegImageFile``), ``pil`` (any other PIL image), ``no_header_numpy:<dtype code>`` (a 1-D array;
  the codes of ``litdata.constants._NUMPY_DTYPES_MAPPING``, int64 is 3), ``numpy`` (more
  dimensions, the dtype and shape in the leaf's own header).
- A chunk: ``num_items`` (uint32), ``num_items + 1`` uint32 offsets, the items; an item is a
  uint32 size per leaf, then the leaves. The layouts of ``LITDATA_LAYOUTS``:
  - ``plain``: ``chunk-0-N.bin`` (``chunk-<writer's rank>-<chunk>``); ``compression`` and
    ``compression_level`` ``null``.
  - ``framed`` (``compression="zstd"``, LitData's default since ``compression_level`` defaults to
    ``"batch"``): ``chunk-0-N.bin`` opening with ``LDFZ01\\0\\0``, then version, flags,
    ``num_items``, rows per frame, ``n_frames``, the ``num_items + 1`` item offsets into the
    uncompressed items, a table of frames (first item, items, offset and size in the file,
    uncompressed size) and the zstd frames (layout: ``litdata/streaming/framed_zstd.py``).
    ``config``: ``compression: "zstd"``, ``compression_level: "batch"``,
    ``compression_batch_size`` (rows per frame); ``chunk_bytes`` is the file's size.
  - ``whole`` (``compression_level="chunk"``, the older layout): ``chunk-0-N.zstd.bin``, the plain
    chunk as one zstd frame; ``config``: ``compression: "zstd"``, ``compression_level: null``;
    ``chunk_bytes`` is the uncompressed size. LitData's reader replaces the file by
    ``chunk-0-N.bin``.
  (``compression_level="sample"``, a plain chunk whose items are each a zstd frame, is not
  written here.)
- A dict item whose leaves are all ``str``/``int``/``float``/``bool``/``bytes`` (or lists and
  dicts of those; ``plain_item``) is written as an Arrow IPC footer instead, in every layout:
  every item offset equals the header's size, then an Arrow IPC file of the chunk's items (the
  dict's keys its columns, 256 rows a record batch), its length (uint32) and ``LDARW01\\0``.
  ``config``: ``compression`` ``null`` whatever the writer was asked, ``ipc_compression``
  ``"zstd"`` when it was asked to compress (the record batches' buffers then compressed one by
  one). A ``None`` value is a null in the footer, and ``None`` in the item LitData's reader
  returns. The reader hands those values to no deserializer: their raw bytes are what the
  leaf's serializer writes of the value LitData's reader returns (``_read_litdata_footer``).
- LitData's ``jpeg`` deserializer decodes with torchvision, which the CPU torch build lacks:
  its decoded values are ``PeerCannotDecode``.
"""

from __future__ import annotations

import io
import json
import shutil
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
from PIL import Image

from shardfeed.benchmarks.loaders import import_streaming, streaming_dataset
from shardfeed.s3server import S3Server

from common.datasets import s3_put


@dataclass(frozen=True)
class PeerCannotDecode:
    """The decoded value of a field that the peer's reader cannot decode here, and why."""

    reason: str


@dataclass
class PeerDataset:
    """A dataset that a peer's writer wrote into ``root``, as the peer's reader reads it."""

    root: Path
    encodings: dict[str, str]
    """Each field's encoding as ``index.json`` names it, in the order the peer decodes them."""
    raw: dict[tuple[int, str], bytes]
    """``(sample, field)``: the bytes the peer's reader handed its decoder."""
    decoded: dict[tuple[int, str], Any]
    """``(sample, field)``: what the decoder returned."""

    @property
    def fields(self) -> list[str]:
        return list(self.encodings)

    @property
    def samples(self) -> int:
        return len({i for i, _ in self.raw})  # every sample has a field (an Arrow footer's may lack some)

    @property
    def index(self) -> dict:
        return json.loads((self.root / "index.json").read_text())


def upload(server: S3Server, root: Path, bucket: str, prefix: str) -> str:
    """Put every file under ``root`` at ``prefix/<its path under root>`` in ``bucket`` on
    ``server``; the dataset's URL."""
    put = s3_put(server.client(), bucket, prefix)
    for path in sorted(path for path in root.rglob("*") if path.is_file()):
        put(path.relative_to(root).as_posix(), path.read_bytes())
    return f"s3://{bucket}/{prefix}"


def _image(k: int, size: tuple[int, int]) -> Image.Image:
    """Noise (so that JPEG and PNG bytes differ from sample to sample): grayscale for even ``k``."""
    channels = () if k % 2 == 0 else (3,)
    pixels = np.random.default_rng(k).integers(0, 256, (size[1], size[0], *channels), dtype=np.uint8)
    return Image.fromarray(pixels)


def _jpeg_file(image: Image.Image) -> Image.Image:
    """``image`` saved as JPEG and opened again: a ``JpegImageFile``, which LitData writes as
    ``jpeg`` (other PIL images it writes as ``pil``)."""
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG")
    return Image.open(io.BytesIO(buffer.getvalue()))


def _caption(k: int) -> str:
    return "" if k % 4 == 0 else f"sample {k} é " * (k % 5)


def _blob(k: int) -> bytes:
    return b"" if k % 3 == 0 else np.random.default_rng(1000 + k).bytes(37 * k)


MDS_COLUMNS = {
    "id": "int", "label": "uint8", "weight": "float32",
    "caption": "str", "blob": "bytes",
    "photo": "jpeg", "scan": "png", "picture": "pil",
    "tokens": "ndarray", "pixels": "ndarray:int16", "box": "ndarray:float32:2,3",
}
"""The columns of ``mds_sample``: every encoding of issue 42 and the fixed-size kinds."""


def mds_sample(k: int) -> dict[str, Any]:
    """Sample ``k`` of ``MDS_COLUMNS``: empty ``caption`` and ``blob`` now and then, grayscale
    images for even ``k``, ``tokens`` of a dtype and rank that change with ``k`` (MDS refuses
    empty arrays)."""
    image = _image(k, (8 + k % 5, 6 + k % 3))
    tokens = np.arange(2 + k % 3 * 2, dtype=np.int32).reshape(-1, 2) * k if k % 2 == 0 else np.linspace(0, 1, 1 + k % 7)
    return {
        "id": k, "label": np.uint8(k % 256), "weight": np.float32(k / 8),
        "caption": _caption(k), "blob": _blob(k),
        "photo": image, "scan": image, "picture": image,
        "tokens": tokens, "pixels": np.arange(k % 9 + 1, dtype=np.int16) - k,
        "box": np.full((2, 3), k, dtype=np.float32),
    }


def mds_dataset(root: Path, *, compression: str | None = None, samples: int = 24,
                size_limit: int = 1 << 13) -> PeerDataset:
    """``samples`` of ``mds_sample`` written by ``streaming.MDSWriter`` into ``root`` (``size_limit``
    small: several shards), read back by ``streaming.StreamingDataset``."""
    streaming = import_streaming()
    with streaming.MDSWriter(out=str(root), columns=MDS_COLUMNS, compression=compression,
                             size_limit=size_limit) as writer:
        for k in range(samples):
            writer.write(mds_sample(k))
    shard = json.loads((root / "index.json").read_text())["shards"][0]
    encodings = dict(zip(shard["column_names"], shard["column_encodings"]))
    return PeerDataset(root, encodings, *_read_mds(streaming, root, encodings, samples))


def _read_mds(streaming, root: Path, encodings: dict[str, str], samples: int) -> tuple[dict, dict]:
    """Each sample through ``StreamingDataset``, with the ``mds_decode`` that ``MDSReader.decode_sample``
    calls on each column's slice of the sample wrapped to keep that slice."""
    from streaming.base.format.mds import reader

    calls: list[tuple[bytes, Any]] = []

    def recording(encoding: str, data: bytes) -> Any:
        value = decode(encoding, data)
        calls.append((bytes(data), value))
        return value

    decode = reader.mds_decode
    with mock.patch.object(reader, "mds_decode", recording):
        return _read_back(root, lambda local: streaming_dataset(streaming, local=local, batch_size=1, shuffle=False),
                          calls, encodings, samples)


def _read_back(root: Path, open_dataset: Callable[[str], Any], calls: list[tuple[bytes, Any]],
               encodings: dict[str, str], samples: int) -> tuple[dict, dict]:
    """``raw`` and ``decoded`` of ``PeerDataset``: sample after sample of ``open_dataset(a copy of
    root)``, whose wrapped decoders leave in ``calls`` what each field's decoder was handed and returned."""
    raw, decoded = {}, {}
    with tempfile.TemporaryDirectory() as scratch:
        dataset = open_dataset(str(shutil.copytree(root, Path(scratch) / "local")))
        assert len(dataset) == samples, (len(dataset), samples)
        for i in range(samples):
            calls.clear()
            dataset[i]
            assert len(calls) == len(encodings), (i, len(calls), encodings)
            for field, (data, value) in zip(encodings, calls):
                raw[i, field], decoded[i, field] = data, value
    return raw, decoded


def litdata_item(k: int) -> dict[str, Any]:
    """Item ``k``: a leaf of each kind (``data_format`` is fixed by item 0), a nested dict, empty
    ``caption`` and ``blob`` now and then, grayscale images for even ``k``."""
    image = _image(k, (8 + k % 5, 6 + k % 3))
    return {
        "id": k, "caption": _caption(k), "photo": _jpeg_file(image), "picture": image,
        "tokens": np.arange(k % 6 + 1, dtype=np.int16) - k, "mask": np.full((2, 1 + k % 3), k / 2, np.float32),
        "blob": _blob(k), "score": k / 4, "meta": {"source": f"src-{k % 3}", "rank": -k},
    }


def plain_item(k: int) -> dict[str, Any]:
    """Item ``k`` of plain values alone, which LitData writes in an Arrow footer: empty ``caption``
    and ``blob`` now and then, ``note`` now and then ``None`` (not in item 0, which fixes
    ``data_format``), a ``label`` always."""
    return {"id": k * 7919 - 10**6, "caption": _caption(k), "score": k / 3 - 100, "blob": _blob(k)[:k % 50],
            "note": None if k % 7 == 3 else "n" * (k % 4), "label": f"class-{k % 10}"}


LITDATA_LAYOUTS = {
    "plain": {},
    "framed": {"compression": "zstd", "compression_batch_size": 2},  # several frames in a chunk
    "whole": {"compression": "zstd", "compression_level": "chunk"},
}
"""``BinaryWriter`` options of each chunk layout (module docstring)."""


def litdata_dataset(root: Path, *, layout: str = "plain", samples: int = 24, chunk_bytes: int = 1 << 12,
                    item: Callable[[int], Any] = litdata_item) -> PeerDataset:
    """``samples`` items ``item(k)`` written by LitData's ``BinaryWriter`` into ``root`` in a layout
    of ``LITDATA_LAYOUTS`` (``chunk_bytes`` small: several chunks), read back by
    ``litdata.StreamingDataset``; fields named by ``leaf_names``."""
    from litdata.streaming.writer import BinaryWriter

    writer = BinaryWriter(str(root), chunk_bytes=chunk_bytes, **LITDATA_LAYOUTS[layout])
    for k in range(samples):
        writer[k] = item(k)
    writer.done()
    writer.merge()
    document = json.loads((root / "index.json").read_text())
    config = document["config"]
    encodings = dict(zip(leaf_names(config["data_spec"]), config["data_format"], strict=True))
    read = _read_litdata_footer if arrow_footers(root, document) else _read_litdata
    return PeerDataset(root, encodings, *read(root, encodings, samples))


def arrow_footers(root: Path, document: dict) -> bool:
    """Whether the chunks ``document`` (an ``index.json``) lists hold their items in Arrow footers."""
    found = set()
    for chunk in document["chunks"]:
        data = (root / chunk["filename"]).read_bytes()
        offsets = np.frombuffer(data, "<u4", int(chunk["chunk_size"]) + 1, 4)
        found.add(bool((offsets == offsets[0]).all()) and data.endswith(b"LDARW01\0"))
    assert len(found) == 1, "chunks of both kinds"
    return found.pop()


def leaf_names(data_spec: str) -> list[str]:
    """The field name of each leaf of a LitData item, in ``data_format`` order: its path down the
    item, a dict's key or a list's or tuple's position at each level, joined with ``.``
    (``meta.source``; ``0``, ``1`` for a tuple item). An item that is a bare leaf is field ``item``."""
    from litdata.utilities._pytree import tree_unflatten, treespec_loads

    spec = treespec_loads(data_spec)
    positions = tree_unflatten(list(range(spec.num_leaves)), spec)  # each leaf replaced by its position
    names = [""] * spec.num_leaves
    for position, path in _leaf_paths(positions, ()):
        names[position] = ".".join(path) or "item"
    return names


def _leaf_paths(node: Any, path: tuple[str, ...]):
    if isinstance(node, Mapping):
        children = node.items()
    elif isinstance(node, (list, tuple)):
        children = enumerate(node)
    else:
        yield node, path
        return
    for key, child in children:
        yield from _leaf_paths(child, (*path, str(key)))


class _Recording:
    """Stands in for one of the reader's deserializers: keeps the bytes it is handed and the
    value it returns."""

    def __init__(self, serializer, calls: list[tuple[bytes, Any]]):
        self._serializer, self._calls = serializer, calls

    def deserialize(self, data) -> Any:
        try:
            value = self._serializer.deserialize(data)
        except ModuleNotFoundError as error:  # torchvision, or import_streaming's stand-in for it
            if error.name.partition(".")[0] != "torchvision":
                raise
            value = PeerCannotDecode(str(error))
        self._calls.append((bytes(data), value))
        return value

    def __getattr__(self, name: str) -> Any:
        return getattr(self._serializer, name)


def _read_litdata(root: Path, encodings: dict[str, str], samples: int) -> tuple[dict, dict]:
    """Each item through ``litdata.StreamingDataset``, one item per decode (``batch_decode="item"``),
    with the per-leaf deserializers that ``PyTreeLoader.setup`` picks wrapped to keep their input."""
    import litdata
    from litdata.streaming.item_loader import BaseItemLoader

    calls: list[tuple[bytes, Any]] = []

    def recording_setup(loader, *args, **kwargs) -> None:
        setup(loader, *args, **kwargs)
        loader._serializers_list = [_Recording(serializer, calls) for serializer in loader._serializers_list]

    setup = BaseItemLoader.setup
    with mock.patch.object(BaseItemLoader, "setup", recording_setup):
        return _read_back(root, lambda local: litdata.StreamingDataset(input_dir=local, batch_decode="item"),
                          calls, encodings, samples)


def _read_litdata_footer(root: Path, encodings: dict[str, str], samples: int) -> tuple[dict, dict]:
    """Each item through ``litdata.StreamingDataset``, whose values from an Arrow footer meet no
    deserializer: a field's raw bytes are what LitData's serializer of its leaf writes of the
    value returned (``None``: the sample lacks the field)."""
    import litdata
    from litdata.streaming.serializers import _SERIALIZERS

    raw, decoded = {}, {}
    with tempfile.TemporaryDirectory() as scratch:
        dataset = litdata.StreamingDataset(input_dir=str(shutil.copytree(root, Path(scratch) / "local")))
        assert len(dataset) == samples, (len(dataset), samples)
        for i in range(samples):
            item = dataset[i]
            assert list(item) == list(encodings), (i, list(item))
            for field, encoding in encodings.items():
                if item[field] is not None:
                    raw[i, field] = _SERIALIZERS[encoding].serialize(item[field])[0]
                    decoded[i, field] = item[field]
    return raw, decoded
