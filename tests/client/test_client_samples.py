"""The incremental tar parser and the grouping of members into samples."""

from __future__ import annotations

import io
import tarfile

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardfeed.client import MISSING, ShardfeedConnectionError, ShardfeedError
from shardfeed.client.samples import BatchReader, TarStream, split_name
from shardfeed.tar import END_OF_ARCHIVE, TarFormatError, member_header, padding


def tar_bytes(members: list[tuple[str, bytes]], end: bool = True) -> bytes:
    out = bytearray()
    for name, data in members:
        out += member_header(name, len(data)) + data + b"\0" * padding(len(data))
    return bytes(out + (END_OF_ARCHIVE if end else b""))


def feed_in_pieces(parser, data: bytes, cuts: list[int]) -> list:
    out, last = [], 0
    for cut in sorted(set(cuts)) + [len(data)]:
        out += parser.feed(data[last:cut])
        last = cut
    return out


MEMBERS = [("000001.jpg", b"j" * 700), ("000001.cls", b"3"), ("d/" * 70 + "000002.jpg", b"x" * 10),
           ("d/" * 70 + "000002.cls", b""), ("000003.seg.npy", bytes(range(256)) * 5)]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 5000), max_size=12))
def test_members_come_out_whole_however_the_stream_is_cut(cuts):
    data = tar_bytes(MEMBERS)
    parser = TarStream()
    assert feed_in_pieces(parser, data, [c % len(data) for c in cuts]) == MEMBERS
    assert parser.ended


def test_a_stream_fed_one_byte_at_a_time_gives_the_same_bytes_payloads():
    data = tar_bytes(MEMBERS)
    parser = TarStream()
    got = feed_in_pieces(parser, data, list(range(len(data))))
    assert got == MEMBERS and all(type(payload) is bytes for _, payload in got)
    assert parser.ended and parser.feed(b"more") == []


def test_a_bad_header_checksum_is_refused():
    data = bytearray(tar_bytes(MEMBERS))
    data[40] ^= 1  # inside the first header's name field
    with pytest.raises(TarFormatError, match="checksum"):
        TarStream().feed(bytes(data))


def test_members_written_by_python_tarfile_with_pax_names_are_read():
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in MEMBERS:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    assert feed_in_pieces(TarStream(), buf.getvalue(), [100, 1000, 1001]) == MEMBERS


def test_key_is_the_name_up_to_the_first_dot_of_the_file_name():
    assert split_name("a.b/000001.seg.npy") == ("a.b/000001", "seg.npy")
    assert split_name("000001") == ("000001", "")


def test_repeated_indices_become_separate_samples_and_404_entries_become_placeholders():
    members = [("k1.jpg", b"a"), ("k1.cls", b"1"), ("k1.jpg", b"a"), ("k1.cls", b"1"),
               ("__404__/train/9", b""), ("k2.jpg", b"b")]
    reader = BatchReader("train", [1, 1, 9, 2])
    got = feed_in_pieces(reader, tar_bytes(members), [600]) + reader.finish()
    assert got == [
        {"__key__": "k1", "__index__": 1, "jpg": b"a", "cls": b"1"},
        {"__key__": "k1", "__index__": 1, "jpg": b"a", "cls": b"1"},
        {"__key__": None, "__index__": 9, MISSING: True},
        {"__key__": "k2", "__index__": 2, "jpg": b"b"},
    ]


def test_with_fields_named_a_sample_is_handed_out_as_soon_as_its_last_field_arrives():
    data = tar_bytes([("k1.jpg", b"a"), ("k1.cls", b"1"), ("k2.jpg", b"b"), ("k2.cls", b"2")])
    reader = BatchReader("train", [1, 2], fields=["jpg", "cls"])
    assert [s["__index__"] for s in reader.feed(data[:2048])] == [1]


def test_a_stream_cut_short_raises_a_connection_error_and_keeps_what_arrived():
    data = tar_bytes([("k1.jpg", b"a"), ("k2.jpg", b"b"), ("k2.cls", b"2")], end=False)
    reader = BatchReader("train", [1, 2, 3])
    assert [s["__index__"] for s in reader.feed(data)] == [1]
    with pytest.raises(ShardfeedConnectionError, match="after 1 of 3 samples"):
        reader.finish()  # sample 2 may have had more fields on the way: not delivered
    assert reader.remaining() == [2, 3]


def test_garbage_and_extra_members_are_protocol_errors():
    with pytest.raises(ShardfeedError, match="malformed"):
        BatchReader("train", [1]).feed(b"not a tar" * 100)
    reader = BatchReader("train", [1])
    with pytest.raises(ShardfeedError, match="extra member"):
        reader.feed(tar_bytes([("k1.jpg", b"a"), ("k2.jpg", b"b")]))
    with pytest.raises(ShardfeedError, match="where sample 1 was due"):
        BatchReader("train", [1]).feed(tar_bytes([("__404__/train/2", b"")]))
