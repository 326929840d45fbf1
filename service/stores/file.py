"""``file://`` store: the embedded default. File I/O runs in threads, off the event loop.

A file's version is its inode, modification time and size: writes replace a file (a new
inode), and a file rewritten in place changes its mtime."""

from __future__ import annotations

import asyncio
import os
import tempfile
from pathlib import Path

from shardfeed.buffers import BufferPool
from shardfeed.service.stores.base import (
    Arrived, InvalidPath, ObjectChanged, ObjectInfo, ObjectNotFound, ShortRead, Store, StoreError, clean_path,
    handed_on,
)


def file_version(st: os.stat_result) -> str:
    """The version (``ObjectInfo.etag``) of a file of status ``st``."""
    return f"{st.st_ino:x}-{st.st_mtime_ns:x}-{st.st_size:x}"



def _read_piece(f, size: int, buffers: BufferPool | None) -> bytes | memoryview:
    """The next ``size`` bytes of ``f`` (fewer at its end), into a pool buffer where there is a pool."""
    if buffers is None:
        return f.read(size)
    piece = buffers.take(size)
    return piece[:f.readinto(piece)]

class FileStore(Store):
    def __init__(self, url: str, root: str | os.PathLike):
        self.url = url
        self.root = Path(root).resolve()

    def _resolve(self, path: str) -> Path:
        full = (self.root / clean_path(path)).resolve()
        # resolve() follows symlinks, so this also refuses links that point outside.
        if full != self.root and self.root not in full.parents:
            raise InvalidPath(f"object path {path!r} escapes the dataset root {self.url}")
        return full

    def _read_pieces(self, path: str, offset: int, size: int, piece: int, version: str | None,
                     buffers: BufferPool | None = None) -> list[bytes | memoryview]:
        full = self._resolve(path)
        try:
            with open(full, "rb") as f:
                self._check(f, path, version)
                f.seek(offset)
                pieces = [_read_piece(f, min(piece, size - at), buffers) for at in range(0, size, piece)] or [b""]
        except FileNotFoundError:
            raise ObjectNotFound(f"{self.url}/{path}: no such object") from None
        except IsADirectoryError:
            raise ObjectNotFound(f"{self.url}/{path}: is a directory") from None
        except OSError as err:
            raise StoreError(f"{self.url}/{path}: {err.strerror}") from None
        got = sum(map(len, pieces))
        if got != size:
            raise ShortRead(f"{self.url}/{path}: wanted {size} bytes at {offset}, got {got}")
        return pieces

    def _check(self, f, path: str, version: str | None) -> None:
        """``ObjectChanged`` unless the open file ``f`` is of ``version`` (when given)."""
        if version is not None and file_version(os.fstat(f.fileno())) != version:
            raise ObjectChanged(f"{self.url}/{path}: replaced in the store since it was listed")

    def _read(self, path: str, version: str | None) -> bytes:
        full = self._resolve(path)
        try:
            with open(full, "rb") as f:
                self._check(f, path, version)
                return f.read()
        except (FileNotFoundError, IsADirectoryError):
            raise ObjectNotFound(f"{self.url}/{path}: no such object") from None
        except OSError as err:
            raise StoreError(f"{self.url}/{path}: {err.strerror}") from None

    def _write(self, path: str, data: bytes) -> None:
        full = self._resolve(path)
        try:
            full.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=full.parent, prefix=".tmp-")
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                os.chmod(tmp, 0o644)  # mkstemp makes 0600; a service running as another user must read it
                os.replace(tmp, full)
            except BaseException:
                os.unlink(tmp)
                raise
        except OSError as err:
            raise StoreError(f"{self.url}/{path}: cannot write: {err.strerror}") from None

    def _list(self, prefix: str) -> list[ObjectInfo]:
        if not self.root.is_dir():
            raise ObjectNotFound(f"{self.url}: no such directory")
        out = []
        for dirpath, dirnames, filenames in os.walk(self.root):
            dirnames[:] = [d for d in dirnames if not d.startswith(".")]
            for name in filenames:
                if name.startswith("."):
                    continue
                full = Path(dirpath, name)
                rel = full.relative_to(self.root).as_posix()
                if rel.startswith(prefix):
                    st = full.stat()
                    out.append(ObjectInfo(rel, st.st_size, file_version(st)))
        return sorted(out, key=lambda o: o.path)

    def _head(self, path: str) -> ObjectInfo:
        full = self._resolve(path)
        try:
            st = full.stat()
        except FileNotFoundError:
            raise ObjectNotFound(f"{self.url}/{path}: no such object") from None
        if not full.is_file():
            raise ObjectNotFound(f"{self.url}/{path}: not a file")
        return ObjectInfo(clean_path(path), st.st_size, file_version(st))

    async def read_range(self, path: str, offset: int, size: int, version: str | None = None) -> bytes:
        return (await asyncio.to_thread(self._read_pieces, path, offset, size, max(size, 1), version))[0]

    async def read_pieces(self, path: str, offset: int, size: int, piece: int,
                          version: str | None = None, *, arrived: Arrived | None = None,
                          buffers: BufferPool | None = None) -> list[bytes]:
        return handed_on(await asyncio.to_thread(self._read_pieces, path, offset, size, piece, version, buffers),
                         arrived)

    async def read(self, path: str, version: str | None = None) -> bytes:
        return await asyncio.to_thread(self._read, path, version)

    async def write(self, path: str, data: bytes) -> None:
        await asyncio.to_thread(self._write, path, data)

    async def list(self, prefix: str = "") -> list[ObjectInfo]:
        return await asyncio.to_thread(self._list, prefix)

    async def head(self, path: str) -> ObjectInfo:
        return await asyncio.to_thread(self._head, path)
