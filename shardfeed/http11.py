"""HTTP/1.1 answers without I/O: the status line and headers, and where the body ends.

Written once for every HTTP/1.1 reader of ours: the client's batch transports
(``client/transport/sync.py``, ``client/transport/aio.py``) and the service's store reads
(``service/stores/getter.py``). The answer's head (:class:`HeadReader`, at most
``HEAD_LIMIT`` bytes), where its body ends (:func:`body_of`: ``Content-Length``, chunked
transfer encoding with extensions and trailers, or the end of the connection), and whether
the connection may carry another request.

A reader feeds each read to the parser in front of it and hands on what comes out; an empty
read is the end of the connection. A body's bytes may also be read straight into the
caller's memory (:meth:`Body.raw`, :meth:`Body.took`) while framing is fed as usual.
Malformed or cut answers raise ``OSError`` (:class:`Closed` when the server closed the
connection before the answer was complete).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

READ_SIZE = 256 * 1024
"""Bytes asked of one read: many samples a call, and the chunks the tar parser is fed."""
HEAD_LIMIT = 64 * 1024
"""Bytes of status line and headers (or of one line of chunked framing) accepted at most."""


class Closed(ConnectionError):
    """The server closed the connection before the answer was complete."""


def resendable(exc: OSError) -> bool:
    """Whether a request that failed so, on a kept connection, may go out again on a new one:
    the server closed the connection under it, before a byte of the answer."""
    return isinstance(exc, (Closed, ConnectionResetError, BrokenPipeError))


class Head(NamedTuple):
    """An answer's status line and headers (names in lower case)."""

    status: int
    headers: dict[str, str]
    keep_alive: bool  # the server lets the connection carry another request


class HeadReader:
    """Collects the bytes read until an answer's head is complete."""

    def __init__(self) -> None:
        self._data = b""

    def feed(self, data: bytes) -> tuple[Head, bytes] | None:
        """The head and the bytes read beyond it once it is complete, else ``None``."""
        if not data:
            raise (Closed if not self._data else OSError)("the server closed the connection before answering")
        self._data += data
        end = self._data.find(b"\r\n\r\n")
        if end < 0:
            if len(self._data) > HEAD_LIMIT:
                raise OSError(f"malformed response: no end of headers within {HEAD_LIMIT} bytes")
            return None
        return parse_head(self._data[:end]), self._data[end + 4:]

    def needed(self, peeked: bytes) -> int:
        """Of ``peeked`` (bytes waiting on the connection, not read yet), how many to read so
        that nothing beyond the head is: the body then goes straight where the caller wants it."""
        end = (self._data + peeked).find(b"\r\n\r\n")
        return len(peeked) if end < 0 else end + 4 - len(self._data)


def parse_head(data: bytes) -> Head:
    """The status line and headers, without the blank line that ends them."""
    lines = data.decode("latin-1").split("\r\n")
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
    return Head(int(status[:3]), headers, keep_alive)


class Body:
    """Where an answer's body ends. ``feed`` takes the bytes read after the head (``b""``:
    the connection ended) and returns the body's pieces in them; ``done`` once the body is
    complete, then ``reusable`` says whether the connection may carry another request."""

    done = False
    reusable = False

    def wanted(self) -> int:
        """Bytes to ask of the next read."""
        return READ_SIZE

    def feed(self, data: bytes) -> Sequence[bytes]:
        raise NotImplementedError

    def raw(self) -> int:
        """Body bytes that may be read now straight into the caller's memory (see :meth:`took`);
        0: framing comes first, to be read and fed as usual."""
        return 0

    def took(self, n: int) -> None:
        """``n`` of the :meth:`raw` bytes were read (0: the connection ended)."""
        raise NotImplementedError


def body_of(head: Head) -> Body:
    """The framing an answer's headers announce."""
    if "chunked" in head.headers.get("transfer-encoding", "").lower():
        return Chunked(head.keep_alive)
    if "content-length" in head.headers:
        value = head.headers["content-length"]
        try:
            length = int(value)
        except ValueError:
            length = -1
        if length < 0:
            raise OSError(f"malformed response: bad Content-Length {value!r}")
        return Sized(length, head.keep_alive)
    return UntilClosed()


class Sized(Body):
    """A body of ``Content-Length`` bytes."""

    def __init__(self, length: int, keep_alive: bool):
        self.left = length
        self.done = length == 0
        self.reusable = keep_alive

    def wanted(self) -> int:
        # Never more than the body: whatever follows it would be out of step anyway.
        return min(self.left, READ_SIZE)

    def feed(self, data: bytes) -> Sequence[bytes]:
        if not data:
            raise Closed("the server closed the connection mid-response")
        self.left -= len(data)
        if self.left > 0:
            return (data,)
        self.done = True
        if self.left < 0:  # more than the body: the connection is out of step
            self.reusable = False
            data = data[:self.left]
        return (data,) if data else ()

    def raw(self) -> int:
        return self.left

    def took(self, n: int) -> None:
        if not n:
            raise Closed("the server closed the connection mid-response")
        self.left -= n
        self.done = self.left == 0


class Chunked(Body):
    """A body in chunked transfer encoding: size lines (extensions ignored), data, trailers."""

    def __init__(self, keep_alive: bool):
        self.reusable = keep_alive
        self._left = 0  # bytes of the current chunk not read yet
        self._partial = b""  # the start of a line whose end has not arrived
        self._on_line = self._size_line  # what the next line is

    def feed(self, data: bytes) -> Sequence[bytes]:
        if not data:
            raise Closed("the server closed the connection mid-response")
        if self._partial:
            data, self._partial = self._partial + data, b""
        pieces = []
        at = 0
        while at < len(data) and not self.done:
            if self._left:
                piece = data[at:at + self._left]
                self._left -= len(piece)
                at += len(piece)
                pieces.append(piece)
                continue
            end = data.find(b"\r\n", at)
            if end < 0:
                self._partial = data[at:]
                if len(self._partial) > HEAD_LIMIT:
                    raise OSError("malformed chunked encoding: a line without an end")
                break
            self._on_line(data[at:end])
            at = end + 2
        if self.done and at < len(data):  # bytes beyond the body: the connection is out of step
            self.reusable = False
        return pieces

    def raw(self) -> int:
        return self._left

    def took(self, n: int) -> None:
        if not n:
            raise Closed("the server closed the connection mid-response")
        self._left -= n

    def _size_line(self, line: bytes) -> None:
        try:
            size = int(line.split(b";", 1)[0], 16)
        except ValueError:
            size = -1
        if size < 0:
            raise OSError(f"malformed chunked encoding: chunk size {line[:40]!r}")
        self._left = size
        self._on_line = self._chunk_end if size else self._trailer

    def _chunk_end(self, line: bytes) -> None:
        if line:
            raise OSError("malformed chunked encoding: no CRLF after a chunk")
        self._on_line = self._size_line

    def _trailer(self, line: bytes) -> None:
        self.done = not line  # trailers, up to the empty line


class UntilClosed(Body):
    """A body that ends with the connection (no ``Content-Length``, not chunked)."""

    def feed(self, data: bytes) -> Sequence[bytes]:
        self.done = not data
        return (data,) if data else ()

    def raw(self) -> int:
        return READ_SIZE

    def took(self, n: int) -> None:
        self.done = not n

