"""One copy of an index per host: an ``Index`` memory-mapped from a file its processes share.

Every worker (``--workers``), and every restart of one, opens a dataset's index by mapping
the same file read-only: the arrays live once, in the page cache, whatever the number of
processes, and an open touches none of its per-sample pages (the index's ``IndexStats``
are in the file's header). The file is made once per index version, by whoever opens it
first (under an ``flock``; the others wait for it and map it), from an index read as
usual (``index.parquet``, a kept one, or objects listed).

File layout (native byte order, the host's own cache)::

    MAGIC (16 bytes) | header length (8, little-endian) | header (JSON) | arrays

Each array starts at a multiple of 64 bytes; the header names every array's dtype, offset
and length, and the file's size. A file shorter than its header says (a crash mid-write
would leave one only under a temporary name, but a disk may still lose a tail) or with
another magic is made again, never read.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import hashlib
import json
import logging
import mmap
import os
import tempfile
import weakref
from collections.abc import Awaitable, Callable
from pathlib import Path

import numpy as np
import pyarrow as pa

from shardfeed.service.cache.names import dataset_id
from shardfeed.service.datasets.autoindex import locked
from shardfeed.service.datasets.index import Index
from shardfeed.service.datasets.indexfile import IndexFormatError, IndexStats

log = logging.getLogger("shardfeed.datasets")

MAGIC = b"shardfeed-index\x02"  # 2: the header says ``records``
SUFFIX = ".idx"
_SCRATCH = ".scratch"
_ALIGN = 64
_STATS_ARRAYS = ("extents", "run_starts", "run_shards")


def write_mapped(index: Index, path: Path) -> None:
    """Write ``index`` as a map file at ``path``, atomically (a reader sees all of it or none)."""
    arrays = {name: a for name, a in index.arrays().items() if name != "keys"}
    keys = index.arrays()["keys"]
    offsets_type = np.int64 if pa.types.is_large_string(keys.type) else np.int32
    offsets = np.frombuffer(keys.buffers()[1], offsets_type)[keys.offset:keys.offset + len(keys) + 1]
    data = np.frombuffer(keys.buffers()[2], np.uint8)[int(offsets[0]):int(offsets[-1])]
    arrays["key_offsets"] = offsets - offsets[0] if offsets[0] else offsets
    arrays["key_data"] = data
    stats = index.stats
    arrays.update({name: getattr(stats, name) for name in _STATS_ARRAYS})

    layout, position = {}, 0
    for name, array in arrays.items():
        layout[name] = [array.dtype.str, position, len(array)]
        position += -(-array.nbytes // _ALIGN) * _ALIGN
    header = {"layout": index.layout, "records": index.records, "shards": index.shards, "fields": index.fields,
              "total_bytes": stats.total_bytes, "per_sample": stats.per_sample,
              "shard_samples": stats.shard_samples, "arrays": layout}
    base = 0
    while True:  # the arrays follow the header, aligned; the header names where (two rounds at most)
        header["base"], header["size"] = base, base + position
        text = json.dumps(header).encode()
        end = -(-(len(MAGIC) + 8 + len(text)) // _ALIGN) * _ALIGN
        if end <= base:
            break
        base = end

    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temp = tempfile.mkstemp(dir=path.parent, prefix=f".tmp-{path.name}-")
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(MAGIC + len(text).to_bytes(8, "little") + text)
            for name, array in arrays.items():
                out.seek(base + layout[name][1])
                out.write(memoryview(np.ascontiguousarray(array)).cast("B"))
            out.truncate(header["size"])
        os.replace(temp, path)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise


def map_index(path: Path) -> Index:
    """The index in map file ``path``, its arrays views of a read-only shared mapping;
    ``IndexFormatError`` if the file is not a whole map file."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(len(MAGIC) + 8)
        if len(head) < len(MAGIC) + 8 or head[:len(MAGIC)] != MAGIC:
            raise IndexFormatError(f"{path}: not a shardfeed index map")
        try:
            header = json.loads(f.read(int.from_bytes(head[len(MAGIC):], "little")))
        except (ValueError, UnicodeDecodeError):
            raise IndexFormatError(f"{path}: its header is torn") from None
        if header.get("size") != size:
            raise IndexFormatError(f"{path}: {size} bytes, its header says {header.get('size')}")
        memory = mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ)  # lives as long as a view of it

    def array(name: str) -> np.ndarray:
        dtype, offset, count = header["arrays"][name]
        return np.frombuffer(memory, np.dtype(dtype), count, header["base"] + offset)

    key_offsets = array("key_offsets")
    key_type = pa.large_string() if key_offsets.dtype == np.int64 else pa.string()
    keys = pa.Array.from_buffers(key_type, len(key_offsets) - 1,
                                 [None, pa.py_buffer(key_offsets), pa.py_buffer(array("key_data"))])
    stats = IndexStats(total_bytes=header["total_bytes"], per_sample=header["per_sample"],
                       shard_samples=header["shard_samples"],
                       **{name: array(name) for name in _STATS_ARRAYS})
    index = Index(keys=keys, starts=array("starts"), shard=array("shard"), field=array("field"),
                  offset=array("offset"), size=array("size"), shards=header["shards"], fields=header["fields"],
                  layout=header["layout"], records=header["records"], stats=stats)
    _map_files[index] = path
    return index


_map_files: weakref.WeakKeyDictionary[Index, Path] = weakref.WeakKeyDictionary()


def member_scratch(index: Index, name: str, dtype: type = np.uint8) -> np.ndarray:
    """A writable ``dtype`` per member of ``index``, zero at first: shared by the host's processes
    when the index is mapped (a sparse file beside its map, one per ``name``), else this
    process's own. For facts any process may learn and every other may use."""
    path = _map_files.get(index)
    size = index.members * np.dtype(dtype).itemsize
    if path is None or not index.members:
        return np.zeros(index.members, dtype)
    try:
        with open(path.with_name(f"{path.stem}-{name}{_SCRATCH}"), "a+b") as f:
            if os.fstat(f.fileno()).st_size != size:
                os.ftruncate(f.fileno(), size)
            return np.frombuffer(mmap.mmap(f.fileno(), size), dtype)
    except OSError as err:
        log.warning("no shared scratch beside %s (%s): this process keeps its own", path, err)
        return np.zeros(index.members, dtype)


class SharedIndexes:
    """The host's map files, in ``directory``: one per dataset URL and index version."""

    def __init__(self, directory: Path):
        self.directory = directory

    def path(self, url: str, version: str) -> Path:
        return self.directory / f"{dataset_id(url)}-{hashlib.sha1(version.encode()).hexdigest()[:16]}{SUFFIX}"

    async def share(self, url: str, version: str, build: Callable[[], Awaitable[Index]]) -> Index:
        """The index of ``url`` at ``version``, mapped: from its map file, else ``build()``
        (awaited by one process of the host at a time) and written to one for the others."""
        path = self.path(url, version)
        async with locked(path.with_suffix(".lock")):
            if path.exists():
                try:
                    return await asyncio.to_thread(map_index, path)
                except IndexFormatError as err:
                    log.warning("%s: making it again", err)
            index = await build()
            await asyncio.to_thread(self._replace, url, path, index)
            del index
            await asyncio.to_thread(release_memory)
        return await asyncio.to_thread(map_index, path)

    def _replace(self, url: str, path: Path, index: Index) -> None:
        """Write ``path`` and remove the dataset's older map files (a process that maps one
        keeps reading it: the kernel frees it with the last mapping)."""
        for pattern in (f"{dataset_id(url)}-*{SUFFIX}", f"{dataset_id(url)}-*{_SCRATCH}", f".tmp-{path.name}-*"):
            for old in self.directory.glob(pattern):  # older versions', or what a crash left
                if old != path:
                    old.unlink(missing_ok=True)
        write_mapped(index, path)
        log.info("index of %s mapped from %s (%d samples, %d bytes)", url, path, len(index), path.stat().st_size)


def release_memory() -> None:
    """Hand freed memory back to the OS: the built index's, which the Arrow pool and the C
    heap would otherwise keep (tens of bytes a sample, for the process that built it)."""
    pa.default_memory_pool().release_unused()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
