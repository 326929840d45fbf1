"""The Arrow IPC stream format (shardfeed/arrowipc.py): what it writes, pyarrow reads (and
verifies); what pyarrow writes, it reads; a stream cut short is told apart from a whole one."""

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
    assert stream.ended and stream.rows == 4
    assert [(c.name, c.type, c.nullable) for c in stream.columns] == [
        ("__key__", arrowipc.LARGE_UTF8, True), ("__index__", arrowipc.INT, False),
        ("jpg", arrowipc.LARGE_BINARY, True), ("cls", arrowipc.LARGE_BINARY, True)]
    first = stream.batches[0]
    assert first[2].valid(data).tolist() == [True, True, False]
    assert first[3].offsets.tolist() == [0, 1, 1, 1]
    big = stream.batches[1][2]
    assert data[big.data:big.data + big.data_length] == bytes(range(256)) * 40
    assert all(v.data % arrowipc.ALIGNMENT == 0 for batch in stream.batches for v in batch)
    index = stream.batches[0][1]
    assert np.frombuffer(data, "<i8", 3, index.data).tolist() == [5, 6, 7]


@pytest.mark.parametrize("kind", [pa.binary(), pa.large_binary()])
def test_it_reads_a_stream_pyarrow_wrote(kind):
    table = pa.table({"__index__": pa.array([1, 2, 3], pa.int64()), "bin": pa.array([b"a", None, b"ccc"], kind)})
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    data = sink.getvalue().to_pybytes()
    stream = arrowipc.read_stream(data)
    values = stream.batches[0][1]
    assert stream.ended and values.valid(data).tolist() == [True, False, True]
    assert data[values.data:values.data + values.data_length] == b"accc"
    assert values.offsets.tolist() == [0, 1, 1, 4]


def test_a_stream_cut_short_is_not_ended_and_keeps_its_whole_batches():
    data = written(BATCHES)
    for cut in (len(data) - 4, len(data) - 300, 100):
        stream = arrowipc.read_stream(data[:cut])
        assert not stream.ended
        assert stream.rows <= 4


def test_garbage_is_a_format_error_not_a_crash():
    with pytest.raises(arrowipc.ArrowFormatError):
        arrowipc.read_stream(arrowipc.CONTINUATION + b"\x10\0\0\0" + b"\xff" * 16 + bytes(64))
    with pytest.raises(arrowipc.ArrowFormatError):  # a schema whose column type is not handled
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, pa.schema([("f", pa.float32())])):
            pass
        arrowipc.read_stream(sink.getvalue())
