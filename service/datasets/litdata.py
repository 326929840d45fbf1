"""The ``litdata`` layout: LitData's ``index.json`` (``litdata.optimize``, its ``BinaryWriter``).

``{"chunks": [...], "config": {...}}``::

    chunks[]: {filename, chunk_size, chunk_bytes}   each chunk's file, records and raw bytes
    config.data_format                              each pytree leaf's serializer, in leaf order
    config.data_spec                                the items' pytree (``treespec_dumps``): the
                                                    leaves' names
    config.item_loader                              ``PyTreeLoader`` (the only one read here)
    config.compression, config.compression_level    ``zstd`` with ``batch``: frames inside each
                                                    ``.bin`` (LDFZ01, read frame by frame); none
                                                    (or ``chunk``): whole ``.zstd.bin`` files

A chunk of dict items whose leaves are all plain values (str, int, float, bool, bytes) holds
them in an Arrow footer after empty records (``arrowfooter.py``); its columns are the leaves.

A leaf's field name is its path in the item: a dict key, a list or tuple position, joined
with dots (``{"img": ..., "meta": {"label": ...}}`` has fields ``img`` and ``meta.label``);
an item that is a single leaf has the field ``item``. Leaves are in pytree order, a dict's
keys in insertion order, as LitData writes them.
"""

from __future__ import annotations

import json

from shardfeed.service.datasets.indexfile import IndexFormatError
from shardfeed.service.datasets.records import Column, PeerLayout, PeerShard, RecordFormat, field_names


SERIALIZERS = frozenset({
    "str", "text", "bool", "int", "float", "video", "audio", "image", "nifti", "mesh", "pdf", "graph", "tifffile",
    "file", "pil", "jpeg", "jpeg_array", "bytes", "no_header_numpy", "numpy", "no_header_tensor", "tensor", "json",
    "pickle"})
"""LitData 0.2.76's serializers (``litdata/streaming/serializers.py``), ``NAME:ARG`` counted as ``NAME``."""


def leaf_names(spec: dict, path: str = "") -> list[str]:
    """The names of a treespec's leaves (``torch.utils._pytree`` JSON, protocol 1), in order."""
    kind, children = spec.get("type"), spec.get("children_spec", [])
    if kind is None:
        return [path or "item"]
    if kind in ("builtins.dict", "collections.OrderedDict", "collections.defaultdict"):
        context = json.loads(spec["context"])
        keys = context[1] if kind == "collections.defaultdict" else context
    elif kind in ("builtins.list", "builtins.tuple"):
        keys = range(len(children))
    else:
        raise IndexFormatError(f"items of pytree node type {kind!r} are not read (dicts, lists and tuples are)")
    return [name for key, child in zip(keys, children, strict=True)
            for name in leaf_names(child, f"{path}.{key}" if path else str(key))]


def layout(document: dict, where: str, listed: set[str]) -> PeerLayout:
    """``PeerLayout`` of a LitData ``index.json`` (``IndexFormatError`` naming what is wrong)."""
    config = document["config"]
    if config.get("item_loader", "PyTreeLoader") != "PyTreeLoader":
        raise IndexFormatError(f"{where}: item loader {config['item_loader']!r} (this shardfeed reads PyTreeLoader)")
    if config.get("encryption"):
        raise IndexFormatError(f"{where}: encrypted chunks are not read")
    protocol, spec = json.loads(config["data_spec"])
    if protocol != 1:
        raise IndexFormatError(f"{where}: pytree spec protocol {protocol!r} (this shardfeed reads 1)")
    formats = config["data_format"]
    names = field_names(leaf_names(spec), where)
    if len(names) != len(formats):
        raise IndexFormatError(f"{where}: {len(formats)} leaf formats for {len(names)} leaves")
    for name, encoding in zip(names, formats):
        if str(encoding).partition(":")[0] not in SERIALIZERS:
            raise IndexFormatError(f"{where}: leaf {name!r} has an unknown serializer {encoding!r}")
    columns = tuple(Column(name, str(encoding), None) for name, encoding in zip(names, formats))
    codec = config.get("compression") or None
    level = config.get("compression_level")
    if codec is not None and level == "sample":
        raise IndexFormatError(f"{where}: chunks compressed item by item (compression_level 'sample') are not read")
    framed = codec is not None and level == "batch"
    shards = []
    for chunk in document["chunks"]:
        name = chunk["filename"]
        raw = None if framed else int(chunk["chunk_bytes"])  # a framed chunk's is its stored size
        shards.append(PeerShard(name, int(chunk["chunk_size"]), raw, name, codec, framed))
    if not shards:
        raise IndexFormatError(f"{where}: lists no chunks")
    return PeerLayout(RecordFormat("litdata", columns), tuple(shards))
