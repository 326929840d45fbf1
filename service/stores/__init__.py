"""Storage backends behind one async interface (see ``base.Store``).

One module per store (``file.py``; ``s3.py``, its requests and wire format, with its ranged
reads' transport ``getter.py``), and two stores that wrap another: ``hedge.py``, whose ranged
reads are hedged, and ``compressed.py``, which serves MDS's and LitData's raw shards from their
compressed objects (LitData's framed zstd chunks: ``framed.py``). ``lru.py``: the bounded async
memo (singleflight) that GetBatch's lookups and the compressed store share.
May import: ``observe``, ``http``, ``config``.
"""

from __future__ import annotations

from urllib.parse import unquote, urlparse

from shardfeed.service.stores.base import (
    AccessDenied, Arrived, CorruptObject, InvalidPath, ObjectChanged, ObjectInfo, ObjectNotFound, ShortRead, Store,
    StoreError, StoreUnavailable,
)

__all__ = [
    "AccessDenied", "Arrived", "CorruptObject", "InvalidPath", "ObjectChanged", "ObjectInfo", "ObjectNotFound",
    "ShortRead", "Store", "StoreError", "StoreUnavailable", "open_store",
]


def open_store(url: str, **options) -> Store:
    """Open the store rooted at ``url``: ``file:///abs/dir``, a plain path, or ``s3://bucket/prefix``.

    ``options`` are passed to the backend (for S3: timeouts, pool size, retries).
    """
    parsed = urlparse(url)
    if parsed.scheme in ("", "file"):
        from shardfeed.service.stores.file import FileStore

        path = unquote(parsed.path) if parsed.scheme == "file" else url
        if not path:
            raise StoreError(f"invalid dataset URL {url!r}")
        return FileStore(url, path)
    if parsed.scheme == "s3":
        from shardfeed.service.stores.s3 import S3Store

        if not parsed.netloc:
            raise StoreError(f"invalid S3 URL {url!r}: missing bucket (expected s3://bucket/prefix)")
        return S3Store(url, bucket=parsed.netloc, prefix=parsed.path.strip("/"), **options)
    raise StoreError(f"unsupported URL scheme in {url!r} (expected file:// or s3://)")
