"""The client's error types: one base, one for answers from the service, one for the wire."""

from __future__ import annotations


class ShardfeedError(Exception):
    """Base of every error the client raises (also: a malformed response from the service)."""


class ShardfeedHTTPError(ShardfeedError):
    """The service answered with an error status, e.g. 404 for an unknown dataset.

    ``status`` is the HTTP status, ``code`` and ``message`` come from the service's JSON
    error body (``{"error": {"code", "message"}}``), ``url`` is the request's URL and
    ``retry_after`` the seconds a 429 asked the client to wait (``None`` if not given).
    """

    def __init__(self, status: int, code: str, message: str, url: str, retry_after: float | None = None):
        super().__init__(f"{status} {code}: {message} ({url})")
        self.status = status
        self.code = code
        self.message = message
        self.url = url
        self.retry_after = retry_after


class ShardfeedConnectionError(ShardfeedError):
    """The service could not be reached, timed out, or broke off a response mid-stream.

    ``connect`` is true when no connection could be opened at all (the client then
    tries another service URL at once, if it has one).
    """

    def __init__(self, url: str, reason: str, *, connect: bool = False):
        super().__init__(f"{url}: {reason}")
        self.url = url
        self.reason = reason
        self.connect = connect
