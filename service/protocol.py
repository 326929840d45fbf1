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
"""

from __future__ import annotations

import asyncio
import json

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

HEAD_TIMEOUT = 10.0
"""Seconds a client has to send a complete request line and headers."""

MAX_HEAD = 64 * 1024
"""Most bytes of request line plus headers (a browser sends under 8 KiB)."""

_REASONS = {400: "Bad Request", 408: "Request Timeout", 431: "Request Header Fields Too Large"}


class BoundedHeadProtocol(HttpToolsProtocol):
    """``HttpToolsProtocol`` that times out slow request heads and refuses oversized ones."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._head_open = True  # a request head is being received
        self._head_bytes = 0
        self._head_timer: asyncio.TimerHandle | None = self.loop.call_later(HEAD_TIMEOUT, self._head_timed_out)

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._head_open and not self.transport.is_closing():
            # The head is still incomplete, so all of this chunk was head. (httptools hands
            # over a header only once it is complete, so counting here is the only bound.)
            self._head_bytes += len(data)
            if self._head_bytes > MAX_HEAD:
                self._reject(431, "header_too_large", f"request line and headers over {MAX_HEAD} bytes")

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._head_open = True
        self._head_bytes = 0
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(HEAD_TIMEOUT, self._head_timed_out)

    def on_headers_complete(self) -> None:
        self._head_open = False
        self._cancel_head_timer()
        super().on_headers_complete()

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
