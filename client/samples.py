"""Turn a streamed tar response into samples as the bytes arrive.

Two small push parsers, shared by the blocking and the asyncio client:

- :class:`TarStream` takes network chunks of any size and returns the members they
  complete, as ``(name, payload)`` pairs. It keeps one growing buffer and slices
  payloads out of it, so a member costs one header parse and one copy of its bytes.
- :class:`BatchReader` groups members into the samples of one request. The service
  sends ``<key>.<field>`` members in exactly the order of the requested indices, so a
  new sample starts when the key changes, when a field repeats (the same index asked
  twice in a row), or at a ``__404__/<dataset>/<i>`` entry (a sample that could not be
  served, sent when ``continue_on_error`` is set). Its second output, for a response held
  whole in memory (:meth:`BatchReader.spans`), gives each payload as its place there.

A sample is a dict ``{"__key__": key, "__index__": i, "<field>": bytes, ...}``. A sample
the service could not serve is ``{"__key__": None, "__index__": i, "__missing__": True}``
with no fields, so a batch always has one entry per requested index, in order.
"""

from __future__ import annotations

from collections.abc import Sequence
from sys import intern

from shardfeed.tar import BLOCK, TarFormatError, member_spans, padding, parse_header, parse_pax

from .errors import ShardfeedConnectionError, ShardfeedError

MISSING = "__missing__"
"""Key set to ``True`` in the placeholder of a sample the service could not serve."""

_NOT_FOUND = "__404__/"
_ZERO_BLOCK = bytes(BLOCK)
_REGULAR = (b"0", b"\0")


class TarStream:
    """Incremental tar parser: ``feed(chunk)`` returns the members that chunk completed.

    It walks each chunk in place: a member that lies inside one chunk costs one slice
    (its only copy); one spread over chunks is joined once, when its last byte arrives;
    only a header split between chunks is assembled in a small buffer.
    """

    def __init__(self) -> None:
        self._head = bytearray()  # a header block split between chunks
        self._parts: list = []  # views of the pieces received so far of a member split between chunks
        self._member: tuple[bytes, int, bytes] | None = None  # (name, size, typeflag) being received
        self._need = 0  # payload bytes of that member still to come
        self._skip = 0  # padding bytes still to skip
        self._long_name: bytes | None = None
        self.ended = False
        """True once the end-of-archive marker (a zero block) has been read."""

    def feed(self, chunk: bytes) -> list[tuple[str, bytes]]:
        """Add ``chunk``; return the ``(name, payload)`` of each member it completed."""
        out: list[tuple[str, bytes]] = []
        if self.ended:
            return out
        if not isinstance(chunk, bytes):
            chunk = bytes(chunk)
        pos, end = 0, len(chunk)
        while pos < end:
            if self._skip:
                step = min(self._skip, end - pos)
                self._skip -= step
                pos += step
            elif self._member is not None:
                need = self._need
                if need <= end - pos:
                    payload = chunk[pos:pos + need]
                    if self._parts:
                        self._parts.append(payload)
                        payload = b"".join(self._parts)
                        self._parts = []
                    pos += need
                    self._done(payload, out)
                else:
                    self._parts.append(memoryview(chunk)[pos:])  # no copy until the join
                    self._need -= end - pos
                    pos = end
            elif not self._head and end - pos >= BLOCK:
                pos = self._whole(chunk, pos, end, out)
            else:  # a header split between chunks
                take = min(BLOCK - len(self._head), end - pos)
                self._head += chunk[pos:pos + take]
                pos += take
                if len(self._head) < BLOCK:
                    break
                header = bytes(self._head)
                self._head.clear()
                if header == _ZERO_BLOCK:
                    self.ended = True
                    break
                self._member = parse_header(header)
                self._need = self._member[1]
                if not self._need:
                    self._done(b"", out)
        return out

    def _whole(self, chunk: bytes, pos: int, end: int, out: list[tuple[str, bytes]]) -> int:
        """Read the members whose headers lie whole in ``chunk`` from ``pos`` on (the common
        case, in one tight loop); return where the rest of the chunk starts."""
        while end - pos >= BLOCK:
            if not chunk[pos] and chunk.startswith(_ZERO_BLOCK, pos):
                self.ended = True
                return end
            name, size, typeflag = parse_header(chunk, pos)
            start = pos + BLOCK
            stop = start + size
            if stop > end:  # the payload runs on into the next chunks
                self._member = (name, size, typeflag)
                self._need = size
                return start
            pos = stop + padding(size)
            if self._long_name is None and typeflag in _REGULAR:
                out.append((name.decode(), chunk[start:stop]))
            else:
                self._complete(name, typeflag, chunk[start:stop], out)
            if pos > end:  # the padding runs on into the next chunk
                self._skip = pos - end
                return end
        return pos

    def _done(self, payload: bytes, out: list[tuple[str, bytes]]) -> None:
        """The member being received is complete."""
        name, size, typeflag = self._member
        self._member = None
        self._skip = padding(size)
        self._complete(name, typeflag, payload, out)

    def _complete(self, name: bytes, typeflag: bytes, payload: bytes, out: list[tuple[str, bytes]]) -> None:
        if typeflag == b"x":
            self._long_name = parse_pax(payload).get(b"path", self._long_name)
        elif typeflag == b"L":
            self._long_name = payload.rstrip(b"\0")
        elif typeflag in _REGULAR:
            out.append(((self._long_name or name).decode(), payload))
            self._long_name = None
        else:
            self._long_name = None


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

    def restart(self, url: str, whole: bool = False) -> None:
        """Start reading a fresh response for the samples not yet delivered (``whole``: for
        all of them, the samples delivered forgotten)."""
        self.url = url
        self._tar = TarStream()
        self._current = None
        if whole:
            self.delivered = 0

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

    def spans(self, body: memoryview) -> list[dict]:
        """The samples of a whole response held in ``body``, each field's payload as its
        ``(offset, size)`` there: parsed in place, no payload copied (the tensor output,
        :mod:`.tensors`). Raises as :meth:`feed` and :meth:`finish` do."""
        try:
            members, self._tar.ended = member_spans(body)
        except TarFormatError as exc:
            raise ShardfeedError(f"malformed batch response from {self.url}: {exc}") from None
        out: list[dict] = []
        for name, start, stop in members:
            self._add(name, (start, stop - start), out)
        return out + self.finish()

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
        # One str object per field name: the samples of a batch then share their keys, which
        # pickling (to the DataLoader's main process) sends once per batch, not once per sample.
        field = intern(field)
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
