"""The ``mds`` layout: MosaicML Streaming's ``index.json`` (version 2, format ``mds``).

``{"version": 2, "shards": [...]}``, each shard::

    column_names, column_encodings, column_sizes   the columns in record order; a size for
                                                   each fixed-size one, null for the others
    samples                                        records in the shard
    raw_data: {basename, bytes}                    the shard as read
    zip_data: {basename, bytes, hashes} | null     the shard as stored, when ``compression``; its
                                                   ``hashes`` (``sha1``, ``xxh64``, ...) are checked
                                                   when it is read whole
    compression: "zstd" | "zstd:7" | "gz" | ...    (streaming/base/compression.py's names)

A compressed shard whose raw form a Streaming reader left beside it is read raw.
"""

from __future__ import annotations

from shardfeed.service.datasets.indexfile import IndexFormatError
from shardfeed.service.datasets.records import Column, PeerLayout, PeerShard, RecordFormat, field_names


ENCODINGS = frozenset({
    "bytes", "str", "int", "ndarray", "uint8", "uint16", "uint32", "uint64", "int8", "int16", "int32", "int64",
    "float16", "float32", "float64", "str_int", "str_float", "str_decimal", "pil", "jpeg", "jpeg_array",
    "jpegarray", "png", "list[pil]", "list[jpeg]", "list[png]", "pkl", "json"})
"""Streaming 0.13's encodings (``streaming/base/format/mds/encodings.py``), ``ndarray:DTYPE:SHAPE``
counted as ``ndarray``: a column of any other cannot be what Streaming wrote."""


def layout(document: dict, where: str, listed: set[str]) -> PeerLayout:
    """``PeerLayout`` of an MDS ``index.json`` (``IndexFormatError`` naming what is wrong)."""
    if document.get("version") != 2:
        raise IndexFormatError(f"{where}: MDS index version {document.get('version')!r} (this shardfeed reads 2)")
    shards, columns = [], None
    for number, shard in enumerate(document["shards"]):
        name = shard["raw_data"]["basename"]
        if shard.get("format") != "mds" or shard.get("version") != 2:
            raise IndexFormatError(f"{where}: shard {name!r} is format {shard.get('format')!r} version "
                                   f"{shard.get('version')!r} (this shardfeed reads mds version 2)")
        found = tuple(Column(field, str(encoding), None if size is None else int(size)) for field, encoding, size in
                      zip(field_names(shard["column_names"], f"{where} shard {name!r}"),
                          shard["column_encodings"], shard["column_sizes"], strict=True))
        for column in found:
            if column.encoding.partition(":")[0] not in ENCODINGS:
                raise IndexFormatError(f"{where}: shard {name!r}'s column {column.name!r} has an unknown "
                                       f"encoding {column.encoding!r}")
        if columns is None:
            columns = found
        elif found != columns:
            raise IndexFormatError(f"{where}: shard {name!r} has other columns than the first shard")
        zipped = shard.get("zip_data")
        if shard.get("compression") and zipped and name not in listed:
            shards.append(PeerShard(name, int(shard["samples"]), int(shard["raw_data"]["bytes"]),
                                    zipped["basename"], shard["compression"],
                                    digests=tuple(sorted((zipped.get("hashes") or {}).items()))))
        else:
            shards.append(PeerShard(name, int(shard["samples"]), int(shard["raw_data"]["bytes"]), name))
    if columns is None:
        raise IndexFormatError(f"{where}: lists no shards")
    return PeerLayout(RecordFormat("mds", columns), tuple(shards))
