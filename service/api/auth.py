"""Bearer-token middleware: every route but /healthz and the status page's HTML needs
``Authorization: Bearer <token>``."""

from __future__ import annotations

import hmac

from shardfeed.service.http.errors import error_response

OPEN_PATHS = frozenset({"/healthz", "/", "/ui"})
"""Answered without a token: liveness, and the status page's HTML, which holds no data (its
script asks for a token and sends it with every call to ``/v1/stats``)."""


class TokenAuth:
    """ASGI middleware; tokens compared in constant time, against every configured token."""

    def __init__(self, app, tokens: frozenset[str]):
        self.app = app
        self.tokens = encoded(tokens)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        if not bears_token(scope, self.tokens):
            response = error_response(401, "unauthorized", "missing or wrong bearer token",
                                      {"WWW-Authenticate": "Bearer"})
            return await response(scope, receive, send)
        return await self.app(scope, receive, send)


def encoded(tokens: frozenset[str]) -> list[bytes]:
    return [t.encode() for t in tokens]


def bears_token(scope, tokens: list[bytes]) -> bool:
    """Whether the request's ``Authorization: Bearer`` is one of ``tokens``."""
    given = b""
    for name, value in scope["headers"]:
        if name == b"authorization" and value[:7].lower() == b"bearer ":
            given = value[7:].strip()
    ok = False
    for token in tokens:  # compare with every token: timing says nothing about which matched
        ok |= hmac.compare_digest(given, token)
    return ok


def guarded(answerer, tokens: frozenset[str]):
    """``answerer`` (``protocol.InstantAnswerer``) for requests that bear a token; the app
    answers the others (401)."""
    tokens = encoded(tokens)
    return lambda scope, body: answerer(scope, body) if bears_token(scope, tokens) else None
