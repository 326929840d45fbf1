"""The tar wire format, shared by the service (writer) and the client (parser).

Only what WebDataset shards and batch responses need: regular-file members in ustar
format, with a PAX extended header for names longer than ustar allows. Writing a
member costs one 512-byte header built from a template; parsing is a loop over
headers with no per-member objects beyond the (name, payload) pair.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from zlib import adler32

BLOCK = 512
END_OF_ARCHIVE = b"\0" * (2 * BLOCK)


class TarFormatError(ValueError):
    """The bytes are not a well-formed tar stream (bad checksum, truncated member)."""


def padding(size: int) -> int:
    """Bytes of zero padding after a member of ``size`` bytes."""
    return -size % BLOCK


def _octal(value: int, width: int) -> bytes:
    return b"%0*o\0" % (width - 1, value)


# A ustar header is name(100) mode uid gid(24) size(12) mtime(12) checksum(8) typeflag(1)
# and 355 bytes that never change here: build it by concatenation and compute the
# checksum from the parts (summing 512 bytes in Python per member would dominate).
_MODE_IDS = b"0000644\0" + b"0000000\0" * 2
_TAIL = bytes(100) + b"ustar\x0000" + bytes(247)
_FIXED_SUM = sum(_MODE_IDS) + sum(_TAIL) + 8 * ord(" ")


def _header(name: bytes, size: int, typeflag: bytes, mtime: int) -> bytes:
    if size >= 8**11:  # over 8 GiB: GNU base-256 size field
        size_field = b"\x80" + size.to_bytes(11, "big")
    else:
        size_field = _octal(size, 12)
    mtime_field = _octal(mtime, 12)
    checksum = _FIXED_SUM + sum(name) + sum(size_field) + sum(mtime_field) + typeflag[0]
    return b"".join((name.ljust(100, b"\0"), _MODE_IDS, size_field, mtime_field,
                     b"%06o\0 " % checksum, typeflag, _TAIL))


def member_header(name: str, size: int, mtime: int = 0) -> bytes:
    """Header block(s) for a regular file ``name`` of ``size`` bytes.

    Names over 100 bytes get a PAX ``path`` record first, as GNU tar and Python's
    tarfile do, so any tar reader sees the full name.
    """
    raw = name.encode()
    if len(raw) <= 100:
        return _header(raw, size, b"0", mtime)
    record = b" path=" + raw + b"\n"
    length = len(record)
    while len(b"%d" % length) + len(record) != length:  # the length counts its own digits
        length = len(b"%d" % length) + len(record)
    pax = b"%d" % length + record
    return (_header(b"././@PaxHeader", len(pax), b"x", mtime) + pax + b"\0" * padding(len(pax))
            + _header(raw[-100:], size, b"0", mtime))


def frame(name: str, *data: bytes | memoryview) -> list[bytes | memoryview]:
    """One whole member: header block(s), its data (one part or several, e.g. slices of
    consecutive blocks), zero padding to the next block (none when it ends on one)."""
    size = sum(map(len, data))
    pad = padding(size)
    return [member_header(name, size), *data, bytes(pad)] if pad else [member_header(name, size), *data]


def names_member(data: bytes | memoryview, at: int, name: bytes, size: int) -> bool:
    """Whether the 512 bytes of ``data`` at ``at`` are a plain ustar header of a regular file
    exactly ``name``, ``size`` bytes long: then they can be sent as they are, instead of a
    new header.

    Checks the fields a reader acts on (name, ustar prefix, size, type), not the checksum:
    the bytes come from a shard whose headers were read and checked when it was indexed.
    """
    n = len(name)
    header = bytes(data[at:at + BLOCK])
    return (n <= 100 and header.startswith(name) and (n == 100 or header[n] == 0) and header[345] == 0
            and header[156] in (48, 0) and header.startswith(b"%011o\0" % size, 124))


# The fields a reader acts on, in one unpack: name, size, checksum, typeflag, magic, prefix.
_FIELDS = struct.Struct("100s24x12s12x8sc100x5s83x155s12x")


def parse_header(block: bytes | memoryview, at: int = 0) -> tuple[bytes, int, bytes]:
    """``(name, size, typeflag)`` of the header block at offset ``at`` of ``block``;
    raises ``TarFormatError``."""
    if len(block) - at < BLOCK:
        raise TarFormatError("truncated tar header")
    name, size_field, stored, typeflag, magic, prefix = _FIELDS.unpack_from(block, at)
    # The byte sum of each half (at most 256 * 255, below adler32's modulus) is adler32's low
    # half minus one: the exact checksum in C, where a Python sum over 512 bytes costs microseconds.
    # The checksum field itself counts as eight spaces.
    checksum = ((adler32(block[at:at + 256]) & 0xFFFF) + (adler32(block[at + 256:at + BLOCK]) & 0xFFFF)
                - (adler32(stored) & 0xFFFF) + 255)
    try:
        ok = int(stored.strip(b"\0 ") or b"0", 8) == checksum
        if size_field[0] & 0x80:  # GNU base-256 size for members over 8 GiB
            size = int.from_bytes(size_field[1:], "big")
        else:
            size = int(size_field.strip(b"\0 ") or b"0", 8)
    except ValueError:
        ok = False
    if not ok:
        raise TarFormatError("bad tar header checksum (not a tar file, or corrupt)")
    name = name.split(b"\0", 1)[0]
    if magic == b"ustar" and prefix[0]:
        name = prefix.split(b"\0", 1)[0] + b"/" + name
    return name, size, typeflag


def parse_pax(data: bytes) -> dict[bytes, bytes]:
    """Records of a PAX extended header: ``{b'path': b'...'}``."""
    out, pos = {}, 0
    while pos < len(data) and data[pos:pos + 1] != b"\0":
        space = data.index(b" ", pos)
        length = int(data[pos:space])
        key, _, value = data[space + 1:pos + length - 1].partition(b"=")
        out[key] = value
        pos += length
    return out


def member_spans(data: bytes | memoryview) -> tuple[list[tuple[str, int, int]], bool]:
    """The regular-file members of a complete in-memory tar archive as ``(name, start, stop)``
    (where each payload lies in ``data``), and whether an end-of-archive block closed it."""
    view = memoryview(data)
    pos, long_name, spans = 0, None, []
    while pos + BLOCK <= len(view):
        if not any(view[pos:pos + BLOCK]):
            return spans, True
        name, size, typeflag = parse_header(view, pos)
        start = pos + BLOCK
        end = start + size
        if end > len(view):
            raise TarFormatError(f"truncated tar member {name.decode(errors='replace')!r}")
        pos = end + padding(size)
        if typeflag == b"x":
            long_name = parse_pax(bytes(view[start:end])).get(b"path", long_name)
        elif typeflag == b"L":
            long_name = bytes(view[start:end]).rstrip(b"\0")
        elif typeflag in (b"0", b"\0"):
            spans.append(((long_name or name).decode(), start, end))
            long_name = None
        else:
            long_name = None
    if pos < len(view):
        raise TarFormatError("truncated tar archive")
    return spans, False


def iter_members(data: bytes | memoryview) -> Iterator[tuple[str, memoryview]]:
    """Regular-file members ``(name, payload)`` of a complete in-memory tar archive."""
    view = memoryview(data)
    for name, start, stop in member_spans(view)[0]:
        yield name, view[start:stop]
