"""The checks every benchmark's figures rest on (``benchmarks/common.py``, and the byte counts
of the wrk and store benchmarks): each passes the right answer and refuses a wrong one."""

from __future__ import annotations

import random

import pyarrow as pa
import pytest

from shardfeed.benchmarks.common import Digests, WrongBytes, table
from shardfeed.benchmarks.serverside import check_bytes
from shardfeed.benchmarks.stores import Ranges
from shardfeed.seeds.synthetic import member_bytes, sample_key
from shardfeed.tar import END_OF_ARCHIVE, frame

SIZES = (100, 300)
DIGESTS = Digests(8, SIZES, ("bin", "cls"))


def sample(i: int, **changes) -> dict:
    return {"__key__": sample_key(i), "__index__": i, "bin": member_bytes(0, i, "bin", SIZES),
            "cls": member_bytes(0, i, "cls", SIZES), **changes}


def tar(members: list[tuple[str, bytes]]) -> bytes:
    return b"".join(b"".join(frame(name, payload)) for name, payload in members) + END_OF_ARCHIVE


def test_a_batch_is_checked_against_the_indices_asked_not_the_index_the_client_copied():
    asked = [5, 2, 7]
    assert DIGESTS.check_batch(asked, [sample(i) for i in asked]) == 3
    swapped = [sample(2, __index__=5), sample(5, __index__=2), sample(7)]  # __index__ as the client copies it
    with pytest.raises(WrongBytes, match="index 5: key '000000002'"):
        DIGESTS.check_batch(asked, swapped)
    with pytest.raises(WrongBytes, match="asked for 3 samples, got 2"):
        DIGESTS.check_batch(asked, [sample(5), sample(2)])


def test_one_byte_changed_in_any_field_is_refused():
    flipped = bytearray(member_bytes(0, 3, "bin", SIZES))
    flipped[-1] ^= 1
    with pytest.raises(WrongBytes, match="sample 3 bin"):
        DIGESTS.check_batch([3], [sample(3, bin=bytes(flipped))])
    with pytest.raises(WrongBytes, match="sample 3 cls"):
        DIGESTS.check_batch([3], [sample(3, cls=member_bytes(0, 4, "cls", SIZES) + b"0")])
    with pytest.raises(WrongBytes, match="sample 3 bin"):  # the bytes of a sample the index did not ask for
        DIGESTS.check_indexed(sample(3, bin=member_bytes(0, 4, "bin", SIZES)))
    assert DIGESTS.check_indexed(sample(3)) == 3


def test_a_tar_answer_is_checked_member_by_member_in_the_order_asked():
    def members(i: int, fields=("bin", "cls")) -> list[tuple[str, bytes]]:
        return [(f"{sample_key(i)}.{f}", member_bytes(0, i, f, SIZES)) for f in fields]

    assert DIGESTS.check_tar([1, 1, 6], tar(members(1) + members(1) + members(6, ("cls", "bin")))) == 3
    with pytest.raises(WrongBytes, match="index 1: members"):
        DIGESTS.check_tar([1, 6], tar(members(6) + members(1)))
    with pytest.raises(WrongBytes, match="got 3 members"):
        DIGESTS.check_tar([1, 6], tar(members(1) + members(6, ("bin",))))
    cut = members(1)
    cut[0] = (cut[0][0], cut[0][1][:-1])
    with pytest.raises(WrongBytes, match="sample 1 bin"):
        DIGESTS.check_tar([1], tar(cut))


def test_an_arrow_answer_is_checked_row_by_row_in_the_order_asked():
    def stream(rows: list[int], **columns) -> bytes:
        table = pa.table({"__key__": pa.array([sample_key(i) for i in rows], pa.large_utf8()),
                          "__index__": pa.array(rows, pa.int64()),
                          **{f: pa.array(columns.get(f, [member_bytes(0, i, f, SIZES) for i in rows]),
                                         pa.large_binary()) for f in ("bin", "cls")}})
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, table.schema) as writer:
            for batch in table.to_batches(max_chunksize=2):  # several record batches
                writer.write_batch(batch)
        return sink.getvalue().to_pybytes()

    assert DIGESTS.check_arrow([1, 1, 6], stream([1, 1, 6])) == 3
    with pytest.raises(WrongBytes, match="not in the order asked"):
        DIGESTS.check_arrow([1, 6], stream([6, 1]))
    with pytest.raises(WrongBytes, match="sample 6 cls"):
        DIGESTS.check_arrow([1, 6], stream([1, 6], cls=[member_bytes(0, 1, "cls", SIZES)] * 2))
    with pytest.raises(WrongBytes, match="sample 6 bin"):
        DIGESTS.check_arrow([1, 6], stream([1, 6], bin=[member_bytes(0, 1, "bin", SIZES), None]))


def test_wrk_bytes_must_cover_every_answer_and_no_more_than_one_unfinished_per_connection():
    check_bytes({"requests": 10, "bytes": 1000}, 100, 4, "batch")
    check_bytes({"requests": 10, "bytes": 1400}, 100, 4, "batch")  # four answers cut off by the end
    for received in (999, 1401):  # a short answer; more than the connections could have had in flight
        with pytest.raises(RuntimeError, match=f"wrk received {received} bytes for 10 answers of 100 bytes"):
            check_bytes({"requests": 10, "bytes": received}, 100, 4, "batch")


def test_a_range_read_in_pieces_is_checked_as_the_whole_range():
    data = random.Random(0).randbytes(4096)
    ranges = Ranges(data, 1024, [0, 2048])
    assert ranges.checked(2048, [data[2048:2100], memoryview(data)[2100:3072]]) == 1024
    assert ranges.checked(0, data[:1024]) == 1024
    with pytest.raises(RuntimeError, match="the range at 2048"):
        ranges.checked(2048, data[:1024])


def test_a_table_is_as_wide_as_its_widest_cells():
    assert table(["name", "MB/s"], [["shardfeed", 1234], ["boto3", 5]]).splitlines() == [
        "name       MB/s", "shardfeed  1234", "boto3         5"]
