"""``s3://bucket/prefix`` store: requests signed with botocore SigV4.

This is the service's hot path, so a read is one request on a pooled keep-alive connection
plus one SigV4 signature; no boto3 client, no per-request session. Ranged reads, the bytes
the service serves, go through ``getter.py``, whose answers land in the pieces asked for
(half the CPU per MiB of aiohttp's); everything else (whole objects, writes, listings)
through aiohttp. Both go through ``_retried``: sign, send, map the status to a
``StoreError``, and retry what is worth retrying with the one policy in ``shardfeed.retry``.

Settings follow the AWS conventions: credentials from the standard chain (env vars,
profiles, SSO, instance roles; refreshed credentials are picked up on the next request),
the endpoint from ``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL`` (MinIO, Ceph, moto) or
else AWS's regional endpoint, path-style addressing, the region from the AWS config
(``AWS_DEFAULT_REGION``, profile) or ``us-east-1``.

The module's second half is the wire as ``S3Store`` speaks it, apart from sending and signing:
pure pieces, each about one answer: the endpoint and the Host header SigV4 signs; an error
answer (status and ``<Error>`` body) mapped to a ``StoreError``, with the retryable ones
(``Truncated``, ``Overloaded``) marked for ``shardfeed.retry``, and what a request that failed
every try raises; a body read whole, or a ranged read's pieces, checked against the length
asked; a ranged answer's ``Content-Range`` checked; a ListObjectsV2 page; the multipart-upload
answers.
"""

from __future__ import annotations

import asyncio
import os
import re
import xml.etree.ElementTree as ET
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable
from itertools import accumulate
from typing import TypeVar
from urllib.parse import quote, unquote_plus, urlsplit

import aiohttp
import botocore.exceptions
import botocore.session
from botocore.auth import S3SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.credentials import RefreshableCredentials
from yarl import URL

from shardfeed.buffers import BufferPool
from shardfeed.http11 import Head
from shardfeed.retry import Backoff, retry_async
from shardfeed.service.stores.base import (
    RETRIED, AccessDenied, Arrived, ObjectChanged, ObjectInfo, ObjectNotFound, ShortRead, Store, StoreError,
    StoreUnavailable, clean_path, handed_on,
)
from shardfeed.service.stores.getter import Answer, CannotConnect, CutShort, Getter

T = TypeVar("T")

_SIGN_IN_THREAD = 1 << 20  # hashing a larger body for the signature would stall the loop
READ_BUFFER = 1 << 20
"""aiohttp's read buffer per response: a block-sized range arrives in a few large pieces,
not sixteen 64 KiB ones, each a pass through aiohttp's Python."""
MIN_PART, MAX_PART = 5 << 20, 5 << 30  # S3's multipart limits (the last part may be smaller)


class S3Store(Store):
    """Objects under ``s3://bucket/prefix`` on any S3-compatible endpoint.

    Counters for observability: ``requests`` (HTTP requests sent, retries included),
    ``retries`` and ``bytes_read`` (payload bytes of successful reads).
    A read given a ``version`` (an ETag) sends ``If-Match`` and checks the answer's ETag:
    a replaced object fails with ``ObjectChanged`` instead of mixing bytes of two versions.
    The aiohttp session is created lazily in the running event loop; if the store is
    later used from another loop (``asyncio.run`` twice), it opens a fresh session there.
    """

    def __init__(
        self,
        url: str,
        bucket: str,
        prefix: str,
        *,
        pool_size: int = 64,
        connect_timeout: float = 5,
        read_timeout: float = 30,
        first_byte_timeout: float = 3,
        progress_timeout: float = 2,
        backoff: Backoff | None = None,
        endpoint_url: str | None = None,
        region: str | None = None,
        part_size: int = 64 << 20,
    ):
        """
        pool_size: most simultaneous connections to the endpoint (more requests queue).
        connect_timeout: seconds to open a TCP (and TLS) connection, per try.
        read_timeout: longest silence in seconds while waiting for response bytes, per try.
        first_byte_timeout: a ranged read's longest wait in seconds for its answer's first byte,
            per try (at most ``read_timeout``): a read gone silent is asked again, on another
            connection, in seconds rather than after ``read_timeout``.
        progress_timeout: a ranged read's longest silence in seconds once its answer began, per
            try (at most ``read_timeout``).
        backoff: retry policy for 5xx, SlowDown, timeouts, resets and truncated bodies.
        endpoint_url: overrides ``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL``.
        region: overrides the region from the AWS config (signing scope and default endpoint).
        part_size: ``write_stream`` part size (S3 allows 5 MiB to 5 GiB, and 10,000 parts).
        """
        if pool_size < 1 or min(connect_timeout, read_timeout, first_byte_timeout, progress_timeout) <= 0:
            raise StoreError(f"{url}: pool_size and timeouts must be positive")
        self.url = url
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.pool_size = pool_size
        self.list_page_size = 1000
        """Keys per ListObjectsV2 page (S3's maximum is 1000)."""
        if not MIN_PART <= part_size <= MAX_PART:
            raise StoreError(f"{url}: part size must be between {MIN_PART} and {MAX_PART} bytes, not {part_size}")
        self.part_size = part_size
        """``write_stream`` uploads objects larger than this in parts of this size."""
        self.backoff = backoff or Backoff()
        self.requests = 0
        self.retries = 0
        self.bytes_read = 0
        self._botocore = botocore.session.get_session()
        try:
            self.region = region or self._botocore.get_config_variable("region") or "us-east-1"
        except botocore.exceptions.BotoCoreError as err:
            raise StoreError(f"{url}: cannot read the AWS configuration: {err}") from None
        self.endpoint = resolve_endpoint(endpoint_url, self.region)
        self._host = host_header(self.endpoint)
        self._ranged_timeouts = (min(first_byte_timeout, read_timeout), min(progress_timeout, read_timeout))
        """A ranged read's deadlines: its answer's first byte, then no byte for this long."""
        self._timeout = aiohttp.ClientTimeout(
            # Not `connect`: that would also count the wait for a free pooled connection.
            total=None, sock_connect=connect_timeout, sock_read=read_timeout)
        self._credentials = None
        self._auth: S3SigV4Auth | None = None
        self._session: aiohttp.ClientSession | None = None
        self._session_loop: asyncio.AbstractEventLoop | None = None
        self._getter: Getter | None = None
        self._getter_loop: asyncio.AbstractEventLoop | None = None

    # -- plumbing ---------------------------------------------------------------------

    def _key(self, path: str) -> str:
        path = clean_path(path)  # refuses '..', absolute paths: nothing leaves the prefix
        return f"{self.prefix}/{path}" if self.prefix else path

    def _object_url(self, key: str) -> str:
        return f"s3://{self.bucket}/{key}"

    def _http(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        if self._session is None or self._session_loop is not loop:
            if self._session is not None:
                self._session.detach()  # its loop has ended; its sockets went with it
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self.pool_size, ttl_dns_cache=300),
                timeout=self._timeout,
                auto_decompress=False,  # byte ranges must arrive exactly as stored
                cookie_jar=aiohttp.DummyCookieJar(),
                read_bufsize=READ_BUFFER,
            )
            self._session_loop = loop
        return self._session

    def _ranged_reader(self) -> Getter:
        loop = asyncio.get_running_loop()
        if self._getter is None or self._getter_loop is not loop:  # a new loop: the old one's sockets went with it
            first_byte, progress = self._ranged_timeouts
            self._getter = Getter(self.endpoint, connections=self.pool_size, connect_timeout=self._timeout.sock_connect,
                                  first_byte_timeout=first_byte, progress_timeout=progress)
            self._getter_loop = loop
        return self._getter

    async def _signer(self) -> S3SigV4Auth:
        creds = self._credentials
        try:
            if creds is None:
                # The chain may read files or ask an instance-metadata service: not on the loop.
                creds = await asyncio.to_thread(self._botocore.get_credentials)
                if creds is None:
                    raise AccessDenied(
                        f"{self.url}: no AWS credentials found (set AWS_ACCESS_KEY_ID and "
                        "AWS_SECRET_ACCESS_KEY, or AWS_PROFILE)")
                self._credentials = creds
            if isinstance(creds, RefreshableCredentials) and creds.refresh_needed():
                frozen = await asyncio.to_thread(creds.get_frozen_credentials)
            else:
                frozen = creds.get_frozen_credentials()
        except botocore.exceptions.BotoCoreError as err:
            raise AccessDenied(f"{self.url}: cannot load AWS credentials: {err}") from None
        if self._auth is None or self._auth.credentials != frozen:
            self._auth = S3SigV4Auth(frozen, "s3", self.region)
        return self._auth

    @staticmethod
    def _sign(auth: S3SigV4Auth, method: str, url: str, headers: dict, body: bytes) -> dict:
        request = AWSRequest(method=method, url=url, headers=headers, data=body)
        auth.add_auth(request)
        return dict(request.headers.items())

    async def _call(
        self,
        method: str,
        key: str,
        handle: Callable[[aiohttp.ClientResponse], Awaitable[T]],
        *,
        query: dict[str, str] | None = None,
        headers: dict[str, str] | None = None,
        body: bytes = b"",
    ) -> T:
        """Send one signed request (retrying per ``self.backoff``) and return ``handle(response)``.

        ``handle`` sees only 2xx responses; everything else becomes a ``StoreError`` here.
        """
        object_url = self._object_url(key) if key else self.url
        url = self.endpoint + quote(f"/{self.bucket}/{key}" if key else f"/{self.bucket}", safe="/-_.~")
        if query:
            # Sorted and fully encoded, so what SigV4 signs is exactly what goes on the wire.
            url += "?" + "&".join(f"{quote(k, safe='-_.~')}={quote(v, safe='-_.~')}"
                                  for k, v in sorted(query.items()))
        base_headers = {"Host": self._host, "Accept-Encoding": "identity", **(headers or {})}

        async def attempt() -> T:
            auth = await self._signer()
            if len(body) > _SIGN_IN_THREAD:
                signed = await asyncio.to_thread(self._sign, auth, method, url, base_headers, body)
            else:
                signed = self._sign(auth, method, url, base_headers, body)
            self.requests += 1
            async with self._http().request(
                method, URL(url, encoded=True), headers=signed, data=body or None,
                allow_redirects=False,
            ) as resp:
                if resp.status >= 300:
                    await raise_for_status(resp, object_url, key, self.bucket)
                return await handle(resp)

        return await self._retried(object_url, attempt)

    async def _retried(self, object_url: str, attempt: Callable[[], Awaitable[T]]) -> T:
        """``attempt()``, retried per ``self.backoff``; what still fails, as the ``StoreError`` it means."""
        try:
            return await retry_async(attempt, backoff=self.backoff, retryable=retryable,
                                     on_retry=self._count_retry)
        except (Truncated, Overloaded, aiohttp.ClientError, OSError) as err:
            after = f"after {self.backoff.attempts} attempts"
            first_byte, progress = self._ranged_timeouts
            timeouts = (f"connect {self._timeout.sock_connect}s, read {self._timeout.sock_read}s, a range's first "
                        f"byte {first_byte}s, then silence {progress}s")
            raise gave_up(err, object_url, self.endpoint, timeouts, after) from None

    def _count_retry(self, err: Exception, delay: float) -> None:
        self.retries += 1
        if (tries := RETRIED.get()) is not None:
            tries.failed += 1

    async def _body(self, resp: aiohttp.ClientResponse, name: str, expected: int | None = None) -> bytes:
        data = await read_body(resp, name, expected)
        self.bytes_read += len(data)
        return data

    # -- the Store interface ----------------------------------------------------------

    async def read_range(self, path: str, offset: int, size: int, version: str | None = None) -> bytes:
        if size == 0 and offset >= 0:
            return b""
        # bytes, as the interface says (a copy): the service's reads take ``read_pieces``.
        return bytes((await self._ranged(path, offset, size, version, [size]))[0])

    async def read_pieces(self, path: str, offset: int, size: int, piece: int,
                          version: str | None = None, *, arrived: Arrived | None = None,
                          buffers: BufferPool | None = None) -> list[bytearray | memoryview]:
        sizes = [min(piece, size - at) for at in range(0, size, piece)] or [0]
        return await self._ranged(path, offset, size, version, sizes, arrived, buffers)

    async def _ranged(self, path: str, offset: int, size: int, version: str | None, sizes: list[int],
                      arrived: Arrived | None = None, buffers: BufferPool | None = None) -> list[bytearray]:
        """A ranged GET of ``size`` bytes from ``offset`` (of ``version``), its body landing in
        pieces of ``sizes`` (``getter.py``; in ``buffers`` where given), each handed to ``arrived``
        once complete."""
        if offset < 0 or size < 0:
            raise ValueError(f"read_range({path!r}, {offset}, {size}): negative offset or size")
        key = self._key(path)
        object_url = self._object_url(key)
        url = self.endpoint + quote(f"/{self.bucket}/{key}", safe="/-_.~")
        target = urlsplit(url).path
        headers = {"Host": self._host, "Accept-Encoding": "identity",
                   "Range": f"bytes={offset}-{offset + size - 1}", **_if_match(version)}

        def accept(head: Head, length: int) -> None:  # before a byte of the body is handed on
            check_range(head.status, head.headers, length, object_url, offset, size)
            check_version(head.headers, object_url, version)

        async def attempt() -> list[bytearray]:
            signed = self._sign(await self._signer(), "GET", url, headers, b"")
            self.requests += 1
            try:
                answer = await self._ranged_reader().get(target, signed, sizes, limit=max(size + 1, ERROR_BODY_LIMIT),
                                                         arrived=arrived, accept=lambda head: accept(head, size),
                                                         buffers=buffers)
            except CutShort as err:
                raise Truncated(f"{object_url}: body cut short ({err})") from None
            pieces = ranged_pieces(answer, sizes, accept, arrived, object_url, key, self.bucket)
            self.bytes_read += size
            return pieces

        return await self._retried(object_url, attempt)

    async def read(self, path: str, version: str | None = None) -> bytes:
        key = self._key(path)
        object_url = self._object_url(key)

        async def whole(resp: aiohttp.ClientResponse) -> bytes:
            check_version(resp.headers, object_url, version)
            return await self._body(resp, object_url)

        return await self._call("GET", key, whole, headers=_if_match(version))

    async def write(self, path: str, data: bytes) -> None:
        async def done(resp: aiohttp.ClientResponse) -> None:
            await resp.read()

        # One PUT: S3 makes the object visible only when complete (limit 5 GiB).
        await self._call("PUT", self._key(path), done, body=data if isinstance(data, bytes) else bytes(data))

    async def write_stream(self, path: str, chunks: AsyncIterable[bytes | memoryview]) -> int:
        """Upload ``chunks`` as one object holding at most ``part_size`` bytes in memory: one PUT
        if it fits in a part, else a multipart upload (aborted on any failure, so no partial
        object ever appears). Returns the object's size."""
        key = self._key(path)
        part = bytearray()
        upload: str | None = None
        etags: list[str] = []
        size = 0
        try:
            async for chunk in chunks:
                part += chunk
                size += len(chunk)
                while len(part) >= self.part_size:
                    if upload is None:
                        upload = await self._call("POST", key, lambda resp: upload_id(resp, self.url), query={"uploads": ""})
                    etags.append(await self._put_part(key, upload, len(etags) + 1, bytes(part[:self.part_size])))
                    del part[:self.part_size]
            if upload is None:
                await self.write(path, bytes(part))
                return size
            if part or not etags:
                etags.append(await self._put_part(key, upload, len(etags) + 1, bytes(part)))
            done = "".join(f"<Part><PartNumber>{n}</PartNumber><ETag>{etag}</ETag></Part>"
                           for n, etag in enumerate(etags, 1))
            body = f"<CompleteMultipartUpload>{done}</CompleteMultipartUpload>".encode()
            await self._call("POST", key, lambda resp: completed(resp, self.url), query={"uploadId": upload}, body=body)
            upload = None
            return size
        finally:
            if upload is not None:  # failed or cancelled: drop the parts, never leave a partial object
                try:
                    await asyncio.shield(self._call("DELETE", key, drain, query={"uploadId": upload}))
                except (StoreError, asyncio.CancelledError):
                    pass

    async def _put_part(self, key: str, upload: str, number: int, data: bytes) -> str:
        async def etag(resp: aiohttp.ClientResponse) -> str:
            await resp.read()
            if "ETag" not in resp.headers:
                raise StoreError(f"{self._object_url(key)}: UploadPart answered without an ETag")
            return resp.headers["ETag"]

        return await self._call("PUT", key, etag, query={"partNumber": str(number), "uploadId": upload}, body=data)

    async def head(self, path: str) -> ObjectInfo:
        rel = clean_path(path)
        key = self._key(rel)

        async def info(resp: aiohttp.ClientResponse) -> ObjectInfo:
            if resp.content_length is None:
                raise Truncated(f"{self._object_url(key)}: HEAD without Content-Length")
            return ObjectInfo(rel, resp.content_length,
                              resp.headers.get("ETag", "").strip('"') or None)

        try:
            return await self._call("HEAD", key, info)
        except (ObjectNotFound, StoreUnavailable):
            raise
        except StoreError as err:
            # A HEAD's error answer has no body to say why (a bad token is a bare 400): the same
            # request as a GET of one byte has one, and raises what it says.
            await self._call("GET", key, drain, headers={"Range": "bytes=0-0"})
            raise err

    async def list(self, prefix: str = "") -> list[ObjectInfo]:
        out: list[ObjectInfo] = []
        async for page in self.list_pages(prefix):
            out.extend(page)
        return sorted(out, key=lambda o: o.path)

    async def list_pages(self, prefix: str = "") -> AsyncIterator[list[ObjectInfo]]:
        root = f"{self.prefix}/" if self.prefix else ""
        query = {"list-type": "2", "prefix": root + prefix, "encoding-type": "url",
                 "max-keys": str(self.list_page_size)}
        while True:
            page = await self._call("GET", "", lambda resp: self._body(resp, self.url), query=query)
            objects, token = await asyncio.to_thread(parse_listing, page, self.url)
            yield [ObjectInfo(key[len(root):], size, etag) for key, size, etag in objects
                   if key.startswith(root) and not key.endswith("/")]
            if token is None:
                return
            query["continuation-token"] = token

    async def close(self) -> None:
        if self._getter is not None:
            self._getter.close()
            self._getter = None
        if self._session is not None:
            session, self._session = self._session, None
            if self._session_loop is asyncio.get_running_loop():
                await session.close()
            else:
                session.detach()


def _if_match(version: str | None) -> dict[str, str]:
    return {"If-Match": f'"{version}"'} if version is not None else {}


# -- the wire: one S3 answer each -------------------------------------------------------------

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
