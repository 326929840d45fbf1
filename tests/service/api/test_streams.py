"""Batches that name their stream (a mixture's): counted per stream where they are served, in
``/metrics`` (``shardfeed_stream_*``) and ``/v1/stats`` (``streams``), on a real service over
a socket, through plain HTTP and the client (the page: test_status_page.py; ``--workers``:
tests/service/cluster/test_workers.py)."""

from __future__ import annotations

import random

import httpx
import pytest

from shardfeed.client import Client
from shardfeed.client.errors import ShardfeedHTTPError
from shardfeed.process import start_service
from shardfeed.service.observe.metrics import MAX_STREAMS, OTHER_STREAM, Metrics
from shardfeed.service.observe.stats import StatsRecorder, per_stream
from shardfeed.tar import END_OF_ARCHIVE

from common.datasets import dir_put, make_dataset
from common.reliability import expected_members
from common.service import metrics, stream_counts, tar_members, wait_for_reading_after

pytestmark = pytest.mark.slow  # starts a service

SAMPLES = 200


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    root = tmp_path_factory.mktemp("streams-data")
    source = make_dataset(dir_put(root), samples=SAMPLES, per_shard=25)
    return root.as_uri(), source


@pytest.fixture
def service(dataset, tmp_path):
    with start_service({"train": dataset[0]}, cache_dir=tmp_path / "cache", args=["--block-size", "64KiB"]) as svc:
        yield svc


def served_bytes(url: str) -> float:
    return metrics(url)["shardfeed_bytes_served_total"]


def test_the_recorder_keeps_each_streams_counters_by_name():
    registry = Metrics()
    recorder = StatsRecorder(registry.registry)
    first = recorder.record()
    for stream, samples, nbytes in [("web.v2", 30, 3000), ("books/en", 5, 700), ("web.v2", 2, 10)]:
        counted_samples, counted_bytes = registry.stream_counters(stream)
        counted_samples.inc(samples)
        counted_bytes.inc(nbytes)
    second = recorder.record()
    assert per_stream(second.values) == {"web.v2": {"samples": 32, "bytes": 3010},
                                         "books/en": {"samples": 5, "bytes": 700}}
    assert per_stream(first.values) == {}
    change, _ = recorder.change(10)
    assert per_stream(change)["web.v2"] == {"samples": 32, "bytes": 3010}


def test_batches_naming_streams_are_counted_per_stream_exactly(service, dataset):
    url, source = service.url, dataset[1]
    rng = random.Random(1)
    want = {"a": {"samples": 0, "bytes": 0}, "b": {"samples": 0, "bytes": 0}}

    def counted(stream: str, samples: int, before: float) -> None:
        want[stream]["samples"] += samples
        want[stream]["bytes"] += served_bytes(url) - before

    with httpx.Client(timeout=30) as http, Client(url) as client:
        for n in range(6):  # plain HTTP, tar and Arrow, streams a and b in turn
            stream, batch = "ab"[n % 2], rng.sample(range(SAMPLES), 10 + n)
            body = {"dataset": "train", "indices": batch, "stream": stream, "format": ["tar", "arrow"][n // 2 % 2]}
            before = served_bytes(url)
            resp = http.post(f"{url}/v1/batch", json=body)
            assert resp.status_code == 200, resp.text
            counted(stream, len(batch), before)
            if body["format"] == "tar":  # what was counted is what was sent, but the end of the archive
                assert tar_members(resp.content) == expected_members(source, "train", batch)
                assert served_bytes(url) - before == len(resp.content) - len(END_OF_ARCHIVE)
        batch = rng.sample(range(SAMPLES), 40)
        # The client's every batch method: samples, an Arrow table, tensors, samples as they come.
        for stream, fetch in [("a", client.get_batch), ("b", client.get_batch_arrow), ("a", client.get_batch_tensors),
                              ("b", lambda *args, **kw: list(client.iter_batch(*args, **kw)))]:
            before = served_bytes(url)
            assert len(fetch("train", batch, stream=stream)) == len(batch)
            counted(stream, len(batch), before)
    assert want["a"]["bytes"] > 0 and want["b"]["bytes"] > 0
    assert stream_counts(url) == want

    doc = wait_for_reading_after(url, httpx.get(f"{url}/v1/stats", timeout=10).json()["time"])
    assert {name: {"samples": s["samples"], "bytes": s["bytes"]} for name, s in doc["streams"].items()} == want
    # Every sample served named a stream: the streams' rates add up to the headline rates, over its span.
    for what in ("samples", "bytes"):
        assert sum(s[f"{what}_per_s"] for s in doc["streams"].values()) == pytest.approx(doc["rates"][what], abs=0.01)


def test_a_batch_naming_no_stream_is_counted_under_none_of_them(service):
    assert wait_for_reading_after(service.url, 0)["streams"] == {}
    resp = httpx.post(f"{service.url}/v1/batch", json={"dataset": "train", "indices": [1, 2, 3]}, timeout=30)
    assert resp.status_code == 200
    assert stream_counts(service.url) == {}
    assert metrics(service.url)["shardfeed_samples_served_total"] == 3
    assert wait_for_reading_after(service.url, 0)["streams"] == {}


@pytest.mark.parametrize("stream", ["", "x" * 65, "a b", "web\u00e9", 'a"b', OTHER_STREAM, 5, ["a"]])
def test_a_bad_stream_name_is_refused_with_an_error_naming_the_field(service, stream):
    for format in ("tar", "arrow"):
        resp = httpx.post(f"{service.url}/v1/batch", timeout=30,
                          json={"dataset": "train", "indices": [1], "stream": stream, "format": format})
        assert resp.status_code == 400, resp.text
        assert resp.headers["content-type"] == "application/json"
        error = resp.json()["error"]
        assert error["code"] == "invalid_request" and "stream" in error["message"], error
    assert stream_counts(service.url) == {}
    assert metrics(service.url)["shardfeed_samples_served_total"] == 0


def test_the_client_sends_a_bad_stream_name_and_raises_the_services_error(service):
    with Client(service.url) as client, pytest.raises(ShardfeedHTTPError) as raised:
        client.get_batch("train", [1, 2], stream="a b")
    assert raised.value.status == 400 and "stream" in raised.value.message


def test_stream_names_beyond_the_bound_count_under_other(service):
    names = [f"s{i:02d}" for i in range(MAX_STREAMS + 2)]
    with httpx.Client(timeout=30) as http:
        def batch(stream: str, size: int) -> None:
            body = {"dataset": "train", "indices": list(range(size)), "stream": stream}
            assert http.post(f"{service.url}/v1/batch", json=body).status_code == 200

        for stream in names:
            batch(stream, 1)
        batch(names[0], 2)  # a name counted before keeps its own label
        batch(names[-1], 3)  # a name beyond the bound stays beyond it
    counts = stream_counts(service.url)
    assert sorted(counts) == sorted([*names[:MAX_STREAMS], OTHER_STREAM])
    assert counts[names[0]]["samples"] == 3 and counts[names[1]]["samples"] == 1
    assert counts[OTHER_STREAM]["samples"] == 1 + 1 + 3  # the 65th, the 66th and the 66th again
    doc = wait_for_reading_after(service.url, httpx.get(f"{service.url}/v1/stats", timeout=10).json()["time"])
    assert {name: s["samples"] for name, s in doc["streams"].items()} == {n: c["samples"] for n, c in counts.items()}
