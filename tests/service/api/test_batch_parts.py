"""``POST /v1/batch`` with ``parts``: several datasets' samples in one request, answered as each
part's Arrow IPC stream in turn, byte for byte the plain batch of that part (cold and streamed,
warm and held), on a real service over a socket; per-stream counts per part, bad parts named,
and a service of two workers answering parts whose samples both own."""

from __future__ import annotations

import random

import httpx
import pyarrow as pa
import pytest

from shardfeed import arrowipc
from shardfeed.arrowipc import END_OF_STREAM, MEDIA_TYPE
from shardfeed.process import start_service
from shardfeed.service.api.batch import MAX_PARTS

from common.datasets import dir_put, make_dataset
from common.service import metrics, stream_counts
from common.workers import each_workers_shards, worker_urls

pytestmark = pytest.mark.slow  # starts services

SAMPLES = {"web": 200, "books": 120}
MAX_BATCH = 1000


@pytest.fixture(scope="module")
def datasets(tmp_path_factory):
    """Two datasets of about 10 KB a sample: a part of 150 samples is read in two groups."""
    urls = {}
    for seed, (name, samples) in enumerate(SAMPLES.items()):
        root = tmp_path_factory.mktemp(name)
        make_dataset(dir_put(root), samples=samples, per_shard=20, seed=seed)
        urls[name] = root.as_uri()
    return urls


def serve(datasets, cache, **options):
    return start_service(datasets, cache_dir=cache, args=["--block-size", "64KiB", "--max-batch", str(MAX_BATCH)],
                         **options)


@pytest.fixture
def service(datasets, tmp_path):
    with serve(datasets, tmp_path / "cache") as svc:
        yield svc


def post(url: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}/v1/batch", json=body, timeout=60)


def parts_request(url: str, parts: list[dict], **body) -> httpx.Response:
    return post(url, {"parts": parts, "format": "arrow", **body})


def plain(url: str, part: dict, **body) -> httpx.Response:
    response = post(url, {**part, "format": "arrow", **body})
    assert response.status_code == 200, response.text
    return response


def assert_parts_answer(response: httpx.Response, plains: list[httpx.Response], held: bool | None) -> None:
    """``response`` is the plain answers' streams one after the other, with their headers summed or
    listed; ``held``: every block was in RAM (its Content-Length said), or not (its estimate), or either."""
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == MEDIA_TYPE
    assert response.content == b"".join(p.content for p in plains)
    if held is not None:
        assert ("content-length" in response.headers) == held
    assert int(response.headers.get("content-length") or response.headers["x-shardfeed-length"]) == \
        len(response.content)
    assert int(response.headers["x-shardfeed-samples"]) == sum(int(p.headers["x-shardfeed-samples"]) for p in plains)
    for header in ("x-shardfeed-dataset-version", "x-shardfeed-routing"):
        if header in plains[0].headers:
            assert response.headers[header] == ",".join(p.headers[header] for p in plains)
    # Each part's stream is an Arrow stream of its own: read one after the other from the one body.
    body, start = pa.py_buffer(response.content), 0
    for p in plains:
        table = pa.ipc.open_stream(body.slice(start, len(p.content))).read_all()
        assert table.num_rows == len(table.column("__index__")) and table.to_pylist() == \
            pa.ipc.open_stream(p.content).read_all().to_pylist()
        start += len(p.content)


def some_parts(rng: random.Random) -> list[dict]:
    """Three parts over two datasets: a big one (two groups when read), one naming fields, one small."""
    return [{"dataset": "web", "indices": rng.sample(range(SAMPLES["web"]), 150) * 4, "stream": "web"},
            {"dataset": "books", "indices": [5, 3, 5, *rng.sample(range(SAMPLES["books"]), 30)],
             "fields": ["cls", "bin"], "stream": "books"},
            {"dataset": "web", "indices": [0, 7, 199], "fields": ["json"]}]


@pytest.mark.parametrize("count", [2, 3])
def test_each_parts_stream_is_its_plain_batchs_cold_and_warm(datasets, tmp_path, count):
    parts = some_parts(random.Random(count))[:count]
    # Cold, streamed: the parts request on a service that read nothing, the plain batches on another.
    with serve(datasets, tmp_path / "plain") as svc:
        cold_plains = [plain(svc.url, part, continue_on_error=True) for part in parts]
    with serve(datasets, tmp_path / "parts") as svc:
        cold = parts_request(svc.url, parts, continue_on_error=True)
        assert_parts_answer(cold, cold_plains, held=False)
        assert len(arrowipc.read_stream(cold_plains[0].content).rows) >= 2  # read in two groups, at least
        # Warm, held: every block in RAM, a big answer through the stream, a small one written at once.
        warm_plains = [plain(svc.url, part, continue_on_error=True) for part in parts]
        assert_parts_answer(parts_request(svc.url, parts, continue_on_error=True), warm_plains, held=True)
        small = [{**part, "indices": part["indices"][:2]} for part in parts]
        assert_parts_answer(parts_request(svc.url, small), [plain(svc.url, part) for part in small], held=True)


def test_a_plain_batch_is_one_part(service):
    part = {"dataset": "books", "indices": [3, 1, 4], "fields": ["bin"]}
    warm = plain(service.url, part)
    assert_parts_answer(parts_request(service.url, [part]), [warm], held=True)


def test_each_part_is_counted_under_its_stream_as_its_plain_batch_is(service):
    parts = some_parts(random.Random(5))
    for _ in range(2):  # read, then held: each part as a plain batch of it is sent from RAM
        plains = [plain(service.url, part, continue_on_error=True) for part in parts]

    def counted(send) -> tuple[dict, float, float]:
        """What ``send()`` added to each stream's counts and to all samples and bytes served."""
        streams, served = stream_counts(service.url), metrics(service.url)
        send()
        now, after = stream_counts(service.url), metrics(service.url)
        return ({name: {what: now[name][what] - streams[name][what] for what in now[name]} for name in now},
                *(after[f"shardfeed_{what}_served_total"] - served[f"shardfeed_{what}_served_total"]
                  for what in ("samples", "bytes")))

    as_plain = counted(lambda: [plain(service.url, part, continue_on_error=True) for part in parts])
    as_parts = counted(lambda: parts_request(service.url, parts, continue_on_error=True).raise_for_status())
    assert as_parts == as_plain
    streams, samples, sent = as_parts
    # Sample 199 lacks json: a row of nulls, not a sample served. What is sent but each end-of-stream marker.
    assert samples == sum(len(p["indices"]) for p in parts) - 1
    assert sent == sum(len(r.content) - len(END_OF_STREAM) for r in plains)
    assert streams == {p["stream"]: {"samples": len(p["indices"]), "bytes": len(r.content) - len(END_OF_STREAM)}
                       for p, r in zip(parts, plains) if "stream" in p}


GOOD = {"dataset": "web", "indices": [1, 2]}


@pytest.mark.parametrize("bad, status, code", [
    ({"dataset": "nope", "indices": [1]}, 404, "unknown_dataset"),
    ({"dataset": "books", "indices": [1, SAMPLES["books"]]}, 404, "sample_out_of_range"),
    ({"dataset": "books", "indices": [-1]}, 400, "invalid_index"),
    ({"dataset": "books", "indices": [1], "fields": ["jpg"]}, 404, "unknown_field"),
    ({"dataset": "books", "indices": [0, 1], "fields": ["json"]}, 404, "unknown_field"),  # sample 1 lacks it
])
def test_a_bad_part_is_refused_naming_the_part_before_any_byte(service, bad, status, code):
    response = parts_request(service.url, [GOOD, bad, GOOD])
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == code and error["message"].startswith(f"part 1 (dataset {bad['dataset']!r}): "), error
    assert metrics(service.url)["shardfeed_samples_served_total"] == 0


@pytest.mark.parametrize("body, status, code, named", [
    ({"parts": [GOOD, {**GOOD, "stream": "a b"}], "format": "arrow"}, 400, "invalid_request", "parts.1.stream"),
    ({"parts": [GOOD, {**GOOD, "format": "arrow"}], "format": "arrow"}, 400, "invalid_request", "parts.1.format"),
    ({"parts": [GOOD], "dataset": "web", "indices": [1], "format": "arrow"}, 400, "invalid_request",
     "given: dataset, indices, parts"),
    ({"parts": [GOOD], "stream": "a", "format": "arrow"}, 400, "invalid_request", "given: stream, parts"),
    ({"format": "arrow"}, 400, "invalid_request", "given: neither"),
    ({"indices": [1], "format": "arrow"}, 400, "invalid_request", "dataset and indices"),
    ({"parts": [], "format": "arrow"}, 400, "invalid_request", "parts"),
    ({"parts": [GOOD] * (MAX_PARTS + 1), "format": "arrow"}, 400, "invalid_request", "parts"),
    ({"parts": [GOOD]}, 400, "unsupported_format", "Arrow only"),
    ({"parts": [GOOD], "format": "tar"}, 400, "unsupported_format", "Arrow only"),
    ({"parts": [GOOD], "format": "parquet"}, 400, "unsupported_format", "tar, arrow"),
    ({"parts": [{**GOOD, "indices": [0] * (MAX_BATCH // 2 + 1)}] * 2, "format": "arrow"}, 413,
     "too_many_items", f"{MAX_BATCH + 2} samples requested"),
])
def test_a_bad_parts_request_gets_a_json_error_naming_what_is_wrong(service, body, status, code, named):
    response = post(service.url, body)
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert error["code"] == code and named in error["message"], error


def test_the_most_parts_and_the_most_samples_are_served(service):
    parts = [{"dataset": "web", "indices": [i]} for i in range(MAX_PARTS)]
    cold = parts_request(service.url, parts)
    assert_parts_answer(cold, [plain(service.url, part) for part in parts], held=False)
    most = [{"dataset": "web", "indices": [i % SAMPLES["web"] for i in range(MAX_BATCH // 2)]}] * 2
    assert parts_request(service.url, most).status_code == 200


def test_every_worker_answers_parts_whose_samples_both_own(datasets, tmp_path):
    with serve(datasets, tmp_path / "cache", workers=2) as svc:
        workers = worker_urls(svc.url)
        owned = each_workers_shards(svc.url, workers, SAMPLES["web"], dataset="web")  # its shards, per worker
        mixed = [owned[0][0][0], owned[1][0][0], owned[0][-1][-1], owned[1][-1][-1]]
        parts = [{"dataset": "web", "indices": mixed, "stream": "web"},
                 {"dataset": "books", "indices": list(range(0, SAMPLES["books"], 7))},
                 {"dataset": "web", "indices": mixed[::-1], "fields": ["bin"]}]
        for worker in workers:
            # Each part's samples read where they are owned (a sibling's through it), cold then warm.
            first = parts_request(worker, parts)
            plains = [plain(worker, part) for part in parts]
            assert_parts_answer(first, plains, held=None)
            assert len(first.headers["x-shardfeed-routing"].split(",")) == len(parts)
            assert_parts_answer(parts_request(worker, parts), plains, held=None)


def test_a_part_whose_shards_changed_in_the_store_is_answered_from_the_new_version(datasets, tmp_path):
    books = tmp_path / "books"
    make_dataset(dir_put(books), samples=SAMPLES["books"], per_shard=20, seed=1)
    with serve({"web": datasets["web"], "books": books.as_uri()}, tmp_path / "cache") as svc:
        parts = [{"dataset": "web", "indices": [3, 1]}, {"dataset": "books", "indices": [2, 100]}]
        before = parts_request(svc.url, parts)
        assert before.status_code == 200, before.text
        source = make_dataset(dir_put(books), samples=SAMPLES["books"], per_shard=20, seed=9)  # every shard anew
        parts[1]["indices"] = [50, 2, 100]  # a shard not read yet: its read finds the change
        after = parts_request(svc.url, parts)
        assert_parts_answer(after, [plain(svc.url, part) for part in parts], held=None)
        versions = [header.split(",") for header in (r.headers["x-shardfeed-dataset-version"] for r in (before, after))]
        assert versions[0][0] == versions[1][0] and versions[0][1] != versions[1][1]
        table = pa.ipc.open_stream(after.content[len(plain(svc.url, parts[0]).content):]).read_all()
        assert table.column("bin").to_pylist() == [source[(i, "bin")] for i in parts[1]["indices"]]
