"""``POST /v1/batch`` with ``"format": "arrow"``: an Arrow IPC stream, a row per sample, checked
byte for byte against the shards as ``tarfile`` wrote them (PAX and GNU long names, empty
members, a field some samples lack, repeats), cold and warm, with missing samples, through a
service of two workers, and read by pyarrow (which verifies every message) and by the client's
own reader (``shardfeed/arrowipc.py``)."""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import httpx
import pyarrow as pa
import pytest

from shardfeed import arrowipc
from shardfeed.process import start_service

from common.datasets import odd_tar_dataset
from common.workers import worker_urls

SAMPLES = 240
FIELDS = ["bin", "cls", "seg.png"]  # the dataset's, in its order


@pytest.fixture(scope="module")
def odd(tmp_path_factory):
    root = tmp_path_factory.mktemp("arrow")
    url, source = odd_tar_dataset(root / "data", SAMPLES)
    return root, url, source


@pytest.fixture(scope="module")
def service(odd):
    root, url, _ = odd
    with start_service({"train": url}, cache_dir=root / "cache", args=["--block-size", "64KiB"]) as svc:
        yield svc


def post(url: str, **body) -> httpx.Response:
    return httpx.post(f"{url}/v1/batch", json={"dataset": "train", "format": "arrow", **body}, timeout=60)


def rows_expected(source, indices, fields, continue_on_error=True) -> list[dict]:
    """The rows the stream must hold, from the shards as written: with fields named, a sample
    lacking one is missing (a row of nulls but its index), as in the tar format."""
    rows = []
    for i in indices:
        columns = fields or FIELDS
        if fields and any((i, f) not in source for f in fields):
            rows.append({"__key__": None, "__index__": i, **{f: None for f in columns}})
            continue
        key = source[(i, "bin")][0][:-len(".bin")]  # every sample has a bin
        rows.append({"__key__": key, "__index__": i,
                     **{f: source[(i, f)][1] if (i, f) in source else None for f in columns}})
    return rows


def read(response: httpx.Response) -> pa.Table:
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == arrowipc.MEDIA_TYPE
    table = pa.ipc.open_stream(pa.py_buffer(response.content)).read_all()
    table.validate(full=True)
    return table


def announced(response: httpx.Response) -> int:
    return int(response.headers.get("content-length") or response.headers["x-shardfeed-length"])


@pytest.mark.parametrize("fields", [None, ["seg.png", "bin"], ["cls"], ["BIN", "bin"]])
def test_every_field_is_byte_exact_against_the_shards_cold_and_warm(service, odd, fields):
    _, _, source = odd
    rng = random.Random(len(fields or ()))
    columns = list(dict.fromkeys(f.lower() for f in fields)) if fields else None
    for round_ in ("cold", "warm"):
        indices = [rng.randrange(SAMPLES) for _ in range(150)] + [5, 5, 5]
        response = post(service.url, indices=indices, fields=fields, continue_on_error=True)
        table = read(response)
        assert table.column_names == ["__key__", "__index__", *(columns or FIELDS)]
        assert table.schema.field(table.column_names[-1]).type == pa.large_binary()
        assert table.to_pylist() == rows_expected(source, indices, columns), round_
        # The length said up front is the stream's: exact whether streamed (cold) or held (warm).
        assert announced(response) == len(response.content), round_


def test_a_cold_batch_streams_a_record_batch_per_group_and_every_buffer_lies_aligned(odd, tmp_path):
    _, url, source = odd
    indices = list(range(SAMPLES)) * 4  # about 11 MB: groups of 4 MiB when read, one group when held
    streams = []
    with start_service({"train": url}, cache_dir=tmp_path / "cache", args=["--block-size", "64KiB"]) as svc:
        for _ in range(2):
            response = post(svc.url, indices=indices, fields=["bin", "cls"])
            assert read(response).to_pylist() == rows_expected(source, indices, ["bin", "cls"])
            assert announced(response) == len(response.content)
            streams.append(arrowipc.read_stream(response.content))
    cold, warm = streams
    assert len(cold.rows) >= 3 and len(warm.rows) == 1
    for stream in streams:
        assert stream.ended and stream.total == len(indices)
        assert (stream.buffers[:, :, 0] % arrowipc.ALIGNMENT == 0).all()


def test_a_small_warm_batch_answered_at_once_is_the_same_stream(service, odd):
    _, _, source = odd
    indices = [1, 2, 3, 2]
    first, second = (post(service.url, indices=indices, fields=["cls", "bin"]) for _ in range(2))
    assert "content-length" in second.headers and second.content == first.content
    assert read(second).to_pylist() == rows_expected(source, indices, ["cls", "bin"])


def test_samples_of_a_shard_gone_from_the_store_are_rows_of_nulls_or_a_503(odd, tmp_path):
    root, _, source = odd
    data = tmp_path / "data"
    shutil.copytree(root / "data", data)
    (data / "shard-1.tar").unlink()  # samples from SAMPLES // 2 on
    with start_service({"train": data.as_uri()}, cache_dir=tmp_path / "cache") as svc:
        indices = [3, SAMPLES - 1, 7, SAMPLES // 2]
        table = read(post(svc.url, indices=indices, continue_on_error=True))
        expected = rows_expected(source, indices, None)
        for row in (1, 3):
            expected[row] = {"__key__": None, "__index__": indices[row], **{f: None for f in FIELDS}}
        assert table.to_pylist() == expected
        refused = post(svc.url, indices=indices)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "store_unavailable"


def test_every_worker_answers_for_samples_its_sibling_owns(odd, tmp_path):
    root, url, source = odd
    indices = random.Random(3).sample(range(SAMPLES), 100)
    with start_service({"train": url}, cache_dir=tmp_path / "cache", workers=2,
                       args=["--block-size", "64KiB"]) as svc:
        for worker in worker_urls(svc.url):
            for _ in range(2):  # cold, then warm
                assert read(post(worker, indices=indices)).to_pylist() == rows_expected(source, indices, None)


@pytest.mark.parametrize("body, code", [
    ({"format": "parquet"}, "unsupported_format"),
    ({"fields": ["nope"]}, "unknown_field"),
])
def test_bad_requests_get_a_json_error_naming_the_formats(service, body, code):
    response = post(service.url, indices=[1], **body)
    assert response.status_code in (400, 404) and response.json()["error"]["code"] == code
    if code == "unsupported_format":
        assert "tar, arrow" in response.json()["error"]["message"]


def test_an_empty_batch_is_a_schema_and_the_end_of_the_stream(service):
    table = read(post(service.url, indices=[], fields=["cls"]))
    assert table.num_rows == 0 and table.column_names == ["__key__", "__index__", "cls"]
