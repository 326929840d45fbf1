"""The service's HTTP protocol (``service/http/protocol.py``) over a real uvicorn and a real socket:
the ``PARTS`` extension writes a body given as a list of buffers exactly, and falls back to
uvicorn's own sending where the body is not a plain Content-Length one; an instant route is
answered by the protocol when the body comes with the head, by the app otherwise."""

from __future__ import annotations

import asyncio
import socket
import threading
from functools import partial

import httpx
import pytest
import uvicorn

from shardfeed.service.http.protocol import PARTS, BoundedHeadProtocol

BLOCK = bytes(range(256)) * 4096  # 1 MiB of known bytes
PARTS_SENT = [memoryview(BLOCK)[10:5000], b"header", memoryview(BLOCK)[300_000:1_000_000], b"", b"end"]
EXPECTED = b"".join(PARTS_SENT)


async def app(scope, receive, send):
    """``/length``: a Content-Length body in two messages of parts; ``/chunked``: no length;
    under ``/held``, the same with the head held for the first parts' write; ``/instant``:
    ``app:`` and the request body (when the protocol left it to the app)."""
    if scope["path"] == "/instant":
        body, more = b"", True
        while more:
            message = await receive()
            body, more = body + message.get("body", b""), message.get("more_body", False)
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", b"%d" % (4 + len(body)))]})
        await send({"type": "http.response.body", "body": b"app:" + body})
        return
    offered = PARTS in scope.get("extensions", {})
    headers = [(b"x-parts-offered", b"%d" % offered)]
    path = scope["path"].removeprefix("/held")
    if path == "/length":
        headers.append((b"content-length", b"%d" % len(EXPECTED)))
    await send({"type": "http.response.start", "status": 200, "headers": headers,
                "parts": scope["path"].startswith("/held")})
    await send({"type": "http.response.body", "parts": PARTS_SENT[:2], "more_body": True})
    await send({"type": "http.response.body", "parts": PARTS_SENT[2:], "more_body": False})


INSTANT_CALLS: list[bytes] = []
READ = threading.Event()
"""Set after the server's protocol has taken in a read: a test sends the next bytes after it."""


class SignallingProtocol(BoundedHeadProtocol):
    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        READ.set()


def instant(scope, body: bytes):
    """``POST /instant``, answered by the protocol: ``instant:`` and the body (as parts), but
    declined for ``decline`` and failing for ``raise``."""
    INSTANT_CALLS.append(body)
    if body == b"raise":
        raise RuntimeError("an answerer's bug")
    if body == b"decline":
        return None
    parts = [b"instant:", memoryview(body)]
    return [(b"content-type", b"text/plain"), (b"content-length", b"%d" % (8 + len(body)))], parts


@pytest.fixture(scope="module")
def server_url():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    protocol = partial(SignallingProtocol, instant={("POST", "/instant"): instant})
    server = uvicorn.Server(uvicorn.Config(app, http=protocol, loop="uvloop", lifespan="off",
                                           log_level="warning"))
    thread = threading.Thread(target=lambda: asyncio.run(server.serve(sockets=[sock])), daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    for _ in range(200):
        if server.started:
            break
        threading.Event().wait(0.05)
    yield url
    server.should_exit = True
    thread.join(10)


def test_parts_go_out_exactly_with_content_length_and_keep_the_connection(server_url):
    with httpx.Client(base_url=server_url, timeout=10) as http:
        for _ in range(3):  # the same connection, request after request
            resp = http.get("/length")
            assert resp.headers["x-parts-offered"] == "1"
            assert resp.content == EXPECTED


@pytest.mark.parametrize("prefix", ["", "/held"])
def test_parts_without_content_length_go_out_as_one_chunk_a_message(server_url, prefix):
    resp = httpx.get(f"{server_url}{prefix}/chunked", timeout=10)
    assert resp.headers["transfer-encoding"] == "chunked"
    assert resp.content == EXPECTED
    # On the wire: each message's parts one chunk, then the last chunk; twice on one connection.
    chunks = [b"".join(PARTS_SENT[:2]), b"".join(PARTS_SENT[2:])]
    body = b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in chunks) + b"0\r\n\r\n"
    host, port = server_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as conn:
        for _ in range(2):
            conn.sendall(f"GET {prefix}/chunked HTTP/1.1\r\nHost: x\r\n\r\n".encode())
            got = b""
            while not got.endswith(b"0\r\n\r\n"):
                got += conn.recv(1 << 20)
            assert got.split(b"\r\n\r\n", 1)[1] == body


def test_a_held_head_goes_out_once_before_the_parts_on_a_kept_connection(server_url):
    with httpx.Client(base_url=server_url, timeout=10) as http:
        for path in ("/held/length", "/length", "/held/length"):  # held heads and plain ones, one connection
            resp = http.get(path)
            assert resp.status_code == 200 and resp.headers["content-length"] == str(len(EXPECTED))
            assert resp.headers["x-parts-offered"] == "1"
            assert resp.content == EXPECTED


def test_a_held_head_is_written_for_a_head_request_without_its_body(server_url):
    resp = httpx.head(f"{server_url}/held/length", timeout=10)
    assert resp.status_code == 200 and resp.headers["content-length"] == str(len(EXPECTED))
    assert resp.content == b""


def post(body: bytes, *, close: bool = False) -> bytes:
    """A ``POST /instant`` request, head and body."""
    return (b"POST /instant HTTP/1.1\r\nhost: t\r\ncontent-length: %d\r\n%s\r\n%s"
            % (len(body), b"connection: close\r\n" if close else b"", body))


def read_answer(sock: socket.socket, pending: bytearray) -> tuple[bytes, dict[bytes, bytes], bytes]:
    """One response from ``sock`` (``pending``: bytes read but not yet parsed): status line,
    headers, body (by its Content-Length)."""
    while b"\r\n\r\n" not in pending:
        chunk = sock.recv(65536)
        assert chunk, "connection closed before a response"
        pending += chunk
    head, _, rest = bytes(pending).partition(b"\r\n\r\n")
    status, *lines = head.split(b"\r\n")
    headers = dict(line.split(b": ", 1) for line in lines)
    length = int(headers[b"content-length"])
    while len(rest) < length:
        chunk = sock.recv(65536)
        assert chunk, "connection closed mid-body"
        rest += chunk
    pending[:] = rest[length:]
    return status, headers, rest[:length]


@pytest.fixture
def connection(server_url):
    host, port = server_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        yield sock, bytearray()


def test_a_body_that_comes_with_its_head_is_answered_by_the_protocol_on_a_kept_connection(connection):
    sock, pending = connection
    INSTANT_CALLS.clear()
    for body in (b"one", b"two" * 1000):
        sock.sendall(post(body))  # head and body in one write: one read
        status, headers, answer = read_answer(sock, pending)
        assert status == b"HTTP/1.1 200 OK" and answer == b"instant:" + body
        assert b"date" in headers and headers[b"content-type"] == b"text/plain"  # the server's defaults too
        sock.sendall(b"GET /length HTTP/1.1\r\nhost: t\r\n\r\n")  # the app, on the same connection
        assert read_answer(sock, pending)[2] == EXPECTED
    assert INSTANT_CALLS == [b"one", b"two" * 1000]


def test_pipelined_requests_are_answered_in_order(connection):
    sock, pending = connection
    sock.sendall(post(b"first") + post(b"decline") + post(b"third") + b"GET /length HTTP/1.1\r\nhost: t\r\n\r\n")
    answers = [read_answer(sock, pending)[2] for _ in range(4)]
    # Behind a request the app answers, uvicorn queues the next ones for the app, in order.
    assert answers == [b"instant:first", b"app:decline", b"app:third", EXPECTED]


def test_a_body_after_its_head_declined_or_failing_is_answered_by_the_app(connection):
    sock, pending = connection
    INSTANT_CALLS.clear()
    request = post(b"late body")
    READ.clear()
    sock.sendall(request[:-4])  # the head and part of the body, then the rest in a later read
    assert READ.wait(10), "the server never read the head"
    sock.sendall(request[-4:])
    assert read_answer(sock, pending)[2] == b"app:late body"
    assert INSTANT_CALLS == []  # offered only a whole body, in the head's read
    for body in (b"decline", b"raise"):
        sock.sendall(post(body))
        status, _, answer = read_answer(sock, pending)
        assert status == b"HTTP/1.1 200 OK" and answer == b"app:" + body
    assert INSTANT_CALLS == [b"decline", b"raise"]


def test_an_instant_answer_to_a_closing_request_closes_the_connection(connection):
    sock, pending = connection
    sock.sendall(post(b"bye", close=True))
    _, headers, answer = read_answer(sock, pending)
    assert answer == b"instant:bye" and headers[b"connection"] == b"close"
    assert sock.recv(10) == b""  # closed by the server
