"""The client against a real service subprocess (and, for failure modes the service
cannot be made to show on demand, against a scripted HTTP server on a real socket)."""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import pickle
import shutil
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from shardfeed.client import (
    MISSING, AsyncClient, Client, ShardfeedConnectionError, ShardfeedError, ShardfeedHTTPError,
)
from shardfeed.process import free_port, start_service
from shardfeed.retry import Backoff
from shardfeed.seeds.synthetic import member_bytes

from common.synthetic import FAST, SAMPLES, SIZES, expected, seed_synthetic, tar_of


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    root = tmp_path_factory.mktemp("client")
    url = seed_synthetic(root / "train")
    shutil.copytree(root / "train", root / "broken")
    with start_service({"train": url, "broken": (root / "broken").as_uri()}, cache_dir=root / "cache",
                       env={"SHARDFEED_TOKENS": "sesame"}) as svc:
        svc.root = root
        yield svc


@pytest.fixture
def client(service):
    with Client(service.url, token="sesame", backoff=FAST) as c:
        yield c


def test_batch_returns_the_source_samples_in_request_order_including_repeats(client):
    indices = [5, 3, 3, 299, 0, 5]
    assert client.get_batch("train", indices) == [expected(i) for i in indices]


def test_fields_select_and_order_the_members(client):
    got = client.get_batch("train", [7, 8], fields=["cls", "bin"])
    assert got == [expected(i, ("cls", "bin")) for i in (7, 8)]
    assert list(got[0]) == ["__key__", "__index__", "cls", "bin"]


def test_get_and_get_field_match_the_source(client):
    assert client.get("train", 42) == expected(42)
    assert client.get("train", 42, fields=["json"]) == expected(42, ("json",))
    assert client.get_field("train", 42, "bin") == member_bytes(0, 42, "bin", SIZES)
    assert client.info("train")["samples"] == SAMPLES
    assert {d["name"] for d in client.datasets()} == {"train", "broken"}


def test_iter_batch_streams_a_large_batch_sample_by_sample(client):
    indices = list(range(SAMPLES))[::-1] * 3
    stream = client.iter_batch("train", indices, fields=["bin"])
    first = next(stream)  # handed out before the rest of the response is read
    assert first == expected(SAMPLES - 1, ("bin",))
    assert [s["__index__"] for s in stream] == indices[1:]


def test_async_client_returns_the_same_samples(service):
    async def main():
        async with AsyncClient(service.url, token="sesame") as c:
            batch = await c.get_batch("train", [9, 1, 9])
            streamed = [s async for s in c.iter_batch("train", [4, 2], fields=["cls"])]
            one = await c.get("train", 3)
            info = await c.info("train")
            return batch, streamed, one, info

    batch, streamed, one, info = asyncio.run(main())
    assert batch == [expected(i) for i in (9, 1, 9)]
    assert streamed == [expected(i, ("cls",)) for i in (4, 2)]
    assert one == expected(3) and info["samples"] == SAMPLES


def test_client_errors_carry_the_service_code_and_message_and_are_not_retried(client):
    began = time.monotonic()
    with pytest.raises(ShardfeedHTTPError) as err:
        client.get_batch("nope", [1])
    assert (err.value.status, err.value.code) == (404, "unknown_dataset")
    assert "no dataset named 'nope'" in str(err.value)
    with pytest.raises(ShardfeedHTTPError, match="out of range") as err:
        client.get_batch("train", [SAMPLES])
    with pytest.raises(ShardfeedHTTPError, match="unknown field 'nope'"):
        client.get("train", 1, fields=["nope"])
    assert time.monotonic() - began < 1.0  # no backoff spent on a 4xx


def test_token_is_required_and_read_from_the_environment(service, monkeypatch):
    with pytest.raises(ShardfeedHTTPError) as err:
        Client(service.url).info("train")
    assert err.value.status == 401
    monkeypatch.setenv("SHARDFEED_TOKEN", "sesame")
    assert Client(service.url).info("train")["samples"] == SAMPLES


def test_continue_on_error_turns_an_unreadable_sample_into_a_placeholder(service, client):
    shard = max((service.root / "broken").glob("*.tar"))  # holds the last samples
    os.truncate(shard, 1000)
    got = client.get_batch("broken", [0, SAMPLES - 1, 1], continue_on_error=True)
    assert got == [expected(0), {"__key__": None, "__index__": SAMPLES - 1, MISSING: True}, expected(1)]
    with pytest.raises(ShardfeedHTTPError) as err:
        client.get_batch("broken", [0, SAMPLES - 1])
    assert err.value.status == 503


def test_failover_when_one_of_two_urls_is_down(service):
    dead = f"http://127.0.0.1:{free_port()}"
    with Client([dead, service.url], token="sesame", backoff=FAST) as c:
        for start in range(0, 200, 20):
            indices = list(range(start, start + 20))
            assert c.get_batch("train", indices) == [expected(i) for i in indices]
        assert {c.endpoints.pick() for _ in range(4)} == {service.url}  # the dead one is skipped


def batch_requests(url: str) -> int:
    text = Client(url, token="sesame")._session().get(f"{url}/metrics").text
    return int(sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("shardfeed_requests_total{") and 'route="batch"' in line))


@pytest.mark.slow
def test_load_is_spread_over_two_services_and_fails_over_when_one_stops(service):
    root = service.root
    with start_service({"train": (root / "train").as_uri()}, cache_dir=root / "cache2",
                       env={"SHARDFEED_TOKENS": "sesame"}) as second:
        before = batch_requests(service.url)
        c = Client([service.url, second.url], token="sesame", backoff=FAST)
        for start in range(0, 100, 10):
            assert c.get_batch("train", range(start, start + 10)) == [expected(i) for i in range(start, start + 10)]
        assert batch_requests(service.url) - before == batch_requests(second.url) == 5
    for start in range(100, 200, 10):  # the second one is gone now
        assert c.get_batch("train", range(start, start + 10)) == [expected(i) for i in range(start, start + 10)]


def test_unreachable_service_raises_a_connection_error_naming_the_url():
    dead = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(ShardfeedConnectionError, match=dead.replace(".", r"\.")) as err:
        Client(dead, backoff=FAST).get_batch("train", [1])
    assert err.value.connect


def test_bad_arguments_are_refused_with_a_clear_message():
    with pytest.raises(ValueError, match="must start with http"):
        Client("localhost:8080")
    with pytest.raises(TypeError, match="integers"):
        Client("http://127.0.0.1:1").get_batch("train", ["a"])
    assert Client("http://127.0.0.1:1").get_batch("train", []) == []


def _fetch_in_child(client: Client, out) -> None:
    out.put(client.get_batch("train", [1, 2]))


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_a_client_used_before_fork_or_pickled_works_in_a_child_process(client, method):
    client.get_batch("train", [0])  # the parent now holds open connections
    state = pickle.loads(pickle.dumps(client))
    assert state._http is None
    ctx = multiprocessing.get_context(method)
    out = ctx.Queue()
    child = ctx.Process(target=_fetch_in_child, args=(client, out))
    child.start()
    got = out.get(timeout=60)
    child.join(timeout=30)
    assert child.exitcode == 0
    assert got == [expected(1), expected(2)]
    assert client.get_batch("train", [3]) == [expected(3)]  # the parent's pool still works


# -- failure modes on demand: a scripted server on a real socket ------------------------------

class Scripted(ThreadingHTTPServer):
    """Answers each POST /v1/batch with the next scripted behaviour; records the bodies."""

    daemon_threads = True

    def __init__(self, script: list[str]):
        self.script = list(script)
        self.bodies: list[dict] = []
        self.times: list[float] = []
        super().__init__(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:
        pass

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.bodies.append(body)
        self.server.times.append(time.monotonic())
        action = self.server.script.pop(0) if self.server.script else "ok"
        if action in ("429", "503"):
            error = json.dumps({"error": {"code": "busy", "message": "try later"}}).encode()
            self.send_response(int(action))
            self.send_header("Retry-After", "0.3")
            self.send_header("Content-Length", str(len(error)))
            self.end_headers()
            self.wfile.write(error)
            return
        data = tar_of(body["indices"])
        self.send_response(200)
        self.send_header("Content-Type", "application/x-tar")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if action == "cut":  # three members, then the connection drops
            self.wfile.write(data[:3 * 1024])
            self.wfile.flush()
            self.close_connection = True
            return
        self.wfile.write(data)


def test_429_waits_for_retry_after_and_503_is_retried():
    server = Scripted(["429", "503"])
    try:
        got = Client(server.url, backoff=Backoff(attempts=4, base=0.01, cap=5)).get_batch("d", [1, 2])
    finally:
        server.shutdown()
    assert [s["cls"] for s in got] == [b"1", b"2"]
    assert len(server.bodies) == 3
    assert server.times[1] - server.times[0] >= 0.25  # Retry-After: 0.3 honoured


def test_a_stream_broken_midway_is_resumed_with_only_the_missing_samples():
    server = Scripted(["cut"])
    try:
        got = Client(server.url, backoff=FAST).get_batch("d", list(range(10)), fields=["cls"])
    finally:
        server.shutdown()
    assert [s["__index__"] for s in got] == list(range(10))
    assert [s["cls"] for s in got] == [b"%d" % i for i in range(10)]
    assert server.bodies[0]["indices"] == list(range(10))
    assert server.bodies[1]["indices"] == list(range(3, 10))


def test_a_server_that_is_not_shardfeed_gives_a_clear_error():
    server = Scripted([])
    server.RequestHandlerClass = type("Garbage", (Handler,), {"do_POST": _garbage})
    try:
        with pytest.raises(ShardfeedError, match="malformed batch response"):
            Client(server.url, backoff=FAST).get_batch("d", [1])
    finally:
        server.shutdown()


def _garbage(handler: BaseHTTPRequestHandler) -> None:
    handler.rfile.read(int(handler.headers["Content-Length"]))
    data = b"<html>hello</html>" * 100
    handler.send_response(200)
    handler.send_header("Content-Length", str(len(data)))
    handler.end_headers()
    handler.wfile.write(data)
