"""The Arrow IPC stream format (shardfeed/arrowipc.py): what it writes, pyarrow reads (and
verifies); what pyarrow writes, it reads; a stream cut short is told apart from a whole one; an
IPC file's footer and record batches read from their own bytes."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from shardfeed import arrowipc

SCHEMA = pa.schema([pa.field("__key__", pa.large_utf8()), pa.field("__index__", pa.int64(), nullable=False),
                    pa.field("jpg", pa.large_binary()), pa.field("cls", pa.large_binary())])


def written(batches: list[dict]) -> bytes:
    """A stream of ``batches`` (column -> values, None for a null) written by this module."""
    out = [arrowipc.schema_message(SCHEMA.serialize().to_pybytes())]
    for columns in batches:
        rows = len(columns["__index__"])
        nodes, buffers = [], []
        for name, values in columns.items():
            if name == "__index__":
                nodes.append((rows, 0))
                buffers += [b"", np.asarray(values, "<i8").tobytes()]
                continue
            valid = np.array([v is not None for v in values], bool)
            encoded = [b"" if v is None else v.encode() if isinstance(v, str) else v for v in values]
            offsets = np.concatenate([[0], np.cumsum([len(e) for e in encoded])]).astype("<i8")
            nodes.append((rows, int((~valid).sum())))
            buffers += [b"" if valid.all() else arrowipc.validity_bitmap(valid), offsets.tobytes(), b"".join(encoded)]
        body = arrowipc.BodyLayout.of([len(b) for b in buffers])
        message = arrowipc.record_batch_message(rows, np.array(nodes), body, sum(map(len, out)))
        assert len(message) == arrowipc.record_batch_message_length(len(nodes), len(buffers))
        out.append(message)
        for buffer, gap in zip(buffers, body.gaps):
            out += [buffer, bytes(gap)]
    out.append(arrowipc.END_OF_STREAM)
    return b"".join(out)


BATCHES = [
    {"__key__": ["a", "b", None], "__index__": [5, 6, 7], "jpg": [b"xx", b"", None], "cls": [b"1", None, None]},
    {"__key__": ["c"], "__index__": [9], "jpg": [bytes(range(256)) * 40], "cls": [b"2"]},
    {"__key__": [], "__index__": [], "jpg": [], "cls": []},
]


def test_pyarrow_reads_what_it_writes_row_for_row():
    table = pa.ipc.open_stream(pa.py_buffer(written(BATCHES))).read_all()
    expected = [dict(zip(b, row)) for b in BATCHES for row in zip(*b.values())]
    assert table.to_pylist() == expected
    table.validate(full=True)


def test_it_reads_its_own_stream_in_place_with_every_buffer_aligned():
    data = written(BATCHES)
    stream = arrowipc.read_stream(data)
    assert stream.ended and stream.total == 4 and stream.rows.tolist() == [3, 1, 0]
    assert [(c.name, c.type, c.nullable) for c in stream.columns] == [
        ("__key__", arrowipc.LARGE_UTF8, True), ("__index__", arrowipc.INT, False),
        ("jpg", arrowipc.LARGE_BINARY, True), ("cls", arrowipc.LARGE_BINARY, True)]
    assert stream.integers(data, 1).tolist() == [5, 6, 7, 9]
    assert stream.valid(data, 2).tolist() == [True, True, False, True]
    starts, lengths = stream.spans(data, 2)
    assert lengths.tolist()[:2] == [2, 0] and lengths[3] == 256 * 40
    assert data[starts[3]:starts[3] + lengths[3]] == bytes(range(256)) * 40
    assert data[starts[0]:starts[0] + 2] == b"xx"
    assert stream.spans(data, 3)[1].tolist()[:2] == [1, 0]
    assert (stream.buffers[:, :, 0] % arrowipc.ALIGNMENT == 0).all()


def test_a_column_is_read_across_many_record_batches_at_once():
    many = [{"__key__": [f"k{i}"], "__index__": [i], "jpg": [bytes([i]) * i], "cls": [None if i % 3 else b"c"]}
            for i in range(50)]
    data = written(many)
    stream = arrowipc.read_stream(data)
    assert stream.integers(data, 1).tolist() == list(range(50))
    starts, lengths = stream.spans(data, 2)
    assert [data[a:a + n] for a, n in zip(starts.tolist(), lengths.tolist())] == [bytes([i]) * i for i in range(50)]
    assert stream.valid(data, 3).tolist() == [i % 3 == 0 for i in range(50)]
    assert arrowipc.gather(data, "u1", *stream.spans(data, 0)).tobytes() == "".join(f"k{i}" for i in range(50)).encode()


@pytest.mark.parametrize("kind", [pa.binary(), pa.large_binary()])
def test_it_reads_a_stream_pyarrow_wrote(kind):
    table = pa.table({"__index__": pa.array([1, 2, 3], pa.int64()), "bin": pa.array([b"a", None, b"ccc"], kind)})
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    data = sink.getvalue().to_pybytes()
    stream = arrowipc.read_stream(data)
    assert stream.ended and stream.valid(data, 1).tolist() == [True, False, True]
    starts, lengths = stream.spans(data, 1)
    assert lengths.tolist() == [1, 0, 3] and data[starts[2]:starts[2] + 3] == b"ccc"


def test_a_stream_cut_short_is_not_ended_and_keeps_its_whole_batches():
    data = written(BATCHES)
    whole = arrowipc.read_stream(data)
    last = len(data) - len(arrowipc.END_OF_STREAM)
    for cut, rows in ((last, 4), (last - 5000, 3), (100, 0)):  # no end marker; into the 2nd batch's body; the schema
        stream = arrowipc.read_stream(data[:cut])
        assert not stream.ended and stream.total == rows and whole.ended


def test_garbage_is_a_format_error_not_a_crash():
    with pytest.raises(arrowipc.ArrowFormatError):
        arrowipc.read_stream(arrowipc.CONTINUATION + b"\x10\0\0\0" + b"\xff" * 16 + bytes(64))
    with pytest.raises(arrowipc.ArrowFormatError):  # a schema whose column type is not handled
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, pa.schema([("f", pa.float32())])):
            pass
        arrowipc.read_stream(sink.getvalue())


def file_of(table: pa.Table, **options) -> bytes:
    """``table`` as an IPC file that pyarrow writes, 3 rows a record batch."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, table.schema, options=pa.ipc.IpcWriteOptions(**options)) as writer:
        writer.write_table(table, max_chunksize=3)
    return sink.getvalue().to_pybytes()


def footer_of(data: bytes) -> arrowipc.FileFooter:
    length = arrowipc.file_footer_length(data[-arrowipc.FILE_TAIL:])
    return arrowipc.read_file_footer(data[-arrowipc.FILE_TAIL - length:-arrowipc.FILE_TAIL])


def record_batches(data: bytes, footer: arrowipc.FileFooter) -> arrowipc.Stream:
    """The file's record batches, each message read from the bytes its block names."""
    messages = [data[offset:offset + length] for offset, length, _ in footer.batches.tolist()]
    return arrowipc.read_record_batches(footer.columns, messages, footer.batches[:, 0] + footer.batches[:, 1])


PLAIN = pa.table({"s": pa.array(["a", None, "ccc", ""]), "b": pa.array([b"x", b"", None, b"zz"], pa.large_binary()),
                  "i": pa.array([1, -2, None, 4], pa.int64()), "f": pa.array([0.5, 1.5, 2.5, None]),
                  "n": pa.array([None] * 4)})


def test_a_files_footer_names_every_columns_type_and_its_record_batches():
    table = PLAIN.append_column("u", pa.array([1, 2, 3, 4], pa.uint16())).append_column(
        "ok", pa.array([True, False, True, None])).append_column("l", pa.array([[1], [], None, [2, 3]])).append_column(
        "d", pa.array(["p", "q", "p", "q"]).dictionary_encode())
    footer = footer_of(file_of(table))
    assert [(c.name, c.type, c.dtype, c.dictionary) for c in footer.columns] == [
        ("s", arrowipc.UTF8, None, False), ("b", arrowipc.LARGE_BINARY, None, False), ("i", arrowipc.INT, "<i8", False),
        ("f", arrowipc.FLOATING_POINT, "<f8", False), ("n", arrowipc.NULL, None, False),
        ("u", arrowipc.INT, "<u2", False), ("ok", arrowipc.BOOL, None, False), ("l", 12, None, False),
        ("d", arrowipc.UTF8, None, True)]
    assert footer.batches.shape == (2, 3)
    with pytest.raises(arrowipc.ArrowFormatError):
        arrowipc.file_footer_length(b"\0" * arrowipc.FILE_TAIL)


def test_a_files_record_batches_place_each_value_where_it_lies():
    data = file_of(PLAIN)
    stream = record_batches(data, footer_of(data))
    assert stream.rows.tolist() == [3, 1] and stream.nulls[:, 4].tolist() == [3, 1]

    def values(column: int) -> list:
        at, lengths = stream.spans(data, column) if column < 2 else stream.fixed_spans(column)
        return [data[a:a + n] if ok else None for a, n, ok in zip(at, lengths, stream.valid(data, column))]

    assert values(0) == [b"a", None, b"ccc", b""] and values(1) == [b"x", b"", None, b"zz"]
    assert [v and int(np.frombuffer(v, "<i8")[0]) for v in values(2)] == [1, -2, None, 4]
    assert [v and float(np.frombuffer(v, "<f8")[0]) for v in values(3)] == [0.5, 1.5, 2.5, None]


def test_a_files_compressed_record_batches_are_refused():
    data = file_of(PLAIN, compression="zstd")
    with pytest.raises(arrowipc.ArrowFormatError, match="compressed"):
        record_batches(data, footer_of(data))
