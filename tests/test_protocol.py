"""The service's HTTP protocol (``service/protocol.py``) over a real uvicorn and a real socket:
the ``PARTS`` extension writes a body given as a list of buffers exactly, and falls back to
uvicorn's own sending where the body is not a plain Content-Length one."""

from __future__ import annotations

import asyncio
import socket
import threading

import httpx
import pytest
import uvicorn

from shardfeed.service.protocol import PARTS, BoundedHeadProtocol

BLOCK = bytes(range(256)) * 4096  # 1 MiB of known bytes
PARTS_SENT = [memoryview(BLOCK)[10:5000], b"header", memoryview(BLOCK)[300_000:1_000_000], b"", b"end"]
EXPECTED = b"".join(PARTS_SENT)


async def app(scope, receive, send):
    """``/length``: a Content-Length body in two messages of parts; ``/chunked``: no length;
    under ``/held``, the same with the head held for the first parts' write."""
    offered = PARTS in scope.get("extensions", {})
    headers = [(b"x-parts-offered", b"%d" % offered)]
    path = scope["path"].removeprefix("/held")
    if path == "/length":
        headers.append((b"content-length", b"%d" % len(EXPECTED)))
    await send({"type": "http.response.start", "status": 200, "headers": headers,
                "parts": scope["path"].startswith("/held")})
    await send({"type": "http.response.body", "parts": PARTS_SENT[:2], "more_body": True})
    await send({"type": "http.response.body", "parts": PARTS_SENT[2:], "more_body": False})


@pytest.fixture(scope="module")
def server_url():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, http=BoundedHeadProtocol, loop="uvloop", lifespan="off",
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
def test_parts_without_content_length_fall_back_to_uvicorns_chunked_body(server_url, prefix):
    resp = httpx.get(f"{server_url}{prefix}/chunked", timeout=10)
    assert resp.headers["transfer-encoding"] == "chunked"
    assert resp.content == EXPECTED


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
