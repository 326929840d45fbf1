"""Turn a streamed tar response into samples as the bytes arrive.

Two small push parsers, shared by the blocking and the asyncio client:

- :class:`TarStream` takes network chunks of any size and returns the members they
  complete, as ``(name, payload)`` pairs. It keeps one growing buffer and slices
  payloads out of it, so a member costs one header parse and one copy of its bytes.
- :class:`BatchReader` groups members into the samples of one request. The service
  sends ``<key>.<field>`` members in exactly the order of the requested indices, so a
  new sample starts when the key changes, when a field repeats (the same index asked
  twice in a row), or at a ``__404__/<dataset>/<i>`` entry (a sample that could not be
  served, sent when ``continue_on_error`` is set).

A sample is a dict ``{"__key__": key, "__index__": i, "<field>": bytes, ...}``. A sample
the service could not serve is ``{"__key__": None, "__index__": i, "__missing__": True}``
with no fields, so a batch always has one entry per requested index, in order.
"""

from __future__ import annotations

from collections.abc import Sequence

from shardfeed.tar import BLOCK, TarFormatError, padding, parse_header, parse_pax

from .errors import ShardfeedConnectionError, ShardfeedError

MISSING = "__missing__"
"""Key set to ``True`` in the placeholder of a sample the service could not serve."""

_NOT_FOUND = "__404__/"
_COMPACT_AT = 1 << 20  # drop consumed bytes from the buffer once this many have piled up


class TarStream:
    """Incremental tar parser: ``feed(chunk)`` returns the members that chunk completed."""

    def __init__(self) -> None:
        self._buf = bytearray()
        self._pos = 0  # where the next header starts in _buf
        self._long_name: bytes | None = None
        self.ended = False
        """True once the end-of-archive marker (a zero block) has been read."""

    def feed(self, chunk: bytes) -> list[tuple[str, bytes]]:
        """Add ``chunk``; return the ``(name, payload)`` of each member it completed."""
        if self.ended:
            return []
        buf = self._buf
        buf += chunk
        out = []
        pos, end = self._pos, len(buf)
        view = memoryview(buf)
        try:
            while pos + BLOCK <= end:
                header = bytes(view[pos:pos + BLOCK])  # copies: no slice may outlive the view
                if not any(header):
                    self.ended = True
                    break
                name, size, typeflag = parse_header(header)
                start = pos + BLOCK
                if start + size > end:
                    break  # wait for the rest of this member
                payload = bytes(view[start:start + size])
                pos = start + size + padding(size)
                if typeflag == b"x":
                    self._long_name = parse_pax(payload).get(b"path", self._long_name)
                elif typeflag == b"L":
                    self._long_name = payload.rstrip(b"\0")
                elif typeflag in (b"0", b"\0"):
                    out.append(((self._long_name or name).decode(), payload))
                    self._long_name = None
                else:
                    self._long_name = None
        finally:
            view.release()  # a live view would forbid resizing the bytearray
        # pos may lie beyond the buffer while the last member's padding is still in flight;
        # it then counts the padding bytes to skip in the next chunk.
        if pos >= end:
            buf.clear()
            pos -= end
        elif pos >= _COMPACT_AT:
            del buf[:pos]
            pos = 0
        self._pos = pos
        return out


def split_name(name: str) -> tuple[str, str]:
    """``(key, field)`` of a member name: the key runs up to the first dot of the file name."""
    slash = name.rfind("/") + 1
    dot = name.find(".", slash)
    if dot < 0:
        return name, ""
    return name[:dot], name[dot + 1:]


class BatchReader:
    """Groups the members of one response into the samples of ``indices``, in order.

    ``feed(chunk)`` returns the samples completed so far; ``finish()`` returns the last
    one and checks that every requested sample arrived. ``delivered`` counts samples
    returned, so a caller can ask again for ``indices[delivered:]`` after a broken stream.
    """

    def __init__(self, dataset: str, indices: Sequence[int], fields: Sequence[str] | None = None,
                 url: str = ""):
        self.dataset = dataset
        self.indices = indices
        self.url = url
        self.delivered = 0
        # With the fields named, a sample is complete at its last field: hand it out at once.
        self._size = len(fields) + 2 if fields else 0
        self._tar = TarStream()
        self._current: dict | None = None

    def restart(self, url: str) -> None:
        """Start reading a fresh response for the samples not yet delivered."""
        self.url = url
        self._tar = TarStream()
        self._current = None

    def remaining(self) -> Sequence[int]:
        """Indices of the samples not yet delivered."""
        return self.indices[self.delivered:]

    def feed(self, chunk: bytes) -> list[dict]:
        """Parse ``chunk``; return the samples it completed."""
        try:
            members = self._tar.feed(chunk)
        except TarFormatError as exc:
            raise ShardfeedError(f"malformed batch response from {self.url}: {exc}") from None
        out: list[dict] = []
        for name, payload in members:
            self._add(name, payload, out)
        return out

    def finish(self) -> list[dict]:
        """Return the last sample of the response; raise if some never arrived.

        A response cut short (no end-of-archive marker, or fewer samples than asked)
        raises :class:`ShardfeedConnectionError`: the connection broke, and asking again
        for :meth:`remaining` is safe. The last sample counts only once the end marker
        arrived, since until then more of its fields may have been on the way.
        """
        out: list[dict] = []
        if self._tar.ended and self._current is not None:
            self._deliver(self._current, out)
            self._current = None
        if self.delivered < len(self.indices):
            raise ShardfeedConnectionError(
                self.url, f"response ended after {self.delivered} of {len(self.indices)} samples")
        return out

    def _add(self, name: str, payload: bytes, out: list[dict]) -> None:
        current = self._current
        if name.startswith(_NOT_FOUND):
            if current is not None:
                self._deliver(current, out)
            self._current = None
            index = self._expected(name)
            got = name.rsplit("/", 1)[-1]
            if got != str(index):
                raise ShardfeedError(
                    f"malformed batch response from {self.url}: got {name!r} where sample {index} was due")
            self._deliver({"__key__": None, "__index__": index, MISSING: True}, out)
            return
        key, field = split_name(name)
        if current is not None and (current["__key__"] != key or field in current):
            self._deliver(current, out)
            current = self._current = None
        if current is None:
            current = {"__key__": key, "__index__": self._expected(name)}
            self._current = current
        current[field] = payload
        if len(current) == self._size:
            self._deliver(current, out)
            self._current = None

    def _expected(self, name: str) -> int:
        """The index of the next sample to start; raise if the response has too many."""
        position = self.delivered
        if position >= len(self.indices):
            raise ShardfeedError(f"malformed batch response from {self.url}: unexpected extra member {name!r}")
        return self.indices[position]

    def _deliver(self, sample: dict, out: list[dict]) -> None:
        out.append(sample)
        self.delivered += 1
