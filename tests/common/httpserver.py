"""A test's own HTTP server: on a free loopback port, serving from a daemon thread."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class LocalServer(ThreadingHTTPServer):
    """Serves ``handler`` at ``url`` until the process ends; set a subclass's own state before
    calling ``__init__``, which starts serving."""

    daemon_threads = True

    def __init__(self, handler: type[BaseHTTPRequestHandler]):
        super().__init__(("127.0.0.1", 0), handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class QuietHandler(BaseHTTPRequestHandler):
    """HTTP/1.1 (connections kept alive, as the client's are), and no request lines on stderr."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:
        pass
