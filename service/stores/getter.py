"""HTTP/1.1 GETs on kept connections whose bodies land in memory allocated once for them.

The store's ranged reads come here (``s3.py``), not through aiohttp, at about half the CPU
per MiB (docs/benchmarks.md, "Figures behind the code"): there every socket read is a new
``bytes``, fed through a parser into a stream buffer and joined again. Here a connection is an
``asyncio.BufferedProtocol``: the event loop ``recv_into``s a 2xx answer's body straight
into the pieces the caller asked for (the cache's blocks), and each piece is handed on
(``arrived``) the moment it is complete, before the rest of the answer is in (cut-through).

What the bytes mean is ``shardfeed/http11.py``'s. An answer whose body is not exactly the
pieces (an error answer, a chunked body, another ``Content-Length``) is read whole through
that framing instead, at most ``limit`` bytes, for the caller to judge.

The rules: at most ``connections`` in use at once (more requests wait their turn);
``connect_timeout`` to connect (TLS included); ``first_byte_timeout`` from the request to the
answer's first byte, then ``progress_timeout`` of silence while it is read (``TimeoutError``:
a read gone silent is given up in seconds, for the caller to ask again on another connection,
not waited out on one long budget); a request on a kept connection that the server closed
before a byte of the answer goes out again on a new one, once; a connection whose answer was
not read whole (cut, timed out, cancelled, past ``limit``) is closed, never kept. A
``Getter`` belongs to the event loop it is first used on.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Callable, Mapping
from functools import partial
from typing import NamedTuple
from urllib.parse import urlsplit

from shardfeed.buffers import BufferPool
from shardfeed.http11 import Body, Closed, Head, HeadReader, Sized, body_of, resendable
from shardfeed.service.stores.base import Arrived

HEAD_READ = 8192
"""Bytes asked of a read while the head is awaited: a head fits, and what follows it (body
bytes, copied into the pieces) stays small."""


Accept = Callable[[Head], None]
"""Checks the head of an answer whose body is to land in the pieces; raises to refuse it."""


class CannotConnect(OSError):
    """No connection to the endpoint could be opened (refused, unreachable, timed out)."""


class CutShort(Closed):
    """The server ended the connection after the answer's head, before the end of its body."""


class Answer(NamedTuple):
    head: Head
    pieces: list[bytearray] | None
    """A 2xx answer of exactly the pieces' bytes: those pieces, all complete."""
    body: bytes
    """Any other answer: its body, at most ``limit`` bytes of it."""


class _Connection(asyncio.BufferedProtocol):
    """One kept connection; one exchange (request, answer) at a time."""

    def __init__(self, first_byte_timeout: float, progress_timeout: float):
        self.first_byte_timeout = first_byte_timeout
        self.progress_timeout = progress_timeout
        self.transport: asyncio.Transport | None = None
        self.open = False
        self._loop = asyncio.get_running_loop()
        self._scratch = bytearray(HEAD_READ)
        self._answer: asyncio.Future | None = None
        self._timer: asyncio.TimerHandle | None = None

    # -- one exchange ------------------------------------------------------------------
    def exchange(self, request: bytes, sizes: list[int] | None, limit: int, arrived: Arrived | None,
                 accept: Accept | None, buffers: BufferPool | None) -> asyncio.Future:
        """Send ``request``; the future of its ``Answer``."""
        self._answer = self._loop.create_future()
        self._head = HeadReader()
        self._body: Body | None = None
        self._sizes, self._limit, self._arrived, self._accept = sizes, limit, arrived, accept
        self._new_piece = bytearray if buffers is None else buffers.take
        self._pieces: list[bytearray] | None = None
        self._collected = bytearray()
        self.answered = False  # a byte of the answer arrived
        self.reusable = False
        self._progress = self._loop.time()
        self._timer = self._loop.call_at(self._progress + self.first_byte_timeout, self._check_silence)
        self.transport.write(request)
        return self._answer

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._pieces is not None and self._index < len(self._pieces):
            return memoryview(self._pieces[self._index])[self._filled:]
        return memoryview(self._scratch)

    def buffer_updated(self, n: int) -> None:
        if self._answer is None or self._answer.done():  # bytes nobody asked for: out of step
            self.close()
            return
        self._progress = self._loop.time()
        if not self.answered:  # from here the (usually shorter) progress deadline, not the first byte's
            self.answered = True
            self._stop_timer()
            self._timer = self._loop.call_at(self._progress + self.progress_timeout, self._check_silence)
        try:
            if self._pieces is not None and self._index < len(self._pieces):
                self._body.took(n)
                self._advance(n)
            elif self._body is None:
                self._on_head_bytes(bytes(self._scratch[:n]))
            elif self._pieces is None:
                self._on_framed(bytes(self._scratch[:n]))
            else:  # bytes past the answer's pieces
                self.close()
        except Exception as err:  # noqa: BLE001 - malformed, or refused by ``accept``: the answer fails
            self._fail(err)

    def _on_head_bytes(self, data: bytes) -> None:
        found = self._head.feed(data)
        if found is None:
            return
        head, rest = found
        self._body = body_of(head)
        self._head_answer = head
        sizes = self._sizes
        if (200 <= head.status < 300 and sizes is not None and isinstance(self._body, Sized)
                and self._body.left == sum(sizes) and len(rest) <= self._body.left):
            if self._accept is not None:
                self._accept(head)
            self._pieces = [self._new_piece(size) for size in sizes]
            self._index = self._filled = 0
            self._skip_empty()
            if rest:
                self._body.took(len(rest))
                at = 0
                while at < len(rest):  # what came with the head, into the pieces
                    n = min(len(rest) - at, len(self._pieces[self._index]) - self._filled)
                    self._pieces[self._index][self._filled:self._filled + n] = rest[at:at + n]
                    at += n
                    self._advance(n)
            self._finish_if_done()
        else:
            self._on_framed(rest)

    def _advance(self, n: int) -> None:
        """``n`` more bytes are in the current piece."""
        self._filled += n
        if self._filled == len(self._pieces[self._index]):
            if self._arrived is not None:
                self._arrived(self._index, self._pieces[self._index])
            self._index += 1
            self._filled = 0
            self._skip_empty()
        self._finish_if_done()

    def _skip_empty(self) -> None:
        while self._index < len(self._pieces) and not self._pieces[self._index]:
            if self._arrived is not None:
                self._arrived(self._index, self._pieces[self._index])
            self._index += 1

    def _finish_if_done(self) -> None:
        if self._body.done and self._index == len(self._pieces):
            self._finish(Answer(self._head_answer, self._pieces, b""), self._body.reusable)

    def _on_framed(self, data: bytes, *, ended: bool = False) -> None:
        if data or ended:  # ``b""`` is the end of the connection to the framing
            for part in self._body.feed(data):
                self._collected += part
        if len(self._collected) > self._limit:
            self._finish(Answer(self._head_answer, None, bytes(self._collected[:self._limit])), False)
        elif self._body.done:
            self._finish(Answer(self._head_answer, None, bytes(self._collected)), self._body.reusable)

    def _finish(self, answer: Answer, reusable: bool) -> None:
        self._stop_timer()
        self.reusable = reusable
        if not self._answer.done():
            self._answer.set_result(answer)

    def _fail(self, err: BaseException) -> None:
        self._stop_timer()
        if self._answer is not None and not self._answer.done():
            self._answer.set_exception(err)
        self.close()

    def _check_silence(self) -> None:
        allowed = self.progress_timeout if self.answered else self.first_byte_timeout
        due = self._progress + allowed
        if self._loop.time() >= due:
            what = "no more answer bytes" if self.answered else "no answer's first byte"
            self._fail(TimeoutError(f"{what} for {allowed} s"))
        else:
            self._timer = self._loop.call_at(due, self._check_silence)

    def _stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    # -- the transport's events ----------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:
        self.transport = transport
        self.open = True

    def eof_received(self) -> bool:
        self._ended()
        return False  # close the transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.open = False
        self._ended(exc)

    def _ended(self, exc: Exception | None = None) -> None:
        """The server ended the connection: the end of a body that runs to it, else a failure."""
        self.open = False
        if self._answer is None or self._answer.done():
            return
        try:
            if self._body is None:
                self._head.feed(b"")  # raises: Closed before the first byte, else a cut head
            elif self._pieces is None:
                self._on_framed(b"", ended=True)
                if self._answer.done():
                    return
            raise CutShort(f"the server closed the connection mid-body ({self._body_read()} bytes read)")
        except OSError as err:
            if exc is not None and not isinstance(err, Closed):
                err.__cause__ = exc
            self._fail(err)

    def _body_read(self) -> int:
        if self._pieces is None:
            return len(self._collected)
        return sum(map(len, self._pieces[:self._index])) + self._filled

    def close(self) -> None:
        self.open = False
        if self.transport is not None:
            self.transport.abort()


class Getter:
    """Kept connections to one HTTP(S) endpoint, and GETs over them (see the module's rules)."""

    def __init__(self, endpoint: str, *, connections: int, connect_timeout: float, first_byte_timeout: float,
                 progress_timeout: float):
        parts = urlsplit(endpoint)
        self.tls = parts.scheme == "https"
        self.host = parts.hostname or ""
        self.port = parts.port or (443 if self.tls else 80)
        self.endpoint = endpoint
        self.connect_timeout = connect_timeout
        self.first_byte_timeout = first_byte_timeout
        self.progress_timeout = progress_timeout
        self._slots = asyncio.Semaphore(connections)
        self._idle: list[_Connection] = []
        self._ssl = ssl.create_default_context() if self.tls else None

    async def get(self, target: str, headers: Mapping[str, str], sizes: list[int] | None = None, *,
                  limit: int, arrived: Arrived | None = None, accept: Accept | None = None,
                  buffers: BufferPool | None = None) -> Answer:
        """``GET target`` (path and query) with ``headers`` (Host among them). A 2xx body of
        exactly ``sum(sizes)`` bytes lands in pieces of ``sizes``, each handed to ``arrived``
        once complete (each a ``buffers`` buffer where given), after ``accept(head)`` let it
        (what ``accept`` raises, ``get`` raises);
        any other body is read whole, up to ``limit`` bytes. Raises ``OSError``
        (``CannotConnect``, ``Closed``, ``TimeoutError``, ``CutShort``, a malformed answer)."""
        request = (f"GET {target} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers.items())
                   + "\r\n").encode("latin-1")
        async with self._slots:
            while True:
                conn = self._kept()
                reused = conn is not None
                if conn is None:
                    conn = await self._connect()
                try:
                    answer = await conn.exchange(request, sizes, limit, arrived, accept, buffers)
                except OSError as err:
                    conn.close()
                    if reused and not conn.answered and resendable(err):
                        continue  # the server had closed the kept connection: once more, on a new one
                    raise
                except BaseException:  # refused or cancelled: the answer's rest would put the connection out of step
                    conn.close()
                    raise
                if conn.reusable and conn.open:
                    self._idle.append(conn)
                else:
                    conn.close()
                return answer

    def _kept(self) -> _Connection | None:
        while self._idle:
            conn = self._idle.pop()
            if conn.open:
                return conn
        return None

    async def _connect(self) -> _Connection:
        loop = asyncio.get_running_loop()
        made = partial(_Connection, self.first_byte_timeout, self.progress_timeout)
        try:
            _, conn = await asyncio.wait_for(loop.create_connection(made, self.host, self.port, ssl=self._ssl),
                                             self.connect_timeout)
        except (OSError, asyncio.TimeoutError) as err:
            why = (f"timed out after {self.connect_timeout} s" if isinstance(err, asyncio.TimeoutError)
                   else err.strerror or str(err))
            raise CannotConnect(f"cannot connect to {self.endpoint} ({why})") from None
        return conn

    def close(self) -> None:
        idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()
