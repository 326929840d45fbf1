"""HTTP/1.1 for the batch transport, without I/O: what both drivers share.

The blocking driver (:mod:`.sync`) and the asyncio one (:mod:`.aio`) only move bytes;
what the answer's bytes mean is ``shardfeed/http11.py``'s (shared with the service's store
reads). Here: the request, whether a failed request may go out again, and the bookkeeping
of kept connections (:class:`PoolBase`). Malformed or cut answers raise ``OSError``, which
the drivers turn into :class:`~shardfeed.client.errors.ShardfeedConnectionError`.
"""

from __future__ import annotations

import os
import ssl
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, NamedTuple, Protocol
from urllib.parse import urlsplit

from shardfeed.http11 import resendable

from ..errors import ShardfeedConnectionError


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


class Sink(Protocol):
    """Memory a body is read into (:meth:`Response.read_into`)."""

    def space(self, wanted: int) -> memoryview:
        """Free memory to read up to ``wanted`` bytes into (at least one byte: grow if full)."""

    def wrote(self, n: int) -> None:
        """``n`` bytes were read into the start of the last :meth:`space`."""

    def write(self, data: bytes) -> None:
        """Copy ``data`` in (body bytes that came with the head)."""


def post_request(endpoint: Endpoint, path: str, body: bytes, headers: Mapping[str, str]) -> bytes:
    """``POST prefix+path`` with a JSON ``body``, as one buffer to send."""
    head = [f"POST {endpoint.prefix}{path} HTTP/1.1", f"Host: {endpoint.netloc}",
            "Content-Type: application/json", f"Content-Length: {len(body)}"]
    head += [f"{name}: {value}" for name, value in headers.items()]
    return ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body


def reason(exc: BaseException) -> str:
    """An exception as the reason of a ShardfeedConnectionError."""
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


class PoolBase:
    """Kept connections of one process, per base URL, and their settings; a driver adds the
    I/O (see the drivers' modules). A connection is anything with ``close()``; ``slots``,
    the driver's bounded semaphore, counts the connections in use.

    Args:
        timeout: seconds any read or write on a connection may wait.
        connect_timeout: seconds to open a connection (TLS handshake included).
        progress_timeout: seconds an answer may go without a byte (its head awaited
            included), at most ``timeout``: a batch stuck behind a lost read or a dead
            connection fails in seconds, to be asked again (``PartRequest.wait``).
        max_connections: connections in use at once; a request beyond waits up to ``timeout``.
        verify: for HTTPS, check the server's certificate (True), against a CA bundle
            file (a path), or not at all (False).
    """

    slots: Callable[[int], Any]

    def __init__(self, *, timeout: float, connect_timeout: float, max_connections: int, verify: bool | str,
                 progress_timeout: float | None = None):
        self.pid = os.getpid()
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self.read_timeout = min(timeout, progress_timeout or timeout)
        """Seconds a read or write on a connection waits: ``timeout``, or less (``progress_timeout``)."""
        self.max_connections = max_connections
        self.verify = verify
        self._idle: dict[Endpoint, list[Any]] = {}
        self._lock = threading.Lock()
        self._tls: ssl.SSLContext | None = None
        self._endpoints: dict[str, Endpoint] = {}
        self._slots = self.slots(max_connections)

    def endpoint(self, base: str) -> Endpoint:
        return self._endpoints.get(base) or self._endpoints.setdefault(base, Endpoint.of(base))

    def no_free_connection(self, base: str) -> ShardfeedConnectionError:
        return ShardfeedConnectionError(base, f"no free connection within {self.timeout} s "
                                              f"({self.max_connections} in use)")

    def kept(self, endpoint: Endpoint) -> Any | None:
        """A kept connection to ``endpoint`` that can carry a request, if there is one."""
        while True:
            with self._lock:
                idle = self._idle.get(endpoint)
                conn = idle.pop() if idle else None
            if conn is None or self.usable(conn):
                return conn
            conn.close()

    def tries(self, endpoint: Endpoint) -> Iterator[Any | None]:
        """The connections a request goes out on in turn: each kept one that looks usable,
        then ``None``, a new one for the driver to open (a failure there is final: see
        :meth:`failed`)."""
        while (conn := self.kept(endpoint)) is not None:
            yield conn
        yield None

    @contextmanager
    def slot_held(self) -> Iterator[None]:
        """Around a request that took a slot: the slot is given back if it fails before its
        answer (an answer gives it back when closed, :meth:`release`)."""
        try:
            yield
        except BaseException:
            self._slots.release()
            raise

    def usable(self, conn: Any) -> bool:
        """Whether a kept connection is still open, with nothing waiting to be read."""
        raise NotImplementedError

    def failed(self, conn: Any, exc: BaseException, reused: bool, base: str) -> None:
        """Sending a request on ``conn`` or reading its answer's head failed: close it, and
        raise unless the request may go out again on a new connection (see ``resendable``)."""
        conn.close()
        if not isinstance(exc, OSError):
            raise exc  # interrupted, or cancelled
        if not (reused and resendable(exc)):
            raise ShardfeedConnectionError(base, reason(exc)) from None

    def release(self, endpoint: Endpoint, conn: Any, reusable: bool) -> None:
        """A request is done with ``conn``: keep it for the next, or close it; its slot is free."""
        try:
            if reusable and os.getpid() == self.pid:
                with self._lock:
                    idle = self._idle.setdefault(endpoint, [])
                    if len(idle) < self.max_connections:
                        idle.append(conn)
                        return
            conn.close()
        finally:
            self._slots.release()

    def close(self) -> None:
        """Close the kept connections (connections in use close when their answers do)."""
        with self._lock:
            idle, self._idle = self._idle, {}
        for conns in idle.values():
            for conn in conns:
                conn.close()

    def tls_context(self) -> ssl.SSLContext:
        if self._tls is None:
            if isinstance(self.verify, str):
                self._tls = ssl.create_default_context(cafile=self.verify)
            elif self.verify:
                self._tls = ssl.create_default_context()
            else:
                self._tls = ssl._create_unverified_context()
        return self._tls
