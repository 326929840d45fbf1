"""uvicorn's HTTP/1.1 protocol (httptools) with bounded request heads.

uvicorn bounds neither how long a client may take to send a request line and headers
nor, with httptools, how large they may be (its h11 size limit does not apply). A client
that trickles header bytes ("slowloris") would hold a connection forever, and one that
sends an endless header would grow the service's memory without bound. This protocol
answers such requests with a JSON error and closes the connection:

- 408 ``request_timeout`` when a request head is not complete ``HEAD_TIMEOUT`` seconds
  after its first byte (or after the connection opened);
- 431 ``header_too_large`` when the request line and headers exceed ``MAX_HEAD`` bytes;
- 400 ``bad_http_request`` (JSON instead of uvicorn's plain text) for unparsable HTTP.

Request bodies are not affected: their size and pace are the API's business.

It also sends what a batch framed from RAM is made of without copying it:

- the ASGI extension ``PARTS``: a response body message may carry a list of buffers (the
  shards' own byte ranges, as ``memoryview`` slices of blocks in RAM) that go to the socket
  in one gathered write (``writelines``: ``writev`` under uvloop), instead of being joined
  into one new ``bytes`` first (a copy of every sample); in a chunked body (no
  Content-Length: a batch read from disk or the store) the parts are one chunk, framed
  around them;
- a connection buffers up to ``WRITE_BUFFER`` bytes of response before the sender waits:
  with asyncio's default 64 KiB mark every large member would wait for the socket to
  drain before the next is queued.

And it answers the hottest requests without the ASGI app when it can (``instant``): a
route's instant answerer gets the request's scope and whole body, and returns the 200's
headers and body parts, or None to let the app answer it as any request. A request whose
body arrives with its head (one read, the usual small JSON body) is offered to it; the
app's task then starts only if it declines. A warm batch of RAM-held blocks answered that way
skips the ASGI layers (a task, the request and response objects, the body's receive, the
messages): the fixed cost of a request, which decides what a replica serving a third of each
batch gets done per CPU-second. The batch route is the one such answerer
(``api/batch.py``'s ``BatchEndpoint.instant``).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable

from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

log = logging.getLogger("shardfeed.protocol")

HEAD_TIMEOUT = 10.0
"""Seconds a client has to send a complete request line and headers."""

MAX_HEAD = 64 * 1024
"""Most bytes of request line plus headers (a browser sends under 8 KiB)."""

WRITE_BUFFER = 4 * 1024 * 1024
"""Most response bytes queued on one connection before the sender waits for the socket."""

PARTS = "shardfeed.parts"
"""The ASGI extension (in ``scope["extensions"]``) by which an ``http.response.body`` message
may carry ``parts``, a list of buffers, in place of ``body``. Only where the scope lists it:
another server would ignore the key and send nothing.

An ``http.response.start`` message may also say ``"parts": True`` (its body follows at once,
as parts): its status line and headers are then held and go out in the first parts' gathered
write. On loopback each write runs the receiver's side of TCP too, so a second write of a
few hundred bytes costs a small warm batch a tenth of its CPU."""

InstantAnswerer = Callable[[dict, bytes], "tuple[list[tuple[bytes, bytes]], list] | None"]
"""``(scope, body) -> (headers, parts) | None``: a route's 200 answered by the protocol itself
(headers without the server's defaults; parts as for ``PARTS``), or None (the app answers).
It must have no effect before it decides to answer: a declined request is answered again
by the app."""

INSTANT_BYTES = WRITE_BUFFER
"""Most body bytes of an instant answer: it is written at once, without waiting for the
socket, so the connection's buffer stays within about ``WRITE_BUFFER``."""

_REASONS = {400: "Bad Request", 408: "Request Timeout", 431: "Request Header Fields Too Large"}


class BoundedHeadProtocol(HttpToolsProtocol):
    """``HttpToolsProtocol`` that times out slow request heads and refuses oversized ones, and
    answers the routes of ``instant`` (``{(method, path): InstantAnswerer}``) without the app
    when it can. uvicorn takes it as ``http=partial(BoundedHeadProtocol, instant=...)``."""

    def __init__(self, *args, instant: dict[tuple[str, str], InstantAnswerer] | None = None,
                 on_request: Callable[[str], None] | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.instant = instant or {}
        self.on_request = on_request  # told each request's path as its head ends (``observe/activity.py``)
        self._in_head = False  # uvicorn is starting the app of a request whose head just ended
        self._waiting = None  # (cycle, app, answerer): a request held until its body is here

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        transport.set_write_buffer_limits(high=WRITE_BUFFER)
        self._head_open = True  # a request head is being received
        self._head_bytes = 0
        self._head_timer: asyncio.TimerHandle | None = self.loop.call_later(HEAD_TIMEOUT, self._head_timed_out)

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        self._waiting = None
        super().connection_lost(exc)

    def _start_asgi_task(self, cycle, app) -> None:  # uvicorn starts every request's app here
        if self.on_request is not None:
            self.on_request(cycle.scope["path"])
        answerer = self.instant.get((cycle.scope["method"], cycle.scope["path"])) if self._in_head else None
        if answerer is not None and app is self.app and not cycle.waiting_for_100_continue:
            self._waiting = (cycle, app, answerer)  # until on_message_complete, in this read
            return
        super()._start_asgi_task(cycle, _GatheredWrites(app, cycle))

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._waiting is not None:  # its body did not come whole with its head: the app reads it
            cycle, app, _ = self._waiting
            self._waiting = None
            super()._start_asgi_task(cycle, _GatheredWrites(app, cycle))
        if self._head_open and not self.transport.is_closing():
            # The head is still incomplete, so all of this chunk was head. (httptools hands
            # over a header only once it is complete, so counting here is the only bound.)
            self._head_bytes += len(data)
            if self._head_bytes > MAX_HEAD:
                self._reject(431, "header_too_large", f"request line and headers over {MAX_HEAD} bytes")
            elif self._head_timer is None:  # armed only for a head that did not come whole in one read
                self._head_timer = self.loop.call_later(HEAD_TIMEOUT, self._head_timed_out)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._head_open = True
        self._head_bytes = 0

    def on_headers_complete(self) -> None:
        self._head_open = False
        self._cancel_head_timer()
        self._in_head = True
        try:
            super().on_headers_complete()
        finally:
            self._in_head = False

    def on_message_complete(self) -> None:
        super().on_message_complete()
        if self._waiting is not None:
            cycle, app, answerer = self._waiting
            self._waiting = None
            if not self._answer_at_once(cycle, answerer):
                super()._start_asgi_task(cycle, _GatheredWrites(app, cycle))

    def _answer_at_once(self, cycle, answerer: InstantAnswerer) -> bool:
        """Write ``answerer``'s 200 for ``cycle``'s request and complete it as uvicorn would;
        False (nothing written) where it declines or the connection cannot take it now."""
        if cycle.disconnected or self.flow.write_paused or self.transport.is_closing():
            return False
        try:
            answer = answerer(cycle.scope, bytes(cycle.body))
        except Exception:  # the app answers it, and reports its own failure the usual way
            log.exception("instant answer to %s %s failed", cycle.scope["method"], cycle.scope["path"])
            return False
        if answer is None:
            return False
        headers, parts = answer
        head = [STATUS_LINE[200]]
        for name, value in (*cycle.default_headers, *headers):
            head += (name, b": ", value, b"\r\n")
        if not cycle.keep_alive:
            head.append(b"connection: close\r\n")
        head.append(b"\r\n")
        cycle.body = bytearray()
        cycle.response_started = cycle.response_complete = True
        self.transport.writelines([b"".join(head), *parts])
        if not cycle.keep_alive:
            self.transport.close()
        cycle.on_response()
        return True

    def send_400_response(self, msg: str) -> None:
        self._reject(400, "bad_http_request", msg)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if not self.transport.is_closing():
            self._reject(408, "request_timeout", f"request head not complete within {HEAD_TIMEOUT:g} s")

    def _reject(self, status: int, code: str, message: str) -> None:
        self._cancel_head_timer()
        body = json.dumps({"error": {"code": code, "message": message}}).encode()
        self.transport.write(b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
                             b"connection: close\r\n\r\n%s" % (status, _REASONS[status].encode(), len(body), body))
        self.transport.close()


class _HeldHead:
    """Stands in for a connection's transport while uvicorn writes a response head: keeps it."""

    __slots__ = ("data",)

    def __init__(self):
        self.data = b""

    def write(self, data: bytes) -> None:
        self.data += data


class _GatheredWrites:
    """The app of one request, offered ``PARTS``: a body message's ``parts`` are written as they
    are (the request's ``RequestResponseCycle`` keeps its Content-Length accounting), after the
    head of a start message that asked for it to be held."""

    __slots__ = ("app", "cycle")

    def __init__(self, app, cycle):
        self.app = app
        self.cycle = cycle

    async def __call__(self, scope, receive, send) -> None:
        scope.setdefault("extensions", {})[PARTS] = {}
        cycle = self.cycle
        head = b""  # a held status line and headers, not yet written

        async def send_parts(message) -> None:
            nonlocal head
            kind = message["type"]
            if kind == "http.response.start" and message.get("parts") is True:
                # uvicorn builds and checks the head (and its Content-Length accounting) as
                # always, but into ``held`` instead of the socket.
                transport, cycle.transport = cycle.transport, _HeldHead()
                try:
                    await send(message)
                finally:
                    held, cycle.transport = cycle.transport, transport
                head = held.data
                return
            parts = message.get("parts")
            if parts is None or kind != "http.response.body":
                return await send_after_head(message)
            more = message.get("more_body", False)
            size = sum(map(len, parts))
            chunked = cycle.chunked_encoding is True
            if (cycle.chunked_encoding is None or cycle.response_complete or scope["method"] == "HEAD"
                    or (not chunked and size > cycle.expected_content_length)):  # uvicorn's way
                return await send_after_head({"type": "http.response.body", "body": b"".join(parts),
                                              "more_body": more})
            if cycle.flow.write_paused and not cycle.disconnected:
                await cycle.flow.drain()
            if cycle.disconnected:
                return
            if chunked:  # a chunk's framing around the parts (uvicorn would join them into it)
                parts = [b"%x\r\n" % size, *parts, b"\r\n"] if size else []
            else:
                cycle.expected_content_length -= size
            cycle.transport.writelines([head, *parts] if head else parts)
            head = b""
            if not more:  # uvicorn ends the body (a chunked one with its last chunk) and the cycle
                await send({"type": "http.response.body", "body": b"", "more_body": False})

        async def send_after_head(message) -> None:
            nonlocal head
            if head:
                if not cycle.disconnected:
                    cycle.transport.write(head)
                head = b""
            await send(message)

        await self.app(scope, receive, send_parts)
