"""A lean HTTP/1.1 transport for batch streams: the blocking client's hot path.

A DataLoader worker spends its CPU on one thing: ``POST /v1/batch`` and reading the tar
stream that answers it. Through httpx, a 64 x 10 KiB batch cost about 0.7 ms of CPU
before a byte of it was parsed (request objects, h11's event machinery, a copy of every
chunk on the way); written in one ``sendall`` on a kept-alive socket and read with plain
``recv`` calls, the same batch costs about 0.1 ms. This module is that, and only that:
POST with a small body, answers framed by ``Content-Length``, chunked transfer encoding or
the end of the connection, over HTTP or HTTPS. The client's other requests (dataset
descriptions, routing tables, plans) are rare and go through httpx.

A :class:`Pool` belongs to one process (:attr:`Pool.pid`; a child after ``fork`` makes its
own) and keeps connections per base URL, at most ``max_connections`` in use at once. A
kept connection that the server closed meanwhile is noticed before reuse (it reads as
readable), or by failing before the first byte of the answer; the request then goes out
again on a new connection, once (a batch request only reads, so sending it twice is
harmless). Every failure on the wire is a :class:`ShardfeedConnectionError`, as the
httpx path raises: ``connect`` when no connection could be opened.
"""

from __future__ import annotations

import os
import select
import socket
import ssl
import threading
from collections.abc import Iterator, Mapping
from typing import NamedTuple
from urllib.parse import urlsplit

from .errors import ShardfeedConnectionError

READ_SIZE = 256 * 1024
"""Bytes asked of one ``recv``: many samples a call, and the chunks the tar parser is fed."""
HEAD_LIMIT = 64 * 1024
"""Bytes of status line and headers accepted at most."""


class _Closed(ConnectionError):
    """The server closed the connection before the answer was complete."""


class Endpoint(NamedTuple):
    """Where a base URL's requests go: ``http://host:port/prefix``."""

    host: str
    port: int
    tls: bool
    netloc: str  # the Host header
    prefix: str  # the URL's path, put before every request path

    @classmethod
    def of(cls, base: str) -> Endpoint:
        parts = urlsplit(base)
        tls = parts.scheme == "https"
        return cls(parts.hostname or "", parts.port or (443 if tls else 80), tls, parts.netloc, parts.path)


class Response:
    """One answer: ``status``, ``headers`` (lower-case names), then the body.

    Read the body with :meth:`iter_bytes` or :meth:`read`, then :meth:`close`: a body read
    to its end leaves the connection to the pool for the next request.
    """

    def __init__(self, pool: Pool, endpoint: Endpoint, sock: socket.socket, base: str, status: int,
                 headers: dict[str, str], keep_alive: bool, rest: bytes):
        self.status = status
        self.headers = headers
        self.base = base
        self._pool = pool
        self._endpoint = endpoint
        self._sock: socket.socket | None = sock
        self._buffer = rest  # bytes received beyond the head, not yet handed out from ...
        self._pos = 0  # ... this offset on
        self._keep = keep_alive
        self._complete = False
        if "chunked" in headers.get("transfer-encoding", "").lower():
            self._body = self._chunked()
        elif "content-length" in headers:
            try:
                length = int(headers["content-length"])
            except ValueError:
                raise ShardfeedConnectionError(base, f"bad Content-Length {headers['content-length']!r}") from None
            self._body = self._sized(length)
        else:
            self._keep = False
            self._body = self._until_closed()

    def iter_bytes(self) -> Iterator[bytes]:
        """The body in pieces, as they arrive."""
        try:
            for data in self._body:
                if data:
                    yield data
        except OSError as exc:
            self.close()
            raise ShardfeedConnectionError(self.base, _reason(exc)) from None
        self._complete = True

    def read(self, limit: int) -> bytes:
        """Up to ``limit`` bytes of the body (an error's JSON document: never a stream)."""
        body = b""
        for data in self.iter_bytes():
            body += data
            if len(body) >= limit:
                break
        return body[:limit]

    def close(self) -> None:
        """Done with the answer: the connection goes back to the pool if the body was read whole."""
        sock, self._sock = self._sock, None
        if sock is not None:
            self._pool.release(self._endpoint, sock, self._complete and self._keep)

    def _recv(self, size: int) -> bytes:
        data = self._sock.recv(size)
        if not data:
            raise _Closed("the server closed the connection mid-response")
        return data

    def _take(self, size: int) -> bytes:
        """Up to ``size`` bytes: first from what is buffered, else from the socket."""
        if self._pos < len(self._buffer):
            data = self._buffer[self._pos:self._pos + size]
            self._pos += len(data)
            return data
        return self._recv(min(size, READ_SIZE))

    def _line(self) -> bytes:
        """The next CRLF-terminated line (chunk sizes and trailers), without the CRLF."""
        while True:
            end = self._buffer.find(b"\r\n", self._pos)
            if end >= 0:
                line, self._pos = self._buffer[self._pos:end], end + 2
                return line
            if len(self._buffer) - self._pos > HEAD_LIMIT:
                raise _Closed("malformed chunked encoding: a line without an end")
            self._buffer, self._pos = self._buffer[self._pos:] + self._recv(READ_SIZE), 0

    def _sized(self, length: int) -> Iterator[bytes]:
        if len(self._buffer) > length:
            self._keep = False  # more than the body: the connection is out of step
        while length > 0:
            data = self._take(length)
            length -= len(data)
            yield data

    def _chunked(self) -> Iterator[bytes]:
        while True:
            line = self._line()
            try:
                size = int(line.split(b";", 1)[0], 16)
            except ValueError:
                raise _Closed(f"malformed chunked encoding: chunk size {line[:40]!r}") from None
            if size == 0:
                while self._line():  # trailers, up to the empty line
                    pass
                return
            while size > 0:
                data = self._take(size)
                size -= len(data)
                yield data
            if self._line():
                raise _Closed("malformed chunked encoding: no CRLF after a chunk")

    def _until_closed(self) -> Iterator[bytes]:
        if self._pos < len(self._buffer):
            yield self._buffer[self._pos:]
            self._pos = len(self._buffer)
        while data := self._sock.recv(READ_SIZE):
            yield data


class Pool:
    """Kept-alive connections of one process, per base URL; see the module's docstring.

    Args:
        timeout: seconds any read or write on a connection may wait.
        connect_timeout: seconds to open a connection (TLS handshake included).
        max_connections: connections in use at once; a request beyond waits up to ``timeout``.
        verify: for HTTPS, check the server's certificate (True), against a CA bundle
            file (a path), or not at all (False).
    """

    def __init__(self, *, timeout: float, connect_timeout: float, max_connections: int, verify: bool | str):
        self.pid = os.getpid()
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self.max_connections = max_connections
        self.verify = verify
        self._idle: dict[Endpoint, list[socket.socket]] = {}
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(max_connections)
        self._tls: ssl.SSLContext | None = None
        self._endpoints: dict[str, Endpoint] = {}

    def post(self, base: str, path: str, body: bytes, headers: Mapping[str, str]) -> Response:
        """Send ``POST base+path`` with a JSON ``body``; the answer once its head arrived."""
        endpoint = self._endpoints.get(base) or self._endpoints.setdefault(base, Endpoint.of(base))
        head = [f"POST {endpoint.prefix}{path} HTTP/1.1", f"Host: {endpoint.netloc}",
                "Content-Type: application/json", f"Content-Length: {len(body)}"]
        head += [f"{name}: {value}" for name, value in headers.items()]
        request = ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body
        if not self._slots.acquire(timeout=self.timeout):
            raise ShardfeedConnectionError(base, f"no free connection within {self.timeout} s "
                                                 f"({self.max_connections} in use)")
        try:
            while True:
                sock, reused = self._checkout(endpoint, base)
                try:
                    sock.sendall(request)
                    return self._answer(endpoint, sock, base)
                except (_Closed, ConnectionResetError, BrokenPipeError) as exc:
                    sock.close()
                    if not reused:  # a kept connection closed by the server: send again on a new one
                        raise ShardfeedConnectionError(base, _reason(exc)) from None
                except OSError as exc:
                    sock.close()
                    raise ShardfeedConnectionError(base, _reason(exc)) from None
        except BaseException:
            self._slots.release()
            raise

    def release(self, endpoint: Endpoint, sock: socket.socket, reusable: bool) -> None:
        """A request is done with ``sock``: keep it for the next, or close it."""
        try:
            if reusable and os.getpid() == self.pid:
                with self._lock:
                    idle = self._idle.setdefault(endpoint, [])
                    if len(idle) < self.max_connections:
                        idle.append(sock)
                        return
            sock.close()
        finally:
            self._slots.release()

    def close(self) -> None:
        """Close the kept connections (connections in use close when their answers do)."""
        with self._lock:
            idle, self._idle = self._idle, {}
        for socks in idle.values():
            for sock in socks:
                sock.close()

    def _checkout(self, endpoint: Endpoint, base: str) -> tuple[socket.socket, bool]:
        """A kept connection that is still open, else a new one; and whether it was kept."""
        while True:
            with self._lock:
                idle = self._idle.get(endpoint)
                sock = idle.pop() if idle else None
            if sock is None:
                return self._connect(endpoint, base), False
            # An idle connection has nothing to read; if it does, the server closed it (or
            # sent something unasked): it cannot carry a request.
            if not select.select([sock], [], [], 0)[0]:
                return sock, True
            sock.close()

    def _connect(self, endpoint: Endpoint, base: str) -> socket.socket:
        try:
            sock = socket.create_connection((endpoint.host, endpoint.port), timeout=self.connect_timeout)
        except OSError as exc:
            raise ShardfeedConnectionError(base, _reason(exc), connect=True) from None
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if endpoint.tls:
                sock = self._tls_context().wrap_socket(sock, server_hostname=endpoint.host)
            sock.settimeout(self.timeout)
        except OSError as exc:
            sock.close()
            raise ShardfeedConnectionError(base, _reason(exc), connect=True) from None
        return sock

    def _tls_context(self) -> ssl.SSLContext:
        if self._tls is None:
            if isinstance(self.verify, str):
                self._tls = ssl.create_default_context(cafile=self.verify)
            elif self.verify:
                self._tls = ssl.create_default_context()
            else:
                self._tls = ssl._create_unverified_context()
        return self._tls

    def _answer(self, endpoint: Endpoint, sock: socket.socket, base: str) -> Response:
        """Read the status line and headers of the answer on ``sock``."""
        data = b""
        while (end := data.find(b"\r\n\r\n")) < 0:
            if len(data) > HEAD_LIMIT:
                raise OSError(f"malformed response: no end of headers within {HEAD_LIMIT} bytes")
            chunk = sock.recv(READ_SIZE)
            if not chunk:
                raise (_Closed if not data else OSError)("the server closed the connection before answering")
            data += chunk
        lines = data[:end].decode("latin-1").split("\r\n")
        version, _, status = lines[0].partition(" ")
        if not version.startswith("HTTP/1.") or not status[:3].isdigit():
            raise OSError(f"malformed response: status line {lines[0][:80]!r}")
        headers = {}
        for line in lines[1:]:
            name, colon, value = line.partition(":")
            if not colon:
                raise OSError(f"malformed response: header line {line[:80]!r}")
            headers[name.strip().lower()] = value.strip()
        keep_alive = version == "HTTP/1.1" and headers.get("connection", "").lower() != "close"
        return Response(self, endpoint, sock, base, int(status[:3]), headers, keep_alive, data[end + 4:])


def _reason(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
