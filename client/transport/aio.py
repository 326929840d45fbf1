"""The batch transport's asyncio driver, on streams: the AsyncClient's hot path.

Through httpx an asyncio batch cost several times the CPU of the blocking client's; this
sends ``POST /v1/batch`` in one write on a kept-alive ``asyncio.open_connection`` stream
and hands on the answer's body as it is read. What the bytes mean is decided in
:mod:`.base`, shared with the blocking driver (:mod:`.sync`); the rules are the same as there: at most
``max_connections`` in use at once (a request beyond waits up to ``timeout``), ``timeout``
(or the shorter ``progress_timeout``) on every read and write, ``connect_timeout`` to connect,
a kept connection the server closed (or sent something unasked on) is dropped before reuse, a request the server
closed a kept connection under goes out again on a new one, once, and every failure is a
:class:`ShardfeedConnectionError` (``connect`` when no connection could be opened).

An :class:`AsyncPool` belongs to one process and event loop (the AsyncClient makes one
per loop, as its httpx session). An answer not read to its end (the caller stopped, or
its task was cancelled mid-stream) closes its connection: only a connection whose answer
was read whole goes back to the pool.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Awaitable, Mapping
from typing import TypeVar

from shardfeed.http11 import READ_SIZE, Head, HeadReader, body_of

from ..errors import ShardfeedConnectionError
from .base import Endpoint, PoolBase, Sink, post_request, reason

T = TypeVar("T")


class Connection:
    """One stream whose reads and writes give up after ``timeout`` seconds without progress.

    One timer per connection rather than one per read: it checks, when due, whether the
    read or write then waiting began ``timeout`` ago, and aborts the connection if so.
    """

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, timeout: float):
        self.reader = reader
        self.writer = writer
        self.timeout = timeout
        self._loop = asyncio.get_running_loop()
        self._since: float | None = None  # loop time the read or write now waiting began
        self._timer: asyncio.TimerHandle | None = None
        self._timed_out = False

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        await self._bounded(self.writer.drain())

    async def read(self, size: int) -> bytes:
        """Up to ``size`` bytes; ``b""`` at the end of the connection."""
        return await self._bounded(self.reader.read(size))

    def idle(self) -> bool:
        """Whether the connection is open with nothing to read, as a kept one must be.

        The stream reads eagerly, so what the server sent (or its close) sits in the
        reader; it has no public way to tell buffered bytes, hence ``_buffer``.
        """
        return not (self.reader.at_eof() or self.writer.is_closing() or self.reader._buffer)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self.writer.close()

    async def _bounded(self, waiting: Awaitable[T]) -> T:
        self._since = self._loop.time()
        if self._timer is None:
            self._timer = self._loop.call_at(self._since + self.timeout, self._check)
        try:
            result = await waiting
        except ConnectionError:
            if not self._timed_out:
                raise
        finally:
            self._since = None
        if self._timed_out:  # the abort ended the wait with the end of the stream, or a reset
            raise TimeoutError("timed out")
        return result

    def _check(self) -> None:
        self._timer = None
        if self._since is None:
            return  # nothing waiting: the next wait arms the timer again
        due = self._since + self.timeout
        if self._loop.time() >= due:
            self._timed_out = True
            self.writer.transport.abort()
        else:
            self._timer = self._loop.call_at(due, self._check)


class AsyncResponse:
    """One answer: ``status``, ``headers`` (lower-case names), then the body.

    Read the body with :meth:`aiter_bytes` or :meth:`read`, then :meth:`close`: a body read
    to its end leaves the connection to the pool for the next request.
    """

    def __init__(self, pool: AsyncPool, endpoint: Endpoint, conn: Connection, base: str, head: Head, rest: bytes):
        self.status = head.status
        self.headers = head.headers
        self.base = base
        self._pool = pool
        self._endpoint = endpoint
        self._conn: Connection | None = conn
        self._body = body_of(head)
        self._rest = rest  # bytes received beyond the head

    async def aiter_bytes(self) -> AsyncIterator[bytes]:
        """The body in pieces, as they arrive."""
        body, conn = self._body, self._conn
        try:
            pieces = body.feed(self._rest) if self._rest else ()
            while True:
                for piece in pieces:
                    yield piece
                if body.done:
                    return
                pieces = body.feed(await conn.read(body.wanted()))
        except OSError as exc:
            self.close()
            raise ShardfeedConnectionError(self.base, reason(exc)) from None

    async def read_into(self, sink: Sink) -> None:
        """Read the whole body into ``sink`` (a tensor batch's buffer): each piece is copied
        there once as it arrives, asyncio's streams reading into a buffer of their own."""
        async for piece in self.aiter_bytes():
            sink.write(piece)

    async def read(self, limit: int) -> bytes:
        """Up to ``limit`` bytes of the body (an error's JSON document: never a stream)."""
        body = b""
        async for data in self.aiter_bytes():
            body += data
            if len(body) >= limit:
                break
        return body[:limit]

    def close(self) -> None:
        """Done with the answer: the connection goes back to the pool if the body was read whole.

        Not a coroutine, so that a cancelled task's cleanup cannot be cut short."""
        conn, self._conn = self._conn, None
        if conn is not None:
            self._pool.release(self._endpoint, conn, self._body.done and self._body.reusable)


class AsyncPool(PoolBase):
    """Kept-alive connections of one process and event loop, per base URL; see the module's
    docstring and :class:`~.base.PoolBase` for the arguments."""

    slots = asyncio.BoundedSemaphore

    async def post(self, base: str, path: str, body: bytes, headers: Mapping[str, str], *,
                   head_timeout: float | None = None) -> AsyncResponse:
        """Send ``POST base+path`` with a JSON ``body``; the answer once its head arrived
        (``head_timeout``: seconds that may take, in place of ``read_timeout``)."""
        endpoint = self.endpoint(base)
        request = post_request(endpoint, path, body, headers)
        await self._take_slot(base)
        with self.slot_held():
            for kept in self.tries(endpoint):
                conn = kept or await self._connect(endpoint, base)
                try:
                    await conn.send(request)
                    conn.timeout = head_timeout or self.read_timeout
                    answer = await self._answer(endpoint, conn, base)
                    conn.timeout = self.read_timeout
                    return answer
                except BaseException as exc:
                    self.failed(conn, exc, kept is not None, base)

    def usable(self, conn: Connection) -> bool:
        return conn.idle()

    async def _take_slot(self, base: str) -> None:
        if not self._slots.locked():
            await self._slots.acquire()  # free: taken without waiting
            return
        try:
            await asyncio.wait_for(self._slots.acquire(), self.timeout)
        except asyncio.TimeoutError:
            raise self.no_free_connection(base) from None

    async def _connect(self, endpoint: Endpoint, base: str) -> Connection:
        tls = self.tls_context() if endpoint.tls else None
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(endpoint.host, endpoint.port, ssl=tls, limit=READ_SIZE,
                                        server_hostname=endpoint.host if tls else None),
                self.connect_timeout)
        except (OSError, asyncio.TimeoutError) as exc:
            raise ShardfeedConnectionError(base, reason(exc), connect=True) from None
        writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return Connection(reader, writer, self.read_timeout)

    async def _answer(self, endpoint: Endpoint, conn: Connection, base: str) -> AsyncResponse:
        """Read the status line and headers of the answer on ``conn``."""
        head = HeadReader()
        while (answer := head.feed(await conn.read(READ_SIZE))) is None:
            pass
        return AsyncResponse(self, endpoint, conn, base, *answer)
