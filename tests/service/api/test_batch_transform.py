"""``POST /v1/batch`` with ``"transform"``: the service runs a served transform on every sample
(``service/transform/``), through the real pool, over its socket. Every answer is read with
pyarrow and held equal to ``apply(t, t.prepare(raw), seed, epoch, i)`` computed here from the
bytes ``tarfile`` wrote; a second request comes from the prepared cache; a shard overwritten in
the store, or a new version of the transform, is never answered from stale prepared outputs;
errors name the sample; a hanging transform answers within its deadline."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import tarfile
import time

import httpx
import numpy as np
import pyarrow as pa
import pytest
from prometheus_client.parser import text_string_to_metric_families

from shardfeed.client import Client
from shardfeed.process import start_service
from shardfeed.retry import Backoff
from shardfeed.transforms.base import apply

from common import REPO
from common.datasets import dir_put, make_dataset
from common.sample_transforms import Digest

SAMPLES, PER_SHARD = 60, 20
MODULE = "common.sample_transforms"
TRANSFORMS = ["--transform", f"digest={MODULE}:digest", "--transform", f"raising={MODULE}:digest_raising",
              "--transform", f"hanging={MODULE}:digest_hanging", "--transform", f"shifted={MODULE}:BytesShifted"]
TIMEOUT = 1.0
TENANTS = """
[all]
secret = "all-9f2c"
scopes = ["dataset:*", "admin"]

[limited]
secret = "limited-41d7"
scopes = ["dataset:*"]
transforms = ["digest"]
"""
ALL, LIMITED = {"Authorization": "Bearer all-9f2c"}, {"Authorization": "Bearer limited-41d7"}
ENV = {"PYTHONPATH": str(REPO / "tests")}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("transform")
    sources = {name: make_dataset(dir_put(root / name), samples=SAMPLES, per_shard=PER_SHARD, sizes=(100, 3000))
               for name in ("train", "mutable")}
    (root / "tokens.toml").write_text(TENANTS)
    return root, sources


@pytest.fixture(scope="module")
def service(data):
    root, _ = data
    with start_service({name: (root / name).as_uri() for name in ("train", "mutable")}, cache_dir=root / "cache",
                       env=ENV, args=[*TRANSFORMS, "--transform-processes", "2", "--transform-timeout", str(TIMEOUT),
                                      "--tokens", str(root / "tokens.toml"), "--block-size", "64KiB"]) as svc:
        yield svc


def post(url: str, body: dict, headers=ALL, timeout: float = 30) -> httpx.Response:
    return httpx.post(f"{url}/v1/batch", json={"format": "arrow", **body}, headers=headers, timeout=timeout)


def batch(url: str, indices, name: str = "digest", seed: int = 0, epoch: int = 0, dataset: str = "train",
          **more) -> httpx.Response:
    return post(url, {"dataset": dataset, "indices": list(indices),
                      "transform": {"name": name, "seed": seed, "epoch": epoch}, **more})


def expected(source: dict, i: int, seed: int, epoch: int, transform=None) -> dict[str, np.ndarray]:
    transform = transform or Digest()
    return apply(transform, transform.prepare({"bin": source[(i, "bin")], "cls": source[(i, "cls")]}), seed, epoch, i)


def check(answer: httpx.Response, source: dict, indices, seed: int, epoch: int, transform=None) -> pa.Table:
    """The answer's rows are the transform's outputs for ``indices``, byte for byte."""
    assert answer.status_code == 200, answer.text
    assert answer.headers["content-type"] == "application/vnd.apache.arrow.stream"
    assert int(answer.headers["content-length"]) == len(answer.content)
    table = pa.ipc.open_stream(answer.content).read_all()
    assert table.column_names == ["__key__", "__index__", "head", "head.shape", "label", "noise"]
    assert table.column("__index__").to_pylist() == list(indices)
    for row, i in enumerate(indices):
        want = expected(source, i, seed, epoch, transform)
        assert table.column("__key__")[row].as_py() == f"sample{i:06d}"
        assert table.column("head")[row].as_py() == want["head"].tobytes()
        assert table.column("head.shape")[row].as_py() == np.asarray(want["head"].shape, "<i8").tobytes()
        assert table.column("label")[row].as_py() == want["label"].tobytes()
        assert table.column("noise")[row].as_py() == want["noise"].tobytes()
    return table


def prepared(url: str, result: str, name: str = "digest") -> float:
    text = httpx.get(f"{url}/metrics", headers=ALL, timeout=10).text
    return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples
               if s.name == "shardfeed_transform_prepared_total" and s.labels == {"transform": name, "result": result})


def test_outputs_match_the_transform_run_here_and_the_second_batch_comes_from_the_prepared_cache(service, data):
    source = data[1]["train"]
    indices = [0, 7, 21, 59, 40, 7, 13]
    hits, misses = prepared(service.url, "hit"), prepared(service.url, "miss")
    first = batch(service.url, indices, seed=5, epoch=3)
    check(first, source, indices, 5, 3)
    assert first.headers["x-shardfeed-transform"] == "digest;version=1"
    assert json.loads(first.headers["x-shardfeed-outputs"]) == {
        "head": {"dtype": "uint8", "shape": [None]}, "label": {"dtype": "int64", "shape": []},
        "noise": {"dtype": "float32", "shape": [4]}}
    assert prepared(service.url, "miss") - misses == len(indices)
    again = batch(service.url, indices, seed=5, epoch=3)
    assert again.content == first.content
    assert prepared(service.url, "hit") - hits == len(indices)
    other_epoch = batch(service.url, indices, seed=5, epoch=4)  # augment again, from the cache
    check(other_epoch, source, indices, 5, 4)
    assert prepared(service.url, "hit") - hits == 2 * len(indices)
    figures = httpx.get(f"{service.url}/v1/stats", headers=ALL, timeout=10).json()["transforms"]
    assert 1 <= figures["pool"]["processes"] <= 2  # one the hanging test killed may be on its way back
    assert set(figures["served"]) == {"digest", "raising", "hanging", "shifted"}


def test_a_shard_overwritten_in_the_store_is_never_answered_from_stale_prepared_outputs(service, data):
    root, sources = data
    source = sources["mutable"]
    indices = list(range(0, 40, 3))
    before = batch(service.url, indices, dataset="mutable")
    check(before, source, indices, 0, 0)
    shard = root / "mutable" / "shards" / "part-0000.tar"
    shard.write_bytes(_bins_flipped(shard.read_bytes(), source))
    # The service learns of it as of any change in the store: a reopening (here asked for; SIGHUP,
    # or a read that finds the shard replaced). From then on, the old prepared outputs are not found.
    assert httpx.post(f"{service.url}/v1/datasets/mutable/reload", headers=ALL, timeout=30).status_code == 200
    misses = prepared(service.url, "miss")
    after = batch(service.url, indices, dataset="mutable")
    check(after, source, indices, 0, 0)
    assert after.headers["x-shardfeed-dataset-version"] != before.headers["x-shardfeed-dataset-version"]
    assert prepared(service.url, "miss") - misses == sum(i < PER_SHARD for i in indices)  # the other shards' kept


def _bins_flipped(archive: bytes, source: dict) -> bytes:
    """The shard with every ``bin`` member's bytes inverted (``source`` updated to match), its layout unchanged."""
    out = bytearray(archive)
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        for member in tar.getmembers():
            if member.name.endswith(".bin"):
                start, stop = member.offset_data, member.offset_data + member.size
                out[start:stop] = bytes(255 - b for b in out[start:stop])
                source[(int(member.name[6:12]), "bin")] = bytes(out[start:stop])
    return bytes(out)


def test_a_new_version_of_the_transform_is_never_answered_from_the_old_ones_prepared_outputs(data, tmp_path):
    root, sources = data
    indices = [1, 2, 3, 30]
    url = {"train": (root / "train").as_uri()}
    for version in ("1", "2"):
        with start_service(url, cache_dir=tmp_path / "cache", env={**ENV, "SAMPLE_TRANSFORM_VERSION": version},
                           args=["--transform", f"digest={MODULE}:digest", "--transform-processes", "1"]) as svc:
            answer = batch(svc.url, indices, seed=1)
            check(answer, sources["train"], indices, 1, 0, Digest(version))
            assert answer.headers["x-shardfeed-transform"] == f"digest;version={version}"
            assert prepared(svc.url, "miss") == len(indices)


def test_errors_name_what_is_wrong(service):
    error = _error
    assert "digest, raising, hanging, shifted" in error(batch(service.url, [0], name="resize"), 404, "unknown_transform")
    transform = {"name": "digest"}
    error(post(service.url, {"dataset": "train", "indices": [0], "transform": transform, "format": "tar"}),
          400, "unsupported_format")
    error(httpx.post(f"{service.url}/v1/batch", json={"dataset": "train", "indices": [0], "transform": transform},
                     headers=ALL), 400, "unsupported_format")
    assert "parts" in error(post(service.url, {"parts": [{"dataset": "train", "indices": [0]}], "transform": transform}),
                            400, "invalid_request")
    assert "fields" in error(batch(service.url, [0], fields=["bin"]), 400, "invalid_request")
    error(batch(service.url, [0], seed=-1), 400, "invalid_request")
    error(batch(service.url, [SAMPLES]), 404, "sample_out_of_range")
    assert "has none of transform 'shifted''s fields x (it has: bin, cls, json)" in error(
        batch(service.url, [0], name="shifted"), 404, "unknown_field")
    assert "'raising'" in error(post(service.url, {"dataset": "train", "indices": [0],
                                                   "transform": {"name": "raising"}}, headers=LIMITED), 403, "forbidden")
    assert post(service.url, {"dataset": "train", "indices": [0], "transform": transform},
                headers=LIMITED).status_code == 200


def test_a_raising_transform_fails_the_batch_naming_the_sample_or_gives_nulls(service, data):
    source = data[1]["train"]
    indices = [0, 1, 13, 2, 3]  # 13 and 3 are class 3
    message = _error(batch(service.url, indices, name="raising"), 422, "transform_failed")
    assert "sample 13 " in message and "class 3 refused" in message and "'raising'" in message
    table = pa.ipc.open_stream(batch(service.url, indices, name="raising", continue_on_error=True).content).read_all()
    assert table.column("__index__").to_pylist() == indices
    assert table.column("label").to_pylist()[2] is None and table.column("__key__")[4].as_py() is None
    for row in (0, 1, 3):
        assert table.column("head")[row].as_py() == expected(source, indices[row], 0, 0)["head"].tobytes()


def test_a_hanging_transform_answers_within_its_deadline(service):
    began = time.monotonic()
    message = _error(batch(service.url, [4, 3], name="hanging"), 422, "transform_failed")
    assert "sample 3 " in message and "timed out" in message
    answer = batch(service.url, [3, 5], name="hanging", continue_on_error=True)
    assert time.monotonic() - began < 2 * TIMEOUT + 8
    table = pa.ipc.open_stream(answer.content).read_all()
    assert table.column("head").to_pylist()[0] is None and table.column("head").to_pylist()[1] is not None


def _error(answer: httpx.Response, status: int, code: str) -> str:
    assert answer.status_code == status, answer.text
    assert answer.json()["error"]["code"] == code
    return answer.json()["error"]["message"]


def test_the_served_transforms_are_listed(service):
    listed = httpx.get(f"{service.url}/v1/transforms", headers=LIMITED, timeout=10).json()["transforms"]
    assert [t["name"] for t in listed] == ["digest", "raising", "hanging", "shifted"]
    assert listed[0] == {"name": "digest", "spec": f"{MODULE}:digest", "version": "1", "fields": ["bin", "cls"],
                         "outputs": {"head": {"dtype": "uint8", "shape": [None]},
                                     "label": {"dtype": "int64", "shape": []},
                                     "noise": {"dtype": "float32", "shape": [4]}}}


@pytest.mark.parametrize("given, said", [("Bad=x:y", "is not [a-z0-9_]"), ("a=nowhere.at_all:f", "cannot import"),
                                         ("noequals", "expected NAME=MODULE:FACTORY")])
def test_a_bad_transform_is_a_one_line_usage_error(given, said, tmp_path):
    done = subprocess.run([sys.executable, "-m", "shardfeed", "serve", "--transform", given, "--cache-dir",
                           str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("shardfeed serve: error: argument --transform") and said in last, done.stderr


def test_two_workers_each_transform_the_batches_they_receive(data, tmp_path):
    root, sources = data
    indices = list(range(0, SAMPLES, 4))
    with start_service({"train": (root / "train").as_uri()}, cache_dir=tmp_path / "cache", env=ENV, workers=2,
                       args=["--transform", f"digest={MODULE}:digest", "--transform-processes", "2"]) as svc:
        for _ in range(4):  # the port is shared: the batches reach one worker or the other
            check(batch(svc.url, indices, seed=9), sources["train"], indices, 9, 0)


def test_without_a_cache_nothing_prepared_is_kept(data, tmp_path):
    root, sources = data
    indices = [4, 8, 15]
    with start_service({"train": (root / "train").as_uri()}, cache_dir=tmp_path / "cache", cache_size="0", env=ENV,
                       args=["--transform", f"digest={MODULE}:digest", "--transform-processes", "1"]) as svc:
        for _ in range(2):
            check(batch(svc.url, indices), sources["train"], indices, 0, 0)
        assert prepared(svc.url, "hit") == 0 and prepared(svc.url, "miss") == 2 * len(indices)


def test_a_client_waits_out_a_transform_longer_than_its_progress_deadline(service):
    # The head of a transformed batch comes once the whole batch is computed (here: after the
    # 1 s deadline of the hanging sample): not taken for a stuck answer and asked again.
    with Client(service.url, token="all-9f2c", progress_timeout=0.3, backoff=Backoff(attempts=1)) as client:
        began = time.monotonic()
        batch = client.get_batch_tensors("train", [3, 5], transform="hanging", continue_on_error=True)
        assert time.monotonic() - began >= TIMEOUT
        assert batch.missing.tolist() == [True, False]
