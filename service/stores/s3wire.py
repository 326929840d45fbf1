"""The S3 REST protocol as ``S3Store`` speaks it, apart from sending and signing.

Pure pieces of the wire, each about one answer: the endpoint and the Host header SigV4
signs; an error answer (status and ``<Error>`` body) mapped to a ``StoreError``, with the
retryable ones (``Truncated``, ``Overloaded``) marked for ``shardfeed.retry``, and what a
request that failed every try raises; a body read whole, or a ranged read's pieces, checked
against the length asked; a ranged answer's ``Content-Range`` checked; a ListObjectsV2 page;
the multipart-upload answers.
"""

from __future__ import annotations

import asyncio
import os
import re
from collections.abc import Callable
from itertools import accumulate
import xml.etree.ElementTree as ET
from urllib.parse import unquote_plus, urlsplit

import aiohttp

from shardfeed.http11 import Head
from shardfeed.service.stores.getter import Answer, CannotConnect
from shardfeed.service.stores.base import (
    AccessDenied, Arrived, ObjectChanged, ObjectNotFound, ShortRead, StoreError, StoreUnavailable, handed_on,
)

CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)")
ERROR_FIELD = re.compile(r"<(Code|Message)>([^<]*)</\1>")
_DENIED_CODES = {"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken",
                 "InvalidToken", "TokenRefreshRequired", "AllAccessDisabled"}
_TRANSIENT_STATUS = {429, 500, 502, 503, 504}
ERROR_BODY_LIMIT = 64 << 10
"""Bytes of an error answer's body read at most (its ``<Error>`` fields)."""


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
    # OSError: the getter's failed connections, cut answers and silences (``TimeoutError``).
    return isinstance(err, (Truncated, aiohttp.ClientError, OSError))


def gave_up(err: Exception, object_url: str, endpoint: str, timeouts: str, after: str) -> StoreError:
    """What a request that failed on its every try (``after``) raises."""
    if isinstance(err, Truncated):
        return ShortRead(f"{err} ({after})")
    if isinstance(err, Overloaded):
        return StoreUnavailable(f"{err} ({after})")
    if isinstance(err, asyncio.TimeoutError):
        return StoreUnavailable(f"{object_url}: S3 endpoint {endpoint} timed out ({timeouts}; {after})")
    if isinstance(err, (aiohttp.ClientConnectorError, CannotConnect)):
        reason = getattr(getattr(err, "os_error", None), "strerror", None) or str(err)
        return StoreUnavailable(f"{object_url}: cannot connect to S3 endpoint {endpoint} ({reason}; {after})")
    return StoreUnavailable(f"{object_url}: connection to S3 endpoint {endpoint} failed "
                            f"({type(err).__name__}: {err}; {after})")


def retry_after(headers) -> float | None:
    value = headers.get("retry-after", "")
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
    """Turn an aiohttp answer of status 300 or more into the ``StoreError`` it means."""
    raise status_error(resp.status, resp.headers, await resp.content.read(ERROR_BODY_LIMIT), object_url, key, bucket)


def status_error(status: int, headers, body: bytes, object_url: str, key: str, bucket: str) -> StoreError:
    """The ``StoreError`` an answer of status 300 or more means (``headers``: looked up by
    lower-case name), from its status and its ``<Error>`` body."""
    text = body.decode("utf-8", "replace")
    fields = dict(ERROR_FIELD.findall(text))
    code, message = fields.get("Code", ""), fields.get("Message", "")
    detail = f"{code}: {message}" if code else f"HTTP {status}"
    if status in (401, 403) or code in _DENIED_CODES:
        return AccessDenied(f"{object_url}: access denied ({detail})")
    if code == "NoSuchBucket" or (status == 404 and not key):
        return ObjectNotFound(f"{object_url}: bucket {bucket!r} does not exist")
    if status == 404:
        return ObjectNotFound(f"{object_url}: no such object")
    if status == 416:
        return ShortRead(f"{object_url}: range starts past the end of the object")
    if status == 412:
        return ObjectChanged(f"{object_url}: replaced in the store (If-Match failed: {detail})")
    if status in _TRANSIENT_STATUS or code == "SlowDown":
        return Overloaded(f"{object_url}: S3 answered HTTP {status} ({detail})", retry_after(headers))
    region = headers.get("x-amz-bucket-region")
    hint = f"; the bucket is in region {region}, set AWS_DEFAULT_REGION" if region else ""
    return StoreError(f"{object_url}: S3 answered HTTP {status} ({detail}){hint}")


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

def ranged_pieces(answer: Answer, sizes: list[int], accept: Callable[[Head, int], None], arrived: Arrived | None,
                  object_url: str, key: str, bucket: str) -> list[bytearray]:
    """The pieces of a ranged read's answer (``getter.py``): those it landed in, or, where it came
    framed otherwise, its body checked by ``accept(head, length)``, then cut and handed on."""
    status = answer.head.status
    if status >= 300:
        raise status_error(status, answer.head.headers, answer.body[:ERROR_BODY_LIMIT], object_url, key, bucket)
    if answer.pieces is not None:
        return answer.pieces
    accept(answer.head, len(answer.body))
    if len(answer.body) != sum(sizes):
        raise Truncated(f"{object_url}: got {len(answer.body)} bytes, expected {sum(sizes)}")
    ends = list(accumulate(sizes))
    return handed_on([bytearray(answer.body[end - n:end]) for end, n in zip(ends, sizes)], arrived)


def check_version(headers, object_url: str, version: str | None) -> None:
    """Refuse an answer of another version than asked for (a server that ignores If-Match)."""
    etag = headers.get("etag", "").strip('"')
    if version is not None and etag and etag != version:
        raise ObjectChanged(f"{object_url}: replaced in the store (ETag {version} -> {etag})")


def check_range(status: int, headers, length: int | None, object_url: str, offset: int, size: int) -> None:
    """Refuse an answer (``length``: its body's) to ``Range: bytes=offset-(offset+size-1)``
    that is not exactly that range."""
    last = offset + size - 1
    if status == 200:  # Range ignored: fine only if the object is exactly the range
        if offset != 0 or length != size:
            raise Truncated(f"{object_url}: server ignored Range bytes={offset}-{last}")
        return
    found = CONTENT_RANGE.fullmatch(headers.get("content-range", ""))
    if found is None or status != 206:
        raise Truncated(f"{object_url}: HTTP {status} with Content-Range "
                        f"{headers.get('content-range')!r}")
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
