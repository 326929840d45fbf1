"""The S3 REST protocol as ``S3Store`` speaks it, apart from sending and signing.

Pure pieces of the wire, each about one answer: the endpoint and the Host header SigV4
signs; an error answer (status and ``<Error>`` body) mapped to a ``StoreError``, with the
retryable ones (``Truncated``, ``Overloaded``) marked for ``shardfeed.retry``; a body read
whole or in pieces and checked against the length asked; a ranged answer's
``Content-Range`` checked; a ListObjectsV2 page; the multipart-upload answers.
"""

from __future__ import annotations

import asyncio
import os
import re
import xml.etree.ElementTree as ET
from urllib.parse import unquote_plus, urlsplit

import aiohttp

from shardfeed.service.stores.base import (
    AccessDenied,
    ObjectChanged,
    ObjectNotFound,
    ShortRead,
    StoreError,
    StoreUnavailable,
)

CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)")
ERROR_FIELD = re.compile(r"<(Code|Message)>([^<]*)</\1>")
_DENIED_CODES = {"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken",
                 "InvalidToken", "TokenRefreshRequired", "AllAccessDisabled"}
_TRANSIENT_STATUS = {429, 500, 502, 503, 504}
_ERROR_BODY_LIMIT = 64 << 10


class Truncated(ShortRead):
    """A body or Content-Range that does not match what was asked: retried, then ``ShortRead``."""


class Overloaded(StoreUnavailable):
    """5xx, SlowDown or 429: retried (after ``Retry-After`` if given), then ``StoreUnavailable``."""

    def __init__(self, message: str, retry_after: float | None):
        super().__init__(message)
        self.retry_after = retry_after


def retryable(err: Exception) -> bool | float:
    """Whether (or after how many seconds, ``Retry-After``) a failed request is worth a retry."""
    if isinstance(err, Overloaded):
        return err.retry_after if err.retry_after is not None else True
    return isinstance(err, (Truncated, aiohttp.ClientError, asyncio.TimeoutError))


def retry_after(headers) -> float | None:
    value = headers.get("Retry-After", "")
    return float(value) if value.isdigit() else None  # HTTP-date form: use our own backoff


def resolve_endpoint(explicit: str | None, region: str) -> str:
    url = explicit or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if not url:
        return f"https://s3.{region}.amazonaws.com"
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.query:
        raise StoreError(f"invalid S3 endpoint URL {url!r} (expected http(s)://host[:port])")
    return url.rstrip("/")


def host_header(endpoint: str) -> str:
    """The Host header exactly as SigV4 signs it (default ports dropped)."""
    parts = urlsplit(endpoint)
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    if parts.port is not None and parts.port != {"http": 80, "https": 443}[parts.scheme]:
        host = f"{host}:{parts.port}"
    return host


async def raise_for_status(resp: aiohttp.ClientResponse, object_url: str, key: str, bucket: str) -> None:
    """Turn an answer of status 300 or more into the ``StoreError`` it means."""
    text = (await resp.content.read(_ERROR_BODY_LIMIT)).decode("utf-8", "replace")
    fields = dict(ERROR_FIELD.findall(text))
    code, message = fields.get("Code", ""), fields.get("Message", "")
    detail = f"{code}: {message}" if code else f"HTTP {resp.status}"
    if resp.status in (401, 403) or code in _DENIED_CODES:
        raise AccessDenied(f"{object_url}: access denied ({detail})")
    if code == "NoSuchBucket" or (resp.status == 404 and not key):
        raise ObjectNotFound(f"{object_url}: bucket {bucket!r} does not exist")
    if resp.status == 404:
        raise ObjectNotFound(f"{object_url}: no such object")
    if resp.status == 416:
        raise ShortRead(f"{object_url}: range starts past the end of the object")
    if resp.status == 412:
        raise ObjectChanged(f"{object_url}: replaced in the store (If-Match failed: {detail})")
    if resp.status in _TRANSIENT_STATUS or code == "SlowDown":
        raise Overloaded(f"{object_url}: S3 answered HTTP {resp.status} ({detail})",
                          retry_after(resp.headers))
    region = resp.headers.get("x-amz-bucket-region")
    hint = f"; the bucket is in region {region}, set AWS_DEFAULT_REGION" if region else ""
    raise StoreError(f"{object_url}: S3 answered HTTP {resp.status} ({detail}){hint}")


async def read_body(resp: aiohttp.ClientResponse, name: str, expected: int | None = None) -> bytes:
    """The body of the response about ``name``; with ``expected``, refuse (retryably) any other length."""
    if expected is not None and resp.content_length not in (None, expected):
        raise Truncated(f"{name}: Content-Length {resp.content_length}, expected {expected}")
    try:
        if expected is None or resp.content_length is not None:
            data = await resp.read()  # raises ClientPayloadError if the body ends early
        else:
            buf = bytearray()  # no Content-Length: read at most one byte too many
            async for chunk in resp.content.iter_any():
                buf += chunk
                if len(buf) > expected:
                    break
            data = bytes(buf)
    except aiohttp.ClientPayloadError as err:
        reason = getattr(err.__cause__, "message", None) or str(err)
        raise Truncated(f"{name}: body cut short ({' '.join(reason.split())})") from None
    if expected is not None and len(data) != expected:
        raise Truncated(f"{name}: got {len(data)} bytes, expected {expected}")
    return data

async def read_pieces(resp: aiohttp.ClientResponse, name: str, size: int, piece: int) -> list[bytes]:
    """The body of a ranged read as pieces of ``piece`` bytes, each filled as its bytes
    arrive: no copy of the whole body to split afterwards."""
    if resp.content_length != size:  # unknown length: bounded by ``read_body``, then split
        data = await read_body(resp, name, size)
        return [data[at:at + piece] for at in range(0, size, piece)]
    try:
        pieces = [await resp.content.readexactly(min(piece, size - at)) for at in range(0, size, piece)]
    except (aiohttp.ClientPayloadError, asyncio.IncompleteReadError) as err:
        reason = getattr(err.__cause__, "message", None) or str(err)
        raise Truncated(f"{name}: body cut short ({' '.join(reason.split())})") from None
    return pieces

def check_version(resp: aiohttp.ClientResponse, object_url: str, version: str | None) -> None:
    """Refuse an answer of another version than asked for (a server that ignores If-Match)."""
    etag = resp.headers.get("ETag", "").strip('"')
    if version is not None and etag and etag != version:
        raise ObjectChanged(f"{object_url}: replaced in the store (ETag {version} -> {etag})")


def check_range(resp: aiohttp.ClientResponse, object_url: str, offset: int, size: int) -> None:
    """Refuse an answer to ``Range: bytes=offset-(offset+size-1)`` that is not exactly that range."""
    last = offset + size - 1
    if resp.status == 200:  # Range ignored: fine only if the object is exactly the range
        if offset != 0 or resp.content_length != size:
            raise Truncated(f"{object_url}: server ignored Range bytes={offset}-{last}")
        return
    found = CONTENT_RANGE.fullmatch(resp.headers.get("Content-Range", ""))
    if found is None or resp.status != 206:
        raise Truncated(f"{object_url}: HTTP {resp.status} with Content-Range "
                        f"{resp.headers.get('Content-Range')!r}")
    start, end, total = found.groups()
    if total != "*" and int(total) <= last:
        raise ShortRead(f"{object_url}: object is {total} bytes, cannot read "
                        f"{size} bytes at offset {offset}")
    if (int(start), int(end)) != (offset, last):
        raise Truncated(f"{object_url}: asked bytes {offset}-{last}, "
                        f"got Content-Range {start}-{end}")


async def upload_id(resp: aiohttp.ClientResponse, url: str) -> str:
    """The UploadId of a CreateMultipartUpload answer."""
    found = re.search(rb"<UploadId>([^<]+)</UploadId>", await resp.read())
    if found is None:
        raise StoreError(f"{url}: CreateMultipartUpload answered without an UploadId")
    return found.group(1).decode()


async def completed(resp: aiohttp.ClientResponse, url: str) -> None:
    """Check a CompleteMultipartUpload answer."""
    text = await resp.read()  # S3 may answer 200 with an <Error> body
    if b"<Error>" in text:
        fields = dict(ERROR_FIELD.findall(text.decode("utf-8", "replace")))
        raise StoreError(f"{url}: CompleteMultipartUpload failed ({fields.get('Code')}: "
                         f"{fields.get('Message')})")


async def drain(resp: aiohttp.ClientResponse) -> None:
    await resp.read()


def parse_listing(xml: bytes, url: str) -> tuple[list[tuple[str, int, str | None]], str | None]:
    """(key, size, etag) of one ListObjectsV2 page, and the continuation token if truncated."""
    try:
        root = ET.fromstring(xml)
    except ET.ParseError as err:
        raise StoreError(f"{url}: malformed listing from S3 ({err})") from None
    for el in root.iter():  # drop the S3 XML namespace
        el.tag = el.tag.rpartition("}")[2]
    objects = []
    for item in root.iter("Contents"):
        etag = (item.findtext("ETag") or "").strip('"') or None
        objects.append((unquote_plus(item.findtext("Key") or ""), int(item.findtext("Size") or 0), etag))
    truncated = root.findtext("IsTruncated") == "true"
    token = root.findtext("NextContinuationToken") if truncated else None
    if truncated and not token:
        raise StoreError(f"{url}: truncated listing without a continuation token")
    return objects, token
