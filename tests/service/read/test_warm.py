"""The lean warm path (``service/read/warm.py``): batches framed from RAM-held blocks, with shard
headers sent verbatim where they name the member exactly, are the same members as the
cold path sends, whatever the shards hold: PAX and GNU long names, names whose field is
not lowercase, empty members, members split across blocks, repeats, field subsets and
``__404__`` placeholders."""

from __future__ import annotations

import http.client
import json
import random
import re
import socket

import httpx
import pytest

from shardfeed.process import start_service
from shardfeed.tar import member_header, names_member

from common.datasets import odd_tar_dataset
from common.service import metrics, tar_members
from common.wait import wait_until

SAMPLES = 60


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return odd_tar_dataset(tmp_path_factory.mktemp("warm-data"), SAMPLES)


def expected(source: dict, indices, fields=None) -> list[tuple[str, bytes]]:
    out = []
    for i in indices:
        wanted = fields or [f for (j, f) in sorted(source) if j == i]
        if all((i, f) in source for f in wanted):
            out += [source[(i, f)] for f in wanted]
        else:
            out.append((f"__404__/train/{i}", b""))
    return out


def stored_order(source: dict, i: int) -> list[str]:
    return [f for f in ("bin", "cls", "seg.png") if (i, f) in source]


@pytest.mark.parametrize("memory", ["0", "64MiB"])
def test_warm_batches_are_the_exact_members_whatever_the_shards_hold(dataset, tmp_path, memory):
    url, source = dataset
    args = ["--block-size", "64KiB", "--memory-cache", memory]
    rng = random.Random(1)
    with start_service({"train": url}, cache_dir=tmp_path / "cache", args=args) as svc, \
            httpx.Client(base_url=svc.url, timeout=60) as http:
        for round_ in range(3):  # cold, then warm (RAM-held when the tier is on)
            indices = rng.choices(range(SAMPLES), k=90) + [5, 5, 5]
            resp = http.post("/v1/batch", json={"dataset": "train", "indices": indices})
            assert resp.status_code == 200, resp.text
            want = [m for i in indices for m in (source[(i, f)] for f in stored_order(source, i))]
            assert tar_members(resp.content) == want
            # A streamed answer announces its length (a tensor client's buffer is sized by it).
            assert resp.headers.get("x-shardfeed-length", resp.headers.get("content-length")) == str(len(resp.content))
            if round_ > 0:  # the GNU shard's own headers (magic "ustar  ") go out verbatim from RAM
                assert (b"ustar  \0" in resp.content) == (memory != "0")
                # Held in RAM, the stream's length is known up front (chunked otherwise).
                assert resp.headers.get("content-length") == (str(len(resp.content)) if memory != "0" else None)
            for fields in (["seg.png", "bin"], ["CLS"]):
                resp = http.post("/v1/batch", json={"dataset": "train", "indices": indices, "fields": fields,
                                                     "continue_on_error": True})
                assert resp.status_code == 200, resp.text
                assert tar_members(resp.content) == expected(source, indices, [f.lower() for f in fields])
                assert resp.headers.get("x-shardfeed-length", resp.headers.get("content-length")) == \
                    str(len(resp.content))
                if round_ > 0 and memory != "0":
                    assert resp.headers["content-length"] == str(len(resp.content))
        m = metrics(svc.url)
        assert (m["shardfeed_memory_cache_hits_total"] > 0) == (memory != "0")


def test_a_shard_header_is_sent_verbatim_only_when_it_names_the_member_exactly():
    def names(header: bytes, name: bytes, size: int) -> bool:
        return names_member(b"x" * 700 + header + b"y" * 900, 700, name, size)  # in place, at an offset

    header = member_header("k/0001.bin", 700)
    assert names(header, b"k/0001.bin", 700)
    assert not names(header, b"k/0001.bi", 700)  # a prefix of the name
    assert not names(header, b"k/0001.bin", 701)
    assert not names(member_header("k/0001.BIN", 700), b"k/0001.bin", 700)
    long = "d/" * 60 + "0001.bin"  # PAX record first: the ustar block holds a truncated name
    assert not names(member_header(long, 5)[-512:], long.encode(), 5)
    directory = bytearray(header)
    directory[156] = ord("5")
    assert not names(bytes(directory), b"k/0001.bin", 700)
    prefixed = bytearray(header)
    prefixed[345:348] = b"abc"  # ustar prefix: the name is abc/k/0001.bin
    assert not names(bytes(prefixed), b"k/0001.bin", 700)


def test_per_sample_gets_from_ram_are_exact_and_keep_auth_errors_and_metrics(dataset, tmp_path):
    url, source = dataset
    args = ["--block-size", "64KiB", "--memory-cache", "64MiB"]
    with start_service({"train": url}, cache_dir=tmp_path / "cache", args=args,
                       env={"SHARDFEED_TOKENS": "sesame"}) as svc, \
            httpx.Client(base_url=svc.url, timeout=60, headers={"Authorization": "Bearer sesame"}) as http:
        assert http.post("/v1/batch", json={"dataset": "train", "indices": list(range(SAMPLES))}).status_code == 200
        before = metrics(svc.url, token="sesame")
        for i in range(SAMPLES):
            for field in ("bin", "CLS", "seg.png"):
                resp = http.get(f"/v1/datasets/train/samples/{i}/{field}")
                if (i, field.lower()) in source:
                    assert resp.status_code == 200 and resp.content == source[(i, field.lower())][1], (i, field)
                    assert resp.headers["content-type"] == "application/octet-stream"
                else:
                    assert resp.status_code == 404 and resp.json()["error"]["code"] == "unknown_field"
        after = metrics(svc.url, token="sesame")
        # Every member but the empty ones (which take the routed path) came from RAM.
        assert after["shardfeed_memory_cache_hits_total"] - before["shardfeed_memory_cache_hits_total"] >= SAMPLES
        assert after["shardfeed_samples_served_total"] - before["shardfeed_samples_served_total"] == \
            sum(1 for (i, f) in source if f in ("bin", "cls", "seg.png"))
        assert httpx.get(f"{svc.url}/v1/datasets/train/samples/1/bin").status_code == 401
        assert http.get("/v1/datasets/train/samples/999/bin").json()["error"]["code"] == "sample_out_of_range"
        assert http.get("/v1/datasets/nope/samples/1/bin").json()["error"]["code"] == "unknown_dataset"
        assert http.get("/v1/datasets/train/samples/x1/bin").json()["error"]["code"] == "invalid_index"
        assert http.get("/v1/datasets/train/samples/1/nope").json()["error"]["code"] == "unknown_field"



def post_batch(url: str, body: dict, token: str | None = None) -> tuple[int, dict[str, str], bytes]:
    """``POST /v1/batch`` with head and body in one write, as the shardfeed clients and ``wrk``
    send it (one read on the service's side, so the protocol may answer it itself)."""
    host, port = url.removeprefix("http://").split(":")
    payload = json.dumps(body).encode()
    auth = f"authorization: Bearer {token}\r\n".encode() if token else b""
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        sock.sendall(b"POST /v1/batch HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\n%s"
                     b"content-length: %d\r\n\r\n%s" % (auth, len(payload), payload))
        resp = http.client.HTTPResponse(sock)
        resp.begin()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()


def test_warm_batches_are_answered_by_the_protocol_exact_counted_and_guarded(dataset, tmp_path):
    url, source = dataset
    args = ["--block-size", "64KiB", "--memory-cache", "64MiB", "--log-level", "debug"]
    with start_service({"train": url}, cache_dir=tmp_path / "cache", args=args,
                       env={"SHARDFEED_TOKENS": "sesame"}) as svc:
        def through_the_app(last: int) -> int:
            """Batches the app answered: it logs each one once its stream is sent (so a moment
            after the client has it); the protocol logs none. Counted once the line of the last
            batch asked for (of ``last`` samples, a count no other batch has) is there: every
            earlier batch was done before it was sent."""
            wait_until(lambda: re.search(rf"batch dataset=train samples={last}\b", svc.log()), 10, "the app's line")
            return svc.log().count("shardfeed.api batch dataset=train")

        status, _, _ = post_batch(svc.url, {"dataset": "train", "indices": list(range(SAMPLES))}, "sesame")
        assert status == 200 and through_the_app(SAMPLES) == 1  # cold: read through the app
        before = metrics(svc.url, token="sesame")
        rng = random.Random(3)
        batches = [rng.choices(range(SAMPLES), k=40) + [7, 7] for _ in range(5)]
        for indices in batches:
            status, headers, body = post_batch(svc.url, {"dataset": "train", "indices": indices}, "sesame")
            assert status == 200 and headers["content-type"] == "application/x-tar"
            assert headers["content-length"] == str(len(body)) and headers["x-shardfeed-samples"] == "42"
            assert tar_members(body) == [m for i in indices for m in (source[(i, f)] for f in stored_order(source, i))]
        after = metrics(svc.url, token="sesame")
        assert after["shardfeed_samples_served_total"] - before["shardfeed_samples_served_total"] == 5 * 42
        assert after["shardfeed_requests_total"] - before["shardfeed_requests_total"] >= 5
        assert after["shardfeed_batch_seconds_count"] - before["shardfeed_batch_seconds_count"] == 5

        # What the protocol declines, the app answers as always: errors, a missing token, placeholders.
        status, _, body = post_batch(svc.url, {"dataset": "train", "indices": [1]})
        assert status == 401 and json.loads(body)["error"]["code"] == "unauthorized"
        status, _, body = post_batch(svc.url, {"dataset": "train", "indices": [SAMPLES]}, "sesame")
        assert status == 404 and json.loads(body)["error"]["code"] == "sample_out_of_range"
        status, _, body = post_batch(svc.url, {"dataset": "train", "indices": [1], "format": "zip"}, "sesame")
        assert status == 400 and json.loads(body)["error"]["code"] == "unsupported_format"
        status, _, body = post_batch(svc.url, {"dataset": "train", "indices": [0, 1], "fields": ["seg.png"],
                                               "continue_on_error": True}, "sesame")
        assert status == 200 and tar_members(body) == expected(source, [0, 1], ["seg.png"])
        assert through_the_app(2) == 2  # the cold batch and this one: every warm batch was answered by the protocol
