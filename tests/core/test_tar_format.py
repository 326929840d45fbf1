import io
import tarfile

import pytest

from shardfeed.tar import END_OF_ARCHIVE, TarFormatError, iter_members, member_header, padding


def build(members):
    out = bytearray()
    for name, data in members:
        out += member_header(name, len(data)) + data + b"\0" * padding(len(data))
    return bytes(out + END_OF_ARCHIVE)


def test_members_written_by_us_are_read_back_by_python_tarfile():
    members = [("000001.bin", b"x" * 1000), ("a/" * 60 + "long.cls", b"7"), ("empty.txt", b"")]
    with tarfile.open(fileobj=io.BytesIO(build(members))) as tar:
        got = [(m.name, tar.extractfile(m).read()) for m in tar.getmembers()]
    assert got == members


def test_members_written_by_tarfile_are_parsed_including_long_names():
    buf = io.BytesIO()
    members = [("x/" * 70 + "k.jpg", b"abc" * 300), ("k.cls", b"1")]
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    assert [(n, bytes(d)) for n, d in iter_members(buf.getvalue())] == members


def test_garbage_and_truncation_are_refused():
    with pytest.raises(TarFormatError):
        list(iter_members(b"not a tar file" * 100))
    data = build([("a.bin", b"y" * 2000)])
    with pytest.raises(TarFormatError):
        list(iter_members(data[:1500]))
