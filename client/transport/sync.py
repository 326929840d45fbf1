"""The batch transport's blocking driver, on sockets: the blocking client's hot path.

A DataLoader worker spends its CPU on one thing: ``POST /v1/batch`` and reading the tar
stream that answers it. Through httpx, a 64 x 10 KiB batch cost about 0.7 ms of CPU
before a byte of it was parsed (request objects, h11's event machinery, a copy of every
chunk on the way); written in one ``sendall`` on a kept-alive socket and read with plain
``recv`` calls, the same batch costs about 0.1 ms. This module is that, and only that:
POST with a small body, over HTTP or HTTPS. What the bytes mean (the answer's head, a body
framed by ``Content-Length``, chunked transfer encoding or the end of the connection,
keep-alive) is decided in :mod:`.base`, which the asyncio driver (:mod:`.aio`) shares.
The client's other requests (dataset descriptions, routing tables, plans) are rare and go
through httpx.

A :class:`Pool` belongs to one process (:attr:`Pool.pid`; a child after ``fork`` makes its
own) and keeps connections per base URL, at most ``max_connections`` in use at once. A
kept connection that the server closed meanwhile is noticed before reuse (it reads as
readable), or by failing before the first byte of the answer; the request then goes out
again on a new connection, once (a batch request only reads, so sending it twice is
harmless). Every failure on the wire is a :class:`ShardfeedConnectionError`, as the
httpx path raises: ``connect`` when no connection could be opened.
"""

from __future__ import annotations

import select
import socket
import threading
from collections.abc import Iterator, Mapping

from shardfeed.http11 import HEAD_LIMIT, READ_SIZE, Head, HeadReader, body_of

from ..errors import ShardfeedConnectionError
from .base import Endpoint, PoolBase, Sink, post_request, reason


class Response:
    """One answer: ``status``, ``headers`` (lower-case names), then the body.

    Read the body with :meth:`iter_bytes` or :meth:`read`, then :meth:`close`: a body read
    to its end leaves the connection to the pool for the next request.
    """

    def __init__(self, pool: Pool, endpoint: Endpoint, sock: socket.socket, base: str, head: Head, rest: bytes):
        self.status = head.status
        self.headers = head.headers
        self.base = base
        self._pool = pool
        self._endpoint = endpoint
        self._sock: socket.socket | None = sock
        self._body = body_of(head)
        self._rest = rest  # bytes received beyond the head

    def iter_bytes(self) -> Iterator[bytes]:
        """The body in pieces, as they arrive."""
        body, sock = self._body, self._sock
        try:
            pieces = body.feed(self._rest) if self._rest else ()
            while True:
                yield from pieces
                if body.done:
                    return
                pieces = body.feed(sock.recv(body.wanted()))
        except OSError as exc:
            self.close()
            raise ShardfeedConnectionError(self.base, reason(exc)) from None

    def read_into(self, sink: Sink) -> None:
        """Read the whole body into ``sink``: its bytes go from the socket straight into the
        sink's memory (``recv_into``), its framing (chunk sizes, a few bytes per chunk) by itself."""
        body, sock = self._body, self._sock
        try:
            for piece in body.feed(self._rest) if self._rest else ():
                sink.write(piece)  # none when the head was read exactly (``Pool.post(exact_head=True)``)
            while not body.done:
                raw = body.raw()
                if not raw:
                    if body.feed(sock.recv(1)):  # framing: a byte at a time, so no body byte is read with it
                        raise OSError("malformed response: body bytes in its framing")
                    continue
                view = sink.space(raw)
                n = sock.recv_into(view, min(raw, len(view)))
                body.took(n)
                sink.wrote(n)
        except OSError as exc:
            self.close()
            raise ShardfeedConnectionError(self.base, reason(exc)) from None

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
            self._pool.release(self._endpoint, sock, self._body.done and self._body.reusable)


class Sent:
    """A request sent, its answer not read yet; it holds its slot until :meth:`answer` returns (the
    answer holds it then) or :meth:`close`. A kept connection that fails before the answer's first
    byte gets the request again on a new one, as :meth:`Pool.post` does."""

    def __init__(self, pool: Pool, endpoint: Endpoint, base: str, request: bytes, head_timeout: float | None = None):
        self._pool, self._endpoint, self._base, self._request = pool, endpoint, base, request
        self._head_timeout = head_timeout
        self._tries = pool.tries(endpoint)
        self._sock: socket.socket | None = None
        self._reused = False
        self._send()

    def _send(self) -> None:
        pool = self._pool
        for kept in self._tries:
            sock = kept or pool._connect(self._endpoint, self._base)
            try:
                sock.sendall(self._request)
            except BaseException as exc:
                pool.failed(sock, exc, kept is not None, self._base)
                continue
            self._sock, self._reused = sock, kept is not None
            return

    def answer(self, exact_head: bool = False) -> Response:
        """The answer once its head arrived (``exact_head``: as :meth:`Pool.post` says)."""
        pool = self._pool
        sock, self._sock = self._sock, None  # from here the answer holds the slot, or a failure frees it
        with pool.slot_held():
            while True:
                try:
                    sock.settimeout(self._head_timeout or pool.read_timeout)
                    answer = pool._answer(self._endpoint, sock, self._base, exact_head and not self._endpoint.tls)
                    sock.settimeout(pool.read_timeout)
                    return answer
                except BaseException as exc:
                    pool.failed(sock, exc, self._reused, self._base)
                    self._send()
                    sock, self._sock = self._sock, None

    def close(self) -> None:
        """Give up on the answer: the connection is closed and the slot freed."""
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()
            self._pool._slots.release()


class Pool(PoolBase):
    """Kept-alive connections of one process, per base URL; see the module's docstring and
    :class:`~.base.PoolBase` for the arguments."""

    slots = threading.BoundedSemaphore

    def post(self, base: str, path: str, body: bytes, headers: Mapping[str, str], *,
             exact_head: bool = False) -> Response:
        """Send ``POST base+path`` with a JSON ``body``; the answer once its head arrived.
        ``exact_head``: read no byte of the body with the head (over plain HTTP: the head is
        peeked at first), so :meth:`Response.read_into` can put every one where it belongs."""
        return self.send(base, path, body, headers).answer(exact_head)

    def send(self, base: str, path: str, body: bytes, headers: Mapping[str, str], *,
             head_timeout: float | None = None) -> Sent:
        """Send ``POST base+path`` and return without waiting for its answer (:meth:`Sent.answer`):
        a batch's parts go out to their owners one after another on one thread, then are read.
        ``head_timeout``: seconds the answer's head may take, in place of ``read_timeout``."""
        endpoint = self.endpoint(base)
        request = post_request(endpoint, path, body, headers)
        if not self._slots.acquire(timeout=self.timeout):
            raise self.no_free_connection(base)
        with self.slot_held():
            return Sent(self, endpoint, base, request, head_timeout)

    def usable(self, sock: socket.socket) -> bool:
        # An idle connection has nothing to read; if it does, the server closed it (or
        # sent something unasked): it cannot carry a request.
        return not select.select([sock], [], [], 0)[0]

    def _connect(self, endpoint: Endpoint, base: str) -> socket.socket:
        try:
            sock = socket.create_connection((endpoint.host, endpoint.port), timeout=self.connect_timeout)
        except OSError as exc:
            raise ShardfeedConnectionError(base, reason(exc), connect=True) from None
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if endpoint.tls:
                sock = self.tls_context().wrap_socket(sock, server_hostname=endpoint.host)
            sock.settimeout(self.read_timeout)
        except OSError as exc:
            sock.close()
            raise ShardfeedConnectionError(base, reason(exc), connect=True) from None
        return sock

    def _answer(self, endpoint: Endpoint, sock: socket.socket, base: str, exact: bool) -> Response:
        """Read the status line and headers of the answer on ``sock`` (``exact``: and nothing more)."""
        head = HeadReader()
        while True:
            if exact:
                data = sock.recv(HEAD_LIMIT, socket.MSG_PEEK)
                data = sock.recv(head.needed(data)) if data else data
            else:
                data = sock.recv(READ_SIZE)
            if (answer := head.feed(data)) is not None:
                break
        return Response(self, endpoint, sock, base, *answer)
