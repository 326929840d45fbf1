"""The floor under warm-cache shardfeed: a bare ASGI app that answers ``POST /v1/batch``
with a prebuilt tar body, served by the same uvicorn stack as the service.

It does no lookup, no cache read and no tar building per request: it reads the request
body, picks the prebuilt answer by the request's ``dataset`` (``synthetic-<size>-<batch>``:
``<batch>`` members ``<key>.bin`` of ``<size>`` bytes each, built on first use) and sends
it in one piece. Fetched with the same shardfeed client as the service, its rate is what
this machine can push the same bytes through HTTP at all.

Run as ``python -m shardfeed.benchmarks.minimal_http --port P`` (anything but
``POST /v1/batch`` gets 404, which is how a caller sees it is up).
"""

from __future__ import annotations

import argparse
import json
import os
import re

from shardfeed.tar import END_OF_ARCHIVE, member_header, padding

_NAME = re.compile(r"synthetic-(\d+)-(\d+)")
_MAX_BODY = 256 << 20  # bounds what a bad request can make us build


def batch_body(size: int, batch: int) -> bytes:
    """A tar of ``batch`` members ``000000000.bin``, ... of ``size`` random bytes each."""
    payload = os.urandom(size)  # one payload for all members: the bytes' values do not matter
    pad = b"\0" * padding(size)
    parts = []
    for i in range(batch):
        parts += [member_header(f"{i:09d}.bin", size), payload, pad]
    parts.append(END_OF_ARCHIVE)
    return b"".join(parts)


class MinimalApp:
    """The ASGI app: ``POST /v1/batch`` -> a cached prebuilt body; anything else -> 404."""

    def __init__(self) -> None:
        self.bodies: dict[str, bytes] = {}

    def body_for(self, request: bytes) -> bytes | None:
        try:
            name = json.loads(request)["dataset"]
        except (ValueError, KeyError, TypeError):
            return None
        body = self.bodies.get(name)
        if body is None:
            match = _NAME.fullmatch(str(name))
            if match is None or int(match[1]) * int(match[2]) > _MAX_BODY:
                return None
            body = self.bodies[name] = batch_body(int(match[1]), int(match[2]))
        return body

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                kind = message["type"].rsplit(".", 1)[-1]
                await send({"type": f"lifespan.{kind}.complete"})
                if kind == "shutdown":
                    return
        request = b""
        more = True
        while more:
            message = await receive()
            request += message.get("body", b"")
            more = message.get("more_body", False)
        body = self.body_for(request) if scope["path"] == "/v1/batch" else None
        status, content_type = (200, b"application/x-tar") if body is not None else (404, b"text/plain")
        body = b"not found\n" if body is None else body
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", content_type), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m shardfeed.benchmarks.minimal_http",
                                     description="Bare HTTP server returning prebuilt batch bodies.")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, required=True, help="port to listen on")
    parser.add_argument("--processes", type=int, default=1,
                        help="uvicorn worker processes on the port, to match a multi-process service (default 1)")
    args = parser.parse_args(argv)
    import uvicorn

    uvicorn.run(f"{__spec__.name}:MinimalApp", factory=True, host=args.host, port=args.port,
                workers=args.processes if args.processes > 1 else None, log_level="warning",
                access_log=False, lifespan="on")


if __name__ == "__main__":
    main()
