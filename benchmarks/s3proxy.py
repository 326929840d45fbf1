"""A fault-injecting reverse proxy in front of an S3 endpoint, for fault tests and benchmarks.

Requests are forwarded verbatim, Host header included: the client signs SigV4 for the
proxy's host:port and the upstream (moto, MinIO) checks the signature over the headers it
receives, so signed requests pass through untouched. Faults are queued at runtime and hit
the next matching requests:

=========== ===================================================================
``503``     ``503 SlowDown`` with S3's XML error body, without asking upstream
``500``     ``500 InternalError``, without asking upstream
``reset``   upstream's status and headers, half the body, then a TCP reset
``truncate`` upstream's status and correct Content-Length, half the body, then close
``stall``   wait ``ms`` (default 60 s, past any sane read timeout), then forward
``hang``    upstream's status and headers, half the body, then silence for ``ms`` (default
            60 s), then the rest: a read that goes silent mid-body
``latency`` wait ``ms`` more, then forward (a latency spike)
=========== ===================================================================

``latency_ms`` adds a fixed delay to every request (to model cloud S3's time to first
byte on loopback). ``outage(True)`` makes S3 unreachable until ``outage(False)``: every
request, on a new or a kept-alive connection, has its connection reset at once, upstream
not asked (counted as ``fault:outage``). Two ways to run it:

- in-process: ``proxy = start_proxy(upstream)`` serves from a background thread with its
  own event loop; ``proxy.url``, ``proxy.inject(...)``, ``proxy.counts``, ``proxy.read_bytes``,
  ``proxy.stop()``.
  ``start_proxy_process`` starts the subprocess below and waits until it listens.
- subprocess: ``python -m shardfeed.benchmarks.s3proxy --upstream URL [--port P]
  [--latency-ms N]`` prints ``s3proxy listening on URL`` when ready; faults and counts
  are then driven over HTTP: ``POST /_proxy/inject`` (JSON ``{"kind", "count", "match",
  "ms"}``), ``POST /_proxy/clear``, ``POST /_proxy/latency`` (``{"ms"}``),
  ``POST /_proxy/outage`` (``{"down": true}`` or ``false``), ``GET /_proxy/counts``
  (``proxy.counts``) and ``GET /_proxy/bytes`` (``{"read": proxy.read_bytes}``), both read by
  ``control(url, what)``. (S3 bucket names cannot start with ``_``, so these never clash.)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import urllib.request
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import aiohttp
from aiohttp import web
from yarl import URL

from shardfeed.process import free_port, stop_process

KINDS = ("503", "500", "reset", "truncate", "stall", "latency", "hang")
_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "upgrade", "trailer",
               "proxy-authenticate", "proxy-authorization", "proxy-connection"}
_ERROR_XML = ('<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code>'
              "<Message>{message}</Message><Resource>{path}</Resource></Error>")
_ERRORS = {"503": ("SlowDown", "Please reduce your request rate."),
           "500": ("InternalError", "We encountered an internal error. Please try again.")}


@dataclass
class _Fault:
    kind: str
    remaining: int | None  # None: every matching request until clear()
    match: re.Pattern | None
    ms: float


_OUTAGE = _Fault("outage", None, None, 0.0)


class FaultProxy:
    """Reverse proxy to ``upstream`` with a thread-safe queue of faults.

    upstream: base URL of the S3 endpoint, e.g. ``http://127.0.0.1:5000``.
    latency_ms: fixed delay added to every proxied request (settable at any time).
    """

    def __init__(self, upstream: str, *, latency_ms: float = 0):
        self.upstream = upstream.rstrip("/")
        self.latency_ms = latency_ms
        self.url: str | None = None
        self.down = False  # an outage: see outage()
        self._lock = threading.Lock()  # inject() comes from test threads, _take() from the loop
        self._faults: list[_Fault] = []
        self._counts: Counter[str] = Counter()
        self._read = 0  # see read_bytes
        self._client: aiohttp.ClientSession | None = None
        self._runner: web.AppRunner | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    # -- faults and counters (any thread) ------------------------------------------------

    def inject(self, kind: str, *, count: int | None = 1, match: str | None = None,
               ms: float | None = None) -> None:
        """Make the next ``count`` matching requests fail with ``kind`` (``None``: all of them).

        match: regular expression searched in ``"METHOD /path?query"``, e.g. ``"^GET "``
        or ``"shard-0003"``; ``None`` matches every request.
        ms: delay for ``stall`` and ``hang`` (default 60000) and ``latency`` (default 1000).
        """
        if kind not in KINDS:
            raise ValueError(f"unknown fault kind {kind!r} (expected one of {', '.join(KINDS)})")
        if count is not None and count < 1:
            raise ValueError(f"fault count must be at least 1 or None, not {count}")
        if ms is None:
            ms = {"stall": 60_000, "hang": 60_000, "latency": 1_000}.get(kind, 0)
        fault = _Fault(kind, count, re.compile(match) if match else None, float(ms))
        with self._lock:
            self._faults.append(fault)

    def outage(self, down: bool) -> None:
        """Make S3 unreachable (``True``: every request's connection is reset at once, upstream
        not asked) or reachable again (``False``). Queued faults wait meanwhile."""
        self.down = down

    def clear(self) -> None:
        """Drop every pending fault (counts are kept)."""
        with self._lock:
            self._faults.clear()

    @property
    def counts(self) -> dict[str, int]:
        """Snapshot: ``requests`` (all proxied), one entry per method (``GET``, ``HEAD``,
        ...), ``LIST`` and ``GET range`` among the GETs (``_shape``), and one per fault
        served (``fault:503``, ``fault:reset``, ...)."""
        with self._lock:
            return dict(self._counts)

    @property
    def read_bytes(self) -> int:
        """The bytes of the bodies upstream answered GETs with: what readers took from S3."""
        with self._lock:
            return self._read

    def _take(self, method: str, label: str, shape: str | None = None) -> _Fault | None:
        """Count the request and pop the first pending fault that matches it."""
        with self._lock:
            self._counts["requests"] += 1
            self._counts[method] += 1
            if shape is not None:
                self._counts[shape] += 1
            if self.down:
                self._counts["fault:outage"] += 1
                return _OUTAGE
            for fault in self._faults:
                if fault.match is None or fault.match.search(label):
                    if fault.remaining is not None:
                        fault.remaining -= 1
                        if fault.remaining == 0:
                            self._faults.remove(fault)
                    self._counts[f"fault:{fault.kind}"] += 1
                    return fault
        return None

    # -- serving --------------------------------------------------------------------------

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        if request.path.startswith("/_proxy/"):
            return await self._control(request)
        fault = self._take(request.method, f"{request.method} {request.raw_path}", _shape(request))
        kind = fault.kind if fault else None
        if kind == "outage":
            self._cut(request, "reset")
        delay = self.latency_ms + (fault.ms if kind in ("stall", "latency") else 0)
        if delay:
            await asyncio.sleep(delay / 1000)
        if kind in _ERRORS:
            code, message = _ERRORS[kind]
            return web.Response(status=int(kind), content_type="application/xml",
                                text=_ERROR_XML.format(code=code, message=message, path=request.path))

        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_BY_HOP}
        try:
            async with self._client.request(
                request.method, URL(self.upstream + request.raw_path, encoded=True),
                headers=headers, data=await request.read() or None, allow_redirects=False,
            ) as upstream:
                status, up_headers = upstream.status, upstream.headers
                if kind is None and request.method == "GET":
                    # Passed on as it comes, as S3 sends it: its first byte does not wait for its last.
                    response = await self._answer_head(request, status, up_headers, None)
                    async for chunk in upstream.content.iter_chunked(1 << 20):
                        with self._lock:
                            self._read += len(chunk)
                        await response.write(chunk)
                    await response.write_eof()
                    return response
                body = await upstream.read()
            if request.method == "GET":
                with self._lock:
                    self._read += len(body)
        except aiohttp.ClientError as err:
            return web.Response(status=502, text=f"s3proxy: upstream {self.upstream} failed: {err}\n")

        if kind in ("reset", "truncate") and (request.method == "HEAD" or not body):
            self._cut(request, kind)  # nothing to cut short: drop the connection before the headers
        response = await self._answer_head(request, status, up_headers, len(body))
        if kind in ("reset", "truncate", "hang"):
            await response.write(body[: len(body) // 2])
            if kind == "hang":
                await asyncio.sleep(fault.ms / 1000)
                body = body[len(body) // 2:]
            else:
                self._cut(request, kind)
        await response.write(body)
        await response.write_eof()
        return response

    @staticmethod
    async def _answer_head(request: web.Request, status: int, up_headers, length: int | None) -> web.StreamResponse:
        """The answer's status and upstream's headers, sent; its length upstream's (a HEAD has none
        of the body it announces), else ``length``."""
        response = web.StreamResponse(status=status)
        for name, value in up_headers.items():
            if name.lower() not in _HOP_BY_HOP and name.lower() != "content-length":
                response.headers.add(name, value)
        announced = up_headers.get("Content-Length")
        if announced is not None or length is not None:
            response.content_length = int(announced) if announced is not None else length
        await response.prepare(request)
        return response

    @staticmethod
    def _cut(request: web.Request, kind: str) -> None:
        """Close the client connection now: a TCP reset for ``reset``, a plain close otherwise."""
        transport = request.transport
        if transport is not None:
            if kind == "reset":  # SO_LINGER 0: close() sends RST instead of FIN
                sock = transport.get_extra_info("socket")
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            transport.close()
        raise asyncio.CancelledError  # the connection is gone: nothing more to send

    async def _control(self, request: web.Request) -> web.Response:
        action = request.path[len("/_proxy/"):]
        try:
            args = await request.json() if request.can_read_body else {}
            if action == "counts" and request.method == "GET":
                return web.json_response(self.counts)
            if action == "bytes" and request.method == "GET":
                return web.json_response({"read": self.read_bytes})
            if request.method != "POST":
                raise ValueError(f"{request.method} /_proxy/{action}: use POST")
            if action == "inject":
                self.inject(args["kind"], count=args.get("count", 1), match=args.get("match"),
                            ms=args.get("ms"))
            elif action == "clear":
                self.clear()
            elif action == "latency":
                self.latency_ms = float(args["ms"])
            elif action == "outage":
                self.outage(bool(args["down"]))
            else:
                raise ValueError(f"unknown control action {action!r}")
        except (ValueError, KeyError, TypeError) as err:
            return web.json_response({"error": str(err)}, status=400)
        return web.json_response({"ok": True})

    async def serve(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Start listening in the running loop; returns (and sets) ``self.url``."""
        self._client = aiohttp.ClientSession(
            auto_decompress=False, cookie_jar=aiohttp.DummyCookieJar(),
            # Forward only the headers the client sent (its signature covers some of them).
            skip_auto_headers=("Accept-Encoding", "User-Agent", "Content-Type"),
            connector=aiohttp.TCPConnector(limit=256),
        )
        app = web.Application(client_max_size=8 << 30)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        bound = self._runner.addresses[0]
        self.url = f"http://{host}:{bound[1]}"
        return self.url

    async def aclose(self) -> None:
        """Stop listening and close upstream connections (in the serving loop)."""
        if self._runner is not None:
            await self._runner.cleanup()
        if self._client is not None:
            await self._client.close()

    # -- background thread ------------------------------------------------------------------

    def start(self, host: str = "127.0.0.1", port: int = 0) -> "FaultProxy":
        """Serve from a daemon thread with its own event loop; returns once listening."""
        self._loop = asyncio.new_event_loop()
        ready = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            asyncio.set_event_loop(self._loop)
            try:
                self._loop.run_until_complete(self.serve(host, port))
            except BaseException as err:  # reported to the starting thread below
                failure.append(err)
                ready.set()
                return
            ready.set()
            self._loop.run_forever()
            # Stalled requests may still be sleeping: cancel them so the loop closes cleanly.
            pending = asyncio.all_tasks(self._loop)
            for task in pending:
                task.cancel()
            self._loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            self._loop.close()

        self._thread = threading.Thread(target=run, name="s3proxy", daemon=True)
        self._thread.start()
        ready.wait()
        if failure:
            raise failure[0]
        return self

    def stop(self) -> None:
        """Stop a proxy started with :meth:`start` (stalled requests are cut off)."""
        if self._thread is None:
            return
        asyncio.run_coroutine_threadsafe(self.aclose(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._thread = None

    def __enter__(self) -> "FaultProxy":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _shape(request: web.Request) -> str | None:
    """``LIST`` for a GET of a bucket's keys (path-style, as the clients here send it), ``GET
    range`` for a GET of a byte range; None for any other request (counted by its method)."""
    if request.method != "GET":
        return None
    if "/" not in request.path.strip("/"):
        return "LIST"
    return "GET range" if "Range" in request.headers else None


def start_proxy(upstream: str, *, latency_ms: float = 0, host: str = "127.0.0.1",
                port: int = 0) -> FaultProxy:
    """A :class:`FaultProxy` to ``upstream`` serving from a background thread (port 0: any free one)."""
    return FaultProxy(upstream, latency_ms=latency_ms).start(host, port)


def start_proxy_process(upstream: str, latency: float, log: Path) -> tuple[str, subprocess.Popen]:
    """The proxy as a subprocess (in a thread of a busy benchmark it would share its GIL), its
    output appended to ``log``: its URL and the process (``stop_process`` ends it)."""
    port = free_port()
    with open(log, "ab") as err:
        process = subprocess.Popen(
            [sys.executable, "-m", "shardfeed.benchmarks.s3proxy", "--upstream", upstream,
             "--port", str(port), "--latency-ms", str(latency)],
            stdout=subprocess.PIPE, stderr=err, text=True)
    ready, _, _ = select.select([process.stdout], [], [], 30)
    if not ready or not process.stdout.readline().startswith("s3proxy listening on"):
        stop_process(process)
        raise RuntimeError(f"the S3 latency proxy did not start (see {log})")
    return f"http://127.0.0.1:{port}", process


def control(url: str, what: str) -> dict:
    """``GET /_proxy/<what>`` (``counts``, ``bytes``) of the proxy at ``url``, a subprocess's or a thread's."""
    with urllib.request.urlopen(f"{url}/_proxy/{what}", timeout=10) as resp:
        return json.loads(resp.read())


async def _main(args: argparse.Namespace) -> None:
    proxy = FaultProxy(args.upstream, latency_ms=args.latency_ms)
    url = await proxy.serve(args.host, args.port)
    print(f"s3proxy listening on {url} -> {args.upstream} (latency {args.latency_ms} ms)", flush=True)
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    await stop.wait()
    await proxy.aclose()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m shardfeed.benchmarks.s3proxy",
                                     description="Fault-injecting reverse proxy to an S3 endpoint.")
    parser.add_argument("--upstream", required=True, help="S3 endpoint URL, e.g. http://127.0.0.1:5000")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=0, help="port to listen on (default: any free port)")
    parser.add_argument("--latency-ms", type=float, default=0.0,
                        help="fixed delay added to every request, in milliseconds")
    args = parser.parse_args(argv)
    if not args.upstream.startswith(("http://", "https://")):
        parser.error(f"--upstream must be an http(s) URL, not {args.upstream!r}")
    if args.latency_ms < 0:
        parser.error(f"--latency-ms must not be negative, not {args.latency_ms}")
    try:
        asyncio.run(_main(args))
    except OSError as err:
        parser.exit(1, f"s3proxy: cannot listen on {args.host}:{args.port}: {err.strerror or err}\n")


if __name__ == "__main__":
    main()
