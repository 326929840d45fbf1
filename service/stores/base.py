"""The store interface: the only way the service and the CLI touch object storage.

A store is rooted at a dataset URL (``file:///data/train`` or ``s3://bucket/prefix``);
every path it takes is relative to that root and confined to it.

Objects are mutable. Listings and HEADs name each object's version (``ObjectInfo.etag``),
and a read given that ``version`` is conditional (S3's ``If-Match``): it returns bytes of
that version or raises ``ObjectChanged``, never bytes of another. Callers that keep bytes
(the block cache) key them by the version, so a replaced object is never served stale.
"""

from __future__ import annotations

import posixpath
from contextvars import ContextVar
from collections.abc import AsyncIterable, AsyncIterator, Callable
from abc import ABC, abstractmethod
from dataclasses import dataclass

from shardfeed.buffers import BufferPool


class StoreError(Exception):
    """Base error of the storage layer. ``str(err)`` names the object or URL at fault."""


class ObjectNotFound(StoreError):
    """The object (or bucket) does not exist."""


class AccessDenied(StoreError):
    """Credentials are missing, wrong, or lack permission."""


class InvalidPath(StoreError):
    """A path escapes the store root (``..``, absolute path, escaping symlink)."""


class StoreUnavailable(StoreError):
    """The store could not be reached or kept failing after all retries."""


class ShortRead(StoreError):
    """A read returned fewer or more bytes than asked for (truncated or mismatched)."""


class ObjectChanged(StoreError):
    """The object is no longer the version a read asked for: it was replaced in the store."""


class CorruptObject(StoreError):
    """The object's bytes are not what its format says: a compressed shard that does not
    decompress, or decompresses to another size than its dataset's index says."""


@dataclass(frozen=True)
class ObjectInfo:
    path: str  # relative to the store root, '/'-separated
    size: int
    etag: str | None = None
    """The object's version as the store names it (S3's ETag; a file's inode, mtime and size).
    A read given it as ``version`` fails with ``ObjectChanged`` once the object is replaced."""


def clean_path(path: str) -> str:
    """Normalise a relative object path; refuse anything that could leave the root."""
    if not path or path.startswith("/") or "\\" in path or "\x00" in path:
        raise InvalidPath(f"invalid object path {path!r}")
    norm = posixpath.normpath(path)
    if norm == ".." or norm.startswith("../") or norm == ".":
        raise InvalidPath(f"object path {path!r} escapes the dataset root")
    return norm


class Tries:
    """How often a read failed and was tried again, as the store that retries it counts them."""

    def __init__(self) -> None:
        self.failed = 0


RETRIED: ContextVar[Tries | None] = ContextVar("shardfeed_store_retried", default=None)
"""Set for a read (its task's context) by whoever needs to know whether the store had to retry it:
the hedger (``hedge.py``) spends no hedge on a read being retried, which is failing, not late."""


Arrived = Callable[[int, bytes | bytearray], None]
"""``read_pieces``'s ``arrived``: called with a piece's number and bytes once it is complete."""


def handed_on(pieces: list, arrived: Arrived | None) -> list:
    """``pieces``, each handed to ``arrived`` first (a read whose pieces all came at once)."""
    if arrived is not None:
        for number, piece in enumerate(pieces):
            arrived(number, piece)
    return pieces


def copied(data: bytes | memoryview, buffers: BufferPool | None) -> bytes | memoryview:
    """A piece of its own holding ``data``: a pool buffer where there is a pool."""
    if buffers is None:
        return bytes(data)
    piece = buffers.take(len(data))
    piece[:] = data
    return piece


class Store(ABC):
    """Async access to the objects under one root URL."""

    url: str

    @abstractmethod
    async def read_range(self, path: str, offset: int, size: int, version: str | None = None) -> bytes:
        """Exactly ``size`` bytes of ``path`` from ``offset``; ``ShortRead`` otherwise.
        ``version``: only of that version (``ObjectInfo.etag``); ``ObjectChanged`` otherwise."""

    async def read_pieces(self, path: str, offset: int, size: int, piece: int,
                          version: str | None = None, *, arrived: Arrived | None = None,
                          buffers: BufferPool | None = None) -> list[bytes]:
        """``read_range`` as consecutive pieces of ``piece`` bytes (the last may be shorter),
        each an object of its own (``bytes`` or ``bytearray``): a cache can keep any piece
        without the others' bytes.
        ``arrived(number, piece)`` is called for each piece once it is complete, before the
        call returns, possibly again for the same piece (a read retried or hedged: the same
        bytes). ``buffers``: where the pieces go (``shardfeed/buffers.py``: reused, page-aligned
        buffers), else each a new object. This default splits one read with a copy; backends
        that can fill the pieces as the bytes arrive do so, and hand each on as soon as it is in
        (``s3.py``)."""
        data = await self.read_range(path, offset, size, version)
        view = memoryview(data)
        if size <= piece and buffers is None:
            return handed_on([data], arrived)
        return handed_on([copied(view[at:at + piece], buffers) for at in range(0, max(size, 1), piece)], arrived)

    @abstractmethod
    async def read(self, path: str, version: str | None = None) -> bytes:
        """The whole object (of ``version`` when given, as ``read_range``)."""

    @abstractmethod
    async def write(self, path: str, data: bytes) -> None:
        """Create or replace ``path`` atomically (readers never see a partial object)."""

    async def write_stream(self, path: str, chunks: AsyncIterable[bytes | memoryview]) -> int:
        """``write`` the concatenated ``chunks``; returns the size. Backends that can upload in
        parts (S3 multipart) hold only a part in memory; this default holds the whole object."""
        data = b"".join([bytes(c) async for c in chunks])
        await self.write(path, data)
        return len(data)

    @abstractmethod
    async def list(self, prefix: str = "") -> list[ObjectInfo]:
        """Every object under ``prefix`` (recursively), sorted by path."""

    async def list_pages(self, prefix: str = "") -> AsyncIterator[list[ObjectInfo]]:
        """``list(prefix)`` a page at a time (a page per LIST request where the backend pages)."""
        yield await self.list(prefix)

    @abstractmethod
    async def head(self, path: str) -> ObjectInfo:
        """Size (and ETag where known) of ``path``; ``ObjectNotFound`` if absent."""

    async def close(self) -> None:
        """Release connections. The store must not be used afterwards."""

    async def __aenter__(self) -> "Store":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
