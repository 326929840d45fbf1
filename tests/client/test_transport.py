"""The clients' batch transport (client/transport/: sync.py, blocking, and aio.py, asyncio,
over one HTTP/1.1 core, shardfeed/http11.py): kept-alive connections against the real
service, and, for what a service cannot be made to do on demand (chunked or
close-delimited answers, connections closed under a kept request, garbage, stalls), a
scripted server on a real socket. What both transports must do alike is checked on both,
through ``each_client``."""

from __future__ import annotations

import asyncio
import contextlib
import json
import pickle
import os
import queue
import signal
import socket
import threading
import time
from collections.abc import Callable

import pytest
import torch

from shardfeed.client import AsyncClient, Client, ShardfeedConnectionError
from shardfeed.client.transport.aio import AsyncPool
from shardfeed.http11 import HeadReader, body_of
from shardfeed.client.transport.sync import Pool
from shardfeed.process import child_pids, start_service
from shardfeed.retry import Backoff

from common.synthetic import FAST, expected, seed_synthetic, tar_of
from common.workers import routed_client, routed_service

ONE_TRY = Backoff(attempts=1)


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    root = tmp_path_factory.mktemp("wire")
    with start_service({"train": seed_synthetic(root / "train", samples=100)}, cache_dir=root / "cache") as svc:
        yield svc


class BlockingDriver:
    """A Client, as the tests below drive either client."""

    def __init__(self, url: str, **options):
        self.client = Client(url, **options)

    def get_batch(self, dataset: str, indices: list[int]) -> list[dict]:
        return self.client.get_batch(dataset, indices)

    def kept_ports(self) -> list[int]:
        """The local ports of the connections kept for the next batch."""
        return [sock.getsockname()[1] for socks in self.client._wire()._idle.values() for sock in socks]

    def close(self) -> None:
        self.client.close()


class TensorDriver(BlockingDriver):
    """A Client's tensor output (``get_batch_tensors``: the body read into one buffer), its
    samples turned back into dicts of ``bytes`` to compare."""

    def get_batch(self, dataset: str, indices: list[int]) -> list[dict]:
        return as_dicts(self.client.get_batch_tensors(dataset, indices))


def as_dicts(batch) -> list[dict]:
    """A tensor batch's samples as the bytes output gives them."""
    return [{k: bytes(v.numpy()) if torch.is_tensor(v) else v for k, v in s.items()} for s in batch]


class AsyncDriver:
    """An AsyncClient, driven from blocking test code on an event loop of its own thread."""

    def __init__(self, url: str, **options):
        self.client = AsyncClient(url, **options)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def get_batch(self, dataset: str, indices: list[int]) -> list[dict]:
        return self._run(self.client.get_batch(dataset, indices))

    def kept_ports(self) -> list[int]:
        async def ports():  # the pool of the client's loop
            return [conn.writer.get_extra_info("sockname")[1]
                    for conns in self.client._wire()._idle.values() for conn in conns]
        return self._run(ports())

    def close(self) -> None:
        self._run(self.client.aclose())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()
        self.loop.close()

    def _run(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result()


class AsyncTensorDriver(AsyncDriver):
    """An AsyncClient's tensor output (each piece of the body copied into one buffer)."""

    def get_batch(self, dataset: str, indices: list[int]) -> list[dict]:
        return as_dicts(self._run(self.client.get_batch_tensors(dataset, indices)))


@pytest.fixture(params=[BlockingDriver, AsyncDriver, TensorDriver, AsyncTensorDriver],
                ids=["Client", "AsyncClient", "tensors", "async-tensors"])
def each_client(request):
    """Opens a client of any kind (the tensor output included), closed at the end of the test."""
    drivers = []

    def open_client(url: str, **options):
        drivers.append(request.param(url, **options))
        return drivers[-1]

    yield open_client
    for driver in drivers:
        driver.close()


def test_batches_go_over_one_kept_alive_connection_and_hold_the_source(service, each_client):
    client = each_client(service.url, backoff=ONE_TRY, route=False)
    ports = set()
    for start in range(0, 100, 20):
        indices = list(range(start, start + 20))[::-1]
        assert client.get_batch("train", indices) == [expected(i) for i in indices]
        (kept,) = client.kept_ports()
        ports.add(kept)
    assert len(ports) == 1
    assert "_pool" not in pickle.loads(pickle.dumps(client.client)).__dict__  # sockets never travel


@pytest.mark.slow
def test_routed_parts_go_to_their_owners_on_threads_kept_for_the_process(tmp_path):
    with routed_client(tmp_path, backoff=ONE_TRY, max_connections=2) as client:
        for start in range(4):
            indices = list(range(start, 1000, 4))[::-1]  # every batch spans every shard
            assert client.get_batch("train", indices) == [expected(i) for i in indices]
        parts = [t for t in threading.enumerate() if t.name.startswith("shardfeed-part")]
        assert 1 <= len(parts) <= 2  # kept after the batches, at most max_connections of them


def test_a_service_without_owners_is_not_asked_again_for_its_routing_table(service):
    with Client(service.url, backoff=ONE_TRY) as client:
        client.router.refresh = 0.0  # an expired table would be fetched again at once
        client.load_routing("train")  # a single service's table: no owners
        client.close()
        for start in range(0, 100, 20):
            assert client.get_batch("train", [start]) == [expected(start)]
        assert client._http is None  # no httpx session: no request for the table was made


def test_an_error_answer_leaves_the_connection_usable(service, each_client):
    client = each_client(service.url, backoff=ONE_TRY, route=False)
    with pytest.raises(Exception, match="404"):
        client.get_batch("nope", [1])
    (kept,) = client.kept_ports()
    assert client.get_batch("train", [3]) == [expected(3)]
    assert client.kept_ports() == [kept]


class RawServer:
    """Accepts connections on loopback; ``answer(sock, n, body)`` answers the n-th request
    (counted over all connections), whose JSON body it gets; returning False closes the
    connection. Records how many connections and requests it saw."""

    def __init__(self, answer: Callable[[socket.socket, int, bytes], bool]):
        self.answer = answer
        self.connections = 0
        self.requests = 0
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self.listener.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._serve, args=(sock,), daemon=True).start()

    def _serve(self, sock: socket.socket) -> None:
        with sock, contextlib.suppress(ConnectionError):  # a client may drop a connection it had no use for
            data = b""
            while True:
                while b"\r\n\r\n" not in data:
                    chunk = sock.recv(65536)
                    if not chunk:
                        return
                    data += chunk
                head, _, data = data.partition(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
                while len(data) < length:
                    data += sock.recv(65536)
                body, data = data[:length], data[length:]
                self.requests += 1
                if not self.answer(sock, self.requests, body):
                    return

    def close(self) -> None:
        self.listener.close()


def indices_of(body: bytes) -> list[int]:
    return json.loads(body)["indices"]


def send_tar(sock: socket.socket, body: bytes) -> None:
    """Answer a batch request with its samples, framed by Content-Length."""
    data = tar_of(indices_of(body))
    sock.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(data) + data)


def read_answer(data: bytes, step: int) -> tuple[bytes, bool]:
    """Feed an answer to the shared parsers ``step`` bytes at a time, as a driver would:
    its body, and whether the connection could carry another request."""
    head, body, out = HeadReader(), None, b""
    for at in range(0, len(data), step):
        piece = data[at:at + step]
        if body is not None:
            out += b"".join(body.feed(piece))
        elif answer := head.feed(piece):
            body = body_of(answer[0])
            out += b"".join(body.feed(answer[1])) if answer[1] else b""
    assert body.done
    return out, body.reusable


@pytest.mark.parametrize("step", [1, 2, 3, 5, 64, 1 << 20])
def test_the_shared_framing_reads_answers_split_anywhere(step):
    chunked = (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3;x=y\r\nabc\r\nA\r\n0123456789\r\n"
               b"0\r\nX-Trailer: 1\r\n\r\n")
    assert read_answer(chunked, step) == (b"abc0123456789", True)
    assert read_answer(chunked + b"extra", step) == (b"abc0123456789", False)  # out of step
    sized = b"HTTP/1.1 200 OK\r\nContent-Length: 13\r\n\r\nabc0123456789"
    assert read_answer(sized, step) == (b"abc0123456789", True)
    assert read_answer(sized.replace(b"OK", b"OK\r\nConnection: close"), step) == (b"abc0123456789", False)
    assert read_answer(sized.replace(b"1.1", b"1.0"), step) == (b"abc0123456789", False)


def test_chunked_answers_in_odd_pieces_with_extensions_and_trailers_are_read_whole(each_client):
    def answer(sock, n, body):
        data = tar_of(indices_of(body))
        pieces, at = [], 0
        for size in (1, 511, 700, 3, 5000):
            pieces.append(b"%x;ext=1\r\n" % len(data[at:at + size]) + data[at:at + size] + b"\r\n")
            at += size
        pieces.append(b"%X\r\n" % len(data[at:]) + data[at:] + b"\r\n0\r\nX-Trailer: 1\r\n\r\n")
        sock.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        for piece in pieces:  # the pieces arrive separately, so chunk sizes split across reads too
            sock.sendall(piece)
            time.sleep(0.001)
        return True

    server = RawServer(answer)
    try:
        client = each_client(server.url, backoff=ONE_TRY, route=False)
        for _ in range(3):
            got = client.get_batch("d", list(range(40)))
            assert [s["cls"] for s in got] == [b"%d" % i for i in range(40)]
        assert server.connections == 1  # the chunked answers were read to their end, then reused
    finally:
        server.close()


@pytest.mark.parametrize("announced", [b"10", b"bogus", b"99999999"])
def test_an_answer_whose_announced_length_is_wrong_is_read_whole(each_client, announced):
    # X-Shardfeed-Length is an estimate: too short (the tensor output's buffer grows), not a
    # number (ignored), far too long (the buffer is only partly used).
    def answer(sock, n, body):
        data = tar_of(indices_of(body))
        sock.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nX-Shardfeed-Length: " + announced +
                     b"\r\n\r\n%x\r\n" % len(data) + data + b"\r\n0\r\n\r\n")
        return True

    server = RawServer(answer)
    try:
        client = each_client(server.url, backoff=ONE_TRY, route=False)
        assert [s["cls"] for s in client.get_batch("d", list(range(30)))] == [b"%d" % i for i in range(30)]
    finally:
        server.close()


def test_an_answer_ended_by_closing_the_connection_is_read_whole(each_client):
    def answer(sock, n, body):
        sock.sendall(b"HTTP/1.0 200 OK\r\nContent-Type: application/x-tar\r\n\r\n" + tar_of(indices_of(body)))
        return False

    server = RawServer(answer)
    try:
        client = each_client(server.url, backoff=ONE_TRY, route=False)
        for _ in range(2):
            assert [s["cls"] for s in client.get_batch("d", [5, 1])] == [b"5", b"1"]
        assert server.connections == 2
    finally:
        server.close()


def test_a_kept_connection_closed_under_a_request_is_replaced_at_once_without_a_retry(each_client):
    def answer(sock, n, body):
        if n == 2:  # the second request, on the kept connection: close without answering
            return False
        send_tar(sock, body)
        return True

    server = RawServer(answer)
    try:
        client = each_client(server.url, backoff=ONE_TRY, route=False)  # no retry allowed
        assert [s["cls"] for s in client.get_batch("d", [1])] == [b"1"]
        assert [s["cls"] for s in client.get_batch("d", [2])] == [b"2"]
        assert (server.connections, server.requests) == (2, 3)
    finally:
        server.close()


def test_a_kept_connection_the_server_closed_while_idle_is_not_used(each_client):
    def answer(sock, n, body):
        send_tar(sock, body)
        return False  # closes after answering, without saying so

    server = RawServer(answer)
    try:
        client = each_client(server.url, backoff=ONE_TRY, route=False)
        for i in range(3):
            assert [s["cls"] for s in client.get_batch("d", [i])] == [b"%d" % i]
            time.sleep(0.05)  # the close reaches the client before the next request
        assert (server.connections, server.requests) == (3, 3)
    finally:
        server.close()


@pytest.mark.parametrize("garbage", [b"hello\r\n\r\n", b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n",
                                     b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
                                     b"HTTP/1.1 200 OK\r\nContent-Length: 99999\r\n\r\n" + bytes(1024),
                                     b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n",
                                     b"HTTP/1.1 200 OK\r\nX-Long: " + b"a" * (70 << 10),
                                     b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nabcdeXY"])
def test_a_garbled_or_cut_answer_is_a_connection_error_naming_the_url(garbage, each_client):
    def answer(sock, n, body):
        sock.sendall(garbage)
        return False

    server = RawServer(answer)
    try:
        with pytest.raises(ShardfeedConnectionError, match=server.url.replace(".", r"\.")) as err:
            each_client(server.url, backoff=FAST, route=False).get_batch("d", [1])
        assert not err.value.connect
        assert server.requests == FAST.attempts  # retried as a broken stream, then given up
    finally:
        server.close()


def test_unasked_bytes_on_an_idle_connection_keep_it_from_carrying_the_next_request(each_client):
    read, sent = queue.Queue(), queue.Queue()

    def answer(sock, n, body):
        send_tar(sock, body)
        read.get(timeout=10)  # the client has read the answer whole: its connection is idle
        # A server may answer a connection it is about to drop, unasked: that answer
        # must never be taken for the next request's.
        sock.sendall(b"HTTP/1.1 408 Request Timeout\r\nContent-Length: 0\r\n\r\n")
        sent.put(True)
        return True

    server = RawServer(answer)
    try:
        client = each_client(server.url, backoff=ONE_TRY, route=False)
        for i in range(3):
            assert [s["cls"] for s in client.get_batch("d", [i])] == [b"%d" % i]
            read.put(True)
            sent.get(timeout=10)
            time.sleep(0.05)  # the unasked answer reaches the client before the next request
        assert (server.connections, server.requests) == (3, 3)
    finally:
        server.close()


def stall(sock: socket.socket, body: bytes, part: int, closes: queue.Queue) -> bool:
    """Send the head of the answer and ``part`` bytes of its body, then nothing; note when
    the client closes the connection."""
    data = tar_of(indices_of(body))
    sock.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(data) + data[:part])
    try:
        sock.recv(1)
    except OSError:
        pass
    closes.put(True)
    return False


@pytest.mark.parametrize("part", [0, 100], ids=["before-the-body", "mid-sample"])
def test_a_stalled_answer_times_out_and_its_connection_is_closed(each_client, part):
    closes = queue.Queue()
    server = RawServer(lambda sock, n, body: stall(sock, body, part, closes))
    try:
        client = each_client(server.url, timeout=0.3, backoff=ONE_TRY, route=False)
        with pytest.raises(ShardfeedConnectionError, match="TimeoutError: timed out") as err:
            client.get_batch("d", [1, 2])
        assert not err.value.connect
        assert closes.get(timeout=10)
    finally:
        server.close()


def test_a_cancelled_or_abandoned_async_batch_closes_its_connection_and_frees_its_slot():
    closes = queue.Queue()

    def answer(sock, n, body):
        if len(indices_of(body)) == 40:  # half the samples, then nothing
            return stall(sock, body, 20 * 1024, closes)
        send_tar(sock, body)
        return True

    async def rest(samples):
        return [s async for s in samples]

    async def main():
        async with AsyncClient(server.url, backoff=ONE_TRY, route=False, max_connections=1) as client:
            samples = client.iter_batch("d", list(range(40)))
            assert (await samples.__anext__())["cls"] == b"0"  # mid-stream
            reading = asyncio.create_task(rest(samples))
            await asyncio.sleep(0.01)
            reading.cancel()
            with pytest.raises(asyncio.CancelledError):
                await reading
            assert await asyncio.to_thread(closes.get, timeout=10)
            async with contextlib.aclosing(client.iter_batch("d", list(range(40)))) as samples:
                async for _ in samples:
                    break  # the consumer stops early
            assert await asyncio.to_thread(closes.get, timeout=10)
            # Neither half-read connection went back to the pool, and both slots came back.
            assert not any(client._wire()._idle.values())
            assert [s["cls"] for s in await client.get_batch("d", [7])] == [b"7"]
            assert len(client._wire()._idle[next(iter(client._wire()._idle))]) == 1

    server = RawServer(answer)
    try:
        asyncio.run(main())
        assert (server.connections, server.requests) == (3, 3)
    finally:
        server.close()


def test_connections_in_use_are_bounded_and_a_request_beyond_waits_then_fails():
    def answer(sock, n, body):
        send_tar(sock, body)
        return True

    server = RawServer(answer)
    pool = Pool(timeout=0.3, connect_timeout=1, max_connections=1, verify=True)
    try:
        held = pool.post(server.url, "/v1/batch", b'{"indices":[1]}', {})  # in use until closed
        began = time.monotonic()
        with pytest.raises(ShardfeedConnectionError, match="no free connection"):
            pool.post(server.url, "/v1/batch", b'{"indices":[2]}', {})
        assert time.monotonic() - began >= 0.25
        assert held.read(1 << 20) == tar_of([1])
        held.close()
        response = pool.post(server.url, "/v1/batch", b'{"indices":[3]}', {})
        assert response.status == 200 and response.read(1 << 20) == tar_of([3])
        response.close()
        assert server.connections == 1
    finally:
        pool.close()
        server.close()


def test_an_unreachable_url_is_a_connect_error(each_client):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    with pytest.raises(ShardfeedConnectionError, match=dead.replace(".", r"\.")) as err:
        each_client(dead, backoff=FAST, route=False).get_batch("d", [1])
    assert err.value.connect


def test_async_connections_in_use_are_bounded_and_a_request_beyond_waits_then_fails():
    def answer(sock, n, body):
        send_tar(sock, body)
        return True

    async def main():
        pool = AsyncPool(timeout=0.3, connect_timeout=1, max_connections=1, verify=True)
        held = await pool.post(server.url, "/v1/batch", b'{"indices":[1]}', {})  # in use until closed
        with pytest.raises(ShardfeedConnectionError, match=r"no free connection within 0.3 s \(1 in use\)"):
            await pool.post(server.url, "/v1/batch", b'{"indices":[2]}', {})
        assert await held.read(1 << 20) == tar_of([1])
        held.close()
        response = await pool.post(server.url, "/v1/batch", b'{"indices":[3]}', {})
        assert response.status == 200 and await response.read(1 << 20) == tar_of([3])
        response.close()
        pool.close()

    server = RawServer(answer)
    try:
        asyncio.run(main())
        assert server.connections == 1
    finally:
        server.close()


class SilentFirst:
    """A TCP relay to ``target`` (the real service) whose first connection takes the request and
    never answers, as a worker stuck behind a lost store read would; later ones are relayed."""

    def __init__(self, target: str):
        self.target = ("127.0.0.1", int(target.rsplit(":", 1)[1]))
        self.connections = 0
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                sock, _ = self.listener.accept()
                self.connections += 1
                if self.connections == 1:
                    threading.Thread(target=sock.recv, args=(65536,), daemon=True).start()  # held, unanswered
                    continue
                upstream = socket.create_connection(self.target)
                for a, b in ((sock, upstream), (upstream, sock)):
                    threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(source: socket.socket, sink: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                sink.sendall(data)
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        self.listener.close()


def test_a_batch_whose_answer_goes_silent_is_asked_again_after_the_progress_deadline(service, each_client):
    gate = SilentFirst(service.url)
    try:
        client = each_client(gate.url, timeout=30, progress_timeout=1, backoff=FAST, route=False)
        began = time.monotonic()
        assert client.get_batch("train", [5, 3, 9]) == [expected(i) for i in (5, 3, 9)]
        assert 0.9 < time.monotonic() - began < 10  # asked again after 1 s, not after the 30 s timeout
        assert gate.connections == 2
    finally:
        gate.close()


def test_the_progress_deadline_must_be_positive():
    with pytest.raises(ValueError, match="progress_timeout must be positive"):
        Client("http://127.0.0.1:1", progress_timeout=0)


def test_a_routed_part_whose_worker_hangs_is_asked_again_elsewhere_after_the_progress_deadline(tmp_path):
    many = Backoff(attempts=20, base=0.01, cap=0.1)  # the supervisor's port may hand a re-ask to the hung worker too
    with routed_service(tmp_path, backoff=many, timeout=60, progress_timeout=1) as (svc, client):
        hung = child_pids(svc.process.pid)[0]
        os.kill(hung, signal.SIGSTOP)  # alive, connections accepted, nothing answered: a stuck worker
        try:
            indices = list(range(0, 1000, 7))  # a part for each worker
            began = time.monotonic()
            assert client.get_batch("train", indices) == [expected(i) for i in indices]
            assert time.monotonic() - began < 20  # re-asked after 1 s silences, not after the 60 s timeout
        finally:
            os.kill(hung, signal.SIGCONT)
