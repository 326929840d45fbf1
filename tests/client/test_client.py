"""The client against a real service subprocess (and, for failure modes the service
cannot be made to show on demand, against a scripted HTTP server on a real socket)."""

from __future__ import annotations

import asyncio
import inspect
import json
import multiprocessing
import os
import pickle
import shutil
import time
from http.server import BaseHTTPRequestHandler

import httpx
import numpy as np
import pytest

from shardfeed.client import (
    MISSING, AsyncClient, Client, ShardfeedConnectionError, ShardfeedError, ShardfeedHTTPError,
)
from shardfeed.client.base import PLAN_CHUNK
from shardfeed.client.plans import PlanHandle
from shardfeed.process import free_port, start_service
from shardfeed.retry import Backoff
from shardfeed.seeds.synthetic import member_bytes

from common.httpserver import LocalServer, QuietHandler
from common.synthetic import FAST, SAMPLES, SIZES, expected, seed_synthetic, tar_of


AUTH = {"Authorization": "Bearer sesame"}
"""The service's token, for requests made without a client."""


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


class Blocking:
    """An AsyncClient whose coroutines are called as blocking functions, on one event loop."""

    def __init__(self, client: AsyncClient):
        self.client = client
        self.loop = asyncio.new_event_loop()

    def __getattr__(self, name: str):
        method = getattr(self.client, name)
        if not inspect.iscoroutinefunction(method):
            return method  # an attribute, as the router
        return lambda *args, **kwargs: self.loop.run_until_complete(method(*args, **kwargs))

    def close(self) -> None:
        self.loop.run_until_complete(self.client.aclose())
        self.loop.close()


@pytest.fixture(params=["Client", "AsyncClient"])
def twin(request):
    """Opens either client (an AsyncClient through :class:`Blocking`), closed after the test."""
    opened = []

    def open_client(url: str, **options):
        opened.append(Client(url, **options) if request.param == "Client" else Blocking(AsyncClient(url, **options)))
        return opened[-1]

    yield open_client
    for client in opened:
        client.close()


def test_the_async_client_has_every_method_of_the_blocking_one():
    def public(cls):
        return {name for name in dir(cls) if not name.startswith("_")}
    assert public(AsyncClient) - {"aclose"} == public(Client) - {"close"}


def test_both_clients_register_read_and_remove_a_dataset(service, twin):
    client = twin(service.url, token="sesame", backoff=FAST)
    info = client.register_dataset("again", (service.root / "train").as_uri())
    assert (info["name"], info["samples"]) == ("again", SAMPLES)
    assert client.get_batch("again", [7, 1]) == [expected(7), expected(1)]
    assert client.get_field("again", 7, "bin") == member_bytes(0, 7, "bin", SIZES)
    client.remove_dataset("again")
    with pytest.raises(ShardfeedHTTPError) as err:
        client.info("again")
    assert err.value.code == "unknown_dataset"


def test_both_clients_register_read_and_delete_a_plan(service, twin):
    client = twin(service.url, token="sesame", backoff=FAST)
    plan = client.register_plan("train", {"kind": "indices", "indices": list(range(40)), "complete": True})
    got = client.plan("train", plan["id"])
    assert (got["id"], got["dataset"], got["samples"]) == (plan["id"], "train", 40)
    client.delete_plan("train", plan["id"])
    with pytest.raises(ShardfeedHTTPError) as err:
        client.plan("train", plan["id"])
    assert err.value.status == 404


def test_both_clients_register_an_indices_plan_too_long_for_one_body_in_chunks(service, twin):
    client = twin(service.url, token="sesame", backoff=FAST)
    # 3-digit indices, 4 bytes a position in JSON: 2.4 MB, past the service's 2 MiB body limit.
    order = (np.arange(6 * PLAN_CHUNK) * 7) % 200 + 100
    plans = f"{service.url}/v1/datasets/train/plans"
    whole = httpx.post(plans, json={"kind": "indices", "indices": order.tolist()}, headers=AUTH, timeout=60)
    assert whole.status_code == 413 and whole.json()["error"]["code"] == "body_too_large"
    plan = client.register_plan("train", {"kind": "indices", "indices": order, "share": 0.5})
    got = client.plan("train", plan["id"])
    assert (got["samples"], got["complete"], got["share"]) == (len(order), True, 0.5)
    held = httpx.get(f"{service.url}/v1/internal/plans/train/{plan['id']}/order", headers=AUTH, timeout=60)
    assert np.array_equal(np.frombuffer(held.content, dtype="<i8"), order)  # every chunk, in order
    client.delete_plan("train", plan["id"])
    # A chunk the service refuses: the error is raised and the part registered is deleted.
    def held_ids():
        return {p["id"] for p in httpx.get(plans, headers=AUTH, timeout=10).json()}
    before = held_ids()
    with pytest.raises(ShardfeedHTTPError) as err:
        client.register_plan("train", {"kind": "indices", "indices": [*order[:PLAN_CHUNK + 5].tolist(), SAMPLES]})
    assert err.value.code == "sample_out_of_range"
    assert held_ids() == before


def test_a_plan_handle_registers_an_order_of_numpy_indices_once(client):
    handle = PlanHandle(client, "train", ["cls"])
    order = np.arange(SAMPLES)[::-1]
    handle.ensure({"kind": "indices", "indices": order})
    registered = handle.id
    handle.ensure({"kind": "indices", "indices": order.copy()})  # the same order: nothing to send
    assert handle.id == registered is not None
    assert client.plan("train", registered)["samples"] == SAMPLES
    handle.drop()


def test_both_clients_read_a_batch_as_tensors_byte_for_byte(service, twin):
    client = twin(service.url, token="sesame", backoff=FAST)
    indices = [5, 3, 3, 299, 0]
    batch = client.get_batch_tensors("train", indices, ["cls", "bin"])
    for field in ("cls", "bin"):
        assert [bytes(v.numpy()) for v in batch[field]] == [expected(i)[field] for i in indices]
    assert batch.keys == [expected(i)["__key__"] for i in indices]
    assert batch.indices.tolist() == indices
    assert len(client.get_batch_tensors("train", [])) == 0


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

class Scripted(LocalServer):
    """Answers each POST /v1/batch with the next scripted behaviour; records the bodies."""

    def __init__(self, script: list[str]):
        self.script = list(script)
        self.bodies: list[dict] = []
        self.times: list[float] = []
        super().__init__(Handler)


class Handler(QuietHandler):
    def do_POST(self) -> None:
        body, action = self.request_and_action("ok")
        if action in ("429", "503"):
            self.send_json(int(action), {"error": {"code": "busy", "message": "try later"}}, retry_after="0.3")
            return
        data = tar_of(body["indices"])
        if action == "short":  # a whole answer, but of three members only
            data = data[:3 * 1024]
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

    def request_and_action(self, default):
        """The request's JSON body (recorded), and what the script says to do with it."""
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.bodies.append(body)
        self.server.times.append(time.monotonic())
        return body, self.server.script.pop(0) if self.server.script else default

    def send_json(self, status: int, doc: dict, retry_after: str | None = None) -> None:
        data = json.dumps(doc).encode()
        self.send_response(status)
        if retry_after is not None:
            self.send_header("Retry-After", retry_after)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
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


def test_an_answer_that_ends_short_is_resumed_as_samples_and_asked_again_whole_as_tensors(twin):
    server = Scripted(["short", "ok", "short"])
    try:
        client = twin(server.url, backoff=FAST)
        got = client.get_batch("d", list(range(10)), fields=["cls"])
        batch = client.get_batch_tensors("d", list(range(10)), fields=["cls"])
    finally:
        server.shutdown()
    assert [s["cls"] for s in got] == [b"%d" % i for i in range(10)]
    assert [bytes(v.numpy()) for v in batch["cls"]] == [b"%d" % i for i in range(10)]
    assert [b["indices"] for b in server.bodies] == [list(range(10)), list(range(3, 10))] + [list(range(10))] * 2


class Registrar(Handler):
    """``POST /v1/datasets``: 202 (indexing) as many times as scripted, then the dataset."""

    def do_POST(self) -> None:
        body, busy = self.request_and_action(None)
        if busy is None:
            self.send_json(200, {"dataset": body})
        else:
            self.send_json(202, {"registering": {"shards": busy}})


def test_both_clients_report_registering_until_the_dataset_is_served_or_time_is_up(twin, monkeypatch):
    monkeypatch.setattr("shardfeed.client.sync.REGISTER_POLL", 0.01)
    monkeypatch.setattr("shardfeed.client.aio.REGISTER_POLL", 0.01)
    server = Scripted([1, 2, 3])
    server.RequestHandlerClass = Registrar
    try:
        client = twin(server.url, backoff=FAST)
        progress = []
        info = client.register_dataset("d", "s3://b/d", on_progress=progress.append, timeout=60)
        assert progress == [{"shards": 1}, {"shards": 2}, {"shards": 3}]
        assert info == {"name": "d", "url": "s3://b/d"}
        server.script = [4] * 1000  # indexing for ever
        with pytest.raises(TimeoutError, match="not registered within 0.05 s"):
            client.register_dataset("d", "s3://b/d", timeout=0.05)
    finally:
        server.shutdown()


def test_when_one_part_fails_the_answers_of_the_others_are_closed_and_their_connections_freed(twin):
    owner, failing = Scripted([]), Scripted(["503"])
    try:
        client = twin(owner.url, backoff=Backoff(attempts=1), max_connections=2, timeout=5)
        client.router.load("d", {"version": "1", "starts": [0, 5], "urls": [owner.url, failing.url],
                                 "owner": [0, 1]})
        with pytest.raises(ShardfeedHTTPError) as err:
            client.get_batch_tensors("d", list(range(10)), fields=["cls"])
        assert err.value.status == 503
        # Both parts at once again: each needs one of the two connections (a leaked one: no
        # free connection within the 5 s timeout).
        batch = client.get_batch_tensors("d", list(range(10)), fields=["cls"])
        assert [bytes(v.numpy()) for v in batch["cls"]] == [b"%d" % i for i in range(10)]
        assert [len(server.bodies) for server in (owner, failing)] == [2, 2]
    finally:
        owner.shutdown()
        failing.shutdown()
