"""What the blocking and the asyncio client share: settings, endpoints, requests, verdicts.

The two clients differ only in how they wait for the network; everything that decides
what to send, where to send it, what an answer means and whether to try again is here.
"""

from __future__ import annotations

import bisect
import email.utils
import json
import math
import operator
import os
import random
import ssl
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple, TypeVar
from urllib.parse import quote

import httpx

from shardfeed.retry import Backoff

from .errors import ShardfeedConnectionError, ShardfeedError, ShardfeedHTTPError

T = TypeVar("T")

DEFAULT_BACKOFF = Backoff(attempts=6, base=0.1, cap=10.0)
"""Six tries over about 3 s of jittered waits; a ``Retry-After`` up to 10 s is honoured."""

_RETRY_STATUSES = frozenset({429, 502, 503, 504})
ROUTING_HEADER = "x-shardfeed-routing"
"""Batch answers carry the answering node's routing table version in this header."""
LENGTH_HEADER = "x-shardfeed-length"
"""A streamed batch answer's expected length (a tensor batch's buffer is sized by it)."""
ERROR_BODY_LIMIT = 64 * 1024
"""Bytes of an error response read at most: it is a short JSON document, never a stream."""


def parse_urls(url: str | Sequence[str]) -> list[str]:
    """Service base URLs from one URL, a comma-separated string, or a list."""
    urls = url.split(",") if isinstance(url, str) else list(url)
    out = []
    for u in urls:
        u = u.strip().rstrip("/")
        if not u.startswith(("http://", "https://")) or len(u) <= len("https://"):
            raise ValueError(f"shardfeed service URL must start with http:// or https://, not {u!r}")
        out.append(u)
    if not out:
        raise ValueError("no shardfeed service URL given")
    return out


def as_indices(indices: Sequence[int]) -> list[int]:
    """Plain ints from any sequence of integers (numpy or torch scalars included)."""
    try:
        return [operator.index(i) for i in indices]
    except TypeError:
        raise TypeError(f"sample indices must be integers, got {indices!r:.80}") from None


class Endpoints:
    """The service URLs of one client: round-robin spreading, skipping any that refused us.

    A URL that refused a connection is left out for ``down_for`` seconds; if every URL
    is down, the one due back first is tried anyway, so the client never gives up early.
    """

    def __init__(self, urls: list[str], down_for: float):
        self.urls = urls
        self.down_for = down_for
        self._down: dict[str, float] = {}  # url -> monotonic time it may be tried again
        self._next = 0

    def scatter(self) -> None:
        """Start the rotation at a random URL, so that many processes spread out."""
        self._next = random.randrange(len(self.urls))
        self._down.clear()

    def pick(self) -> str:
        """The URL for the next request."""
        now = time.monotonic()
        n = len(self.urls)
        for _ in range(n):
            url = self.urls[self._next % n]
            self._next += 1
            if self._down.get(url, 0.0) <= now:
                return url
        return min(self.urls, key=lambda u: self._down[u])

    def mark_down(self, url: str) -> None:
        """Leave ``url`` out of the rotation for a while."""
        self._down[url] = time.monotonic() + self.down_for

    def any_up(self) -> bool:
        """Whether some URL is not marked down."""
        now = time.monotonic()
        return any(self._down.get(u, 0.0) <= now for u in self.urls)


class BaseClient:
    """Settings, endpoints and the per-process HTTP session shared by both clients.

    The HTTP session (a connection pool) is created lazily by the process and event loop
    that first use it, and never pickled, so a client can be handed to DataLoader workers
    started by ``fork``, ``spawn`` or ``forkserver``: each opens its own connections.
    """

    # This process's (and event loop's) httpx session and batch connections, each as
    # (owner, object): made on first use by each (see _own), never pickled.
    _http: tuple[Any, Any] | None = None
    _pool: tuple[Any, Any] | None = None

    def __init__(
        self,
        url: str | Sequence[str],
        *,
        token: str | None = None,
        timeout: float = 60.0,
        connect_timeout: float = 5.0,
        backoff: Backoff = DEFAULT_BACKOFF,
        down_for: float = 5.0,
        max_connections: int = 16,
        verify: bool | str = True,
        route: bool = True,
    ):
        """
        Args:
            url: service base URL (``http://host:8080``), a comma-separated list of them,
                or a list. Requests rotate over the URLs; one that refuses connections is
                skipped for ``down_for`` seconds while the others take its load.
            token: bearer token sent as ``Authorization``; defaults to ``$SHARDFEED_TOKEN``.
            timeout: seconds to wait for any read or write on a connection (not for a
                whole batch: a large batch may stream for longer, as long as bytes flow).
            connect_timeout: seconds to wait for a connection to open.
            backoff: retry policy for 429, 502-504, 409 ``dataset_changed``, connection failures
                and broken streams.
            down_for: seconds a URL that refused a connection stays out of the rotation.
            max_connections: connection pool size per process (keep-alive connections).
            verify: for ``https://`` URLs, check the server's certificate (True), against a
                CA bundle file (a path, e.g. the service's self-signed certificate), or not
                at all (False).
            route: send each part of a batch straight to the replica or worker that owns
                its shards, from the service's routing table (see :class:`Router`);
                False sends every batch whole to the next URL of the rotation.
        """
        self.urls = parse_urls(url)
        if timeout <= 0 or connect_timeout <= 0:
            raise ValueError("timeout and connect_timeout must be positive")
        if max_connections < 1:
            raise ValueError(f"max_connections must be at least 1, not {max_connections}")
        token = token if token is not None else os.environ.get("SHARDFEED_TOKEN") or None
        self.headers = {"Accept-Encoding": "identity"}
        if token:
            self.headers["Authorization"] = f"Bearer {token}"
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self.backoff = backoff
        self.max_connections = max_connections
        self.verify = verify
        self.endpoints = Endpoints(self.urls, down_for)
        self.router = Router(enabled=route)
        self._session_lock = threading.Lock()

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state.pop("_http", None)  # sessions hold sockets: each process opens its own
        state.pop("_pool", None)
        del state["_session_lock"]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._session_lock = threading.Lock()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({','.join(self.urls)!r})"

    def _session_options(self) -> dict:
        return dict(
            headers=self.headers,
            timeout=httpx.Timeout(self.timeout, connect=self.connect_timeout),
            limits=httpx.Limits(max_connections=self.max_connections,
                                max_keepalive_connections=self.max_connections),
            # Proxy settings in the environment are meant for the internet, not for the
            # training cluster's own service.
            trust_env=False,
            verify=ssl.create_default_context(cafile=self.verify) if isinstance(self.verify, str) else self.verify,
        )

    def _pool_options(self) -> dict:
        """The arguments of the batch transport's pool (:mod:`.wire`, :mod:`.aiowire`)."""
        return dict(timeout=self.timeout, connect_timeout=self.connect_timeout,
                    max_connections=self.max_connections, verify=self.verify)

    def _own(self, attr: str, owner: Any, make: Callable[[], T]) -> T:
        """The object of ``owner`` (a pid, or a pid and event loop) held in ``attr`` as
        ``(owner, object)``, made on first use, as the httpx session is (a child after
        ``fork`` or another event loop makes its own)."""
        held = getattr(self, attr)
        if held is None or held[0] != owner:
            with self._session_lock:
                held = getattr(self, attr)
                if held is None or held[0] != owner:
                    held = (owner, make())
                    setattr(self, attr, held)
                    self.endpoints.scatter()  # a new session starts the rotation at a random URL
        return held[1]

    def _disown(self, attr: str, owner: Any) -> Any:
        """Forget the object held in ``attr``; it, if ``owner`` made it (the caller closes it),
        else ``None`` (another process's or loop's, not ours to close)."""
        held = getattr(self, attr)
        setattr(self, attr, None)
        return held[1] if held is not None and held[0] == owner else None

    def _verdict(self, exc: Exception) -> bool | float | None:
        """The retry predicate: give up, back off, or wait a given time (see shardfeed.retry)."""
        if isinstance(exc, ShardfeedHTTPError):
            # dataset_changed: the service reopened the dataset; the batch again reads one version.
            if exc.status not in _RETRY_STATUSES and exc.code != "dataset_changed":
                return None
            return exc.retry_after if exc.retry_after is not None else True
        if isinstance(exc, ShardfeedConnectionError):
            if exc.connect:
                self.endpoints.mark_down(exc.url)
                if self.endpoints.any_up():
                    return 0.0  # fail over to another URL at once
            return True
        return None


class Part(NamedTuple):
    """The samples of a batch that go to one owner: their positions in the batch and indices."""

    owner: str | None
    positions: list[int]
    indices: list[int]


class RoutingTable:
    """One dataset's ``GET /v1/datasets/{name}/routing``: samples ``starts[i]`` up to
    ``starts[i + 1]`` are owned by ``urls[owner[i]]``."""

    def __init__(self, doc: dict):
        try:
            self.version = str(doc["version"])
            self.starts = [operator.index(i) for i in doc["starts"]]
            self.urls = parse_urls(list(doc["urls"])) if doc["urls"] else []
            self.owner = [self.urls[o] for o in doc["owner"]] if self.urls else []
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            raise ShardfeedError(f"malformed routing table: {exc!r:.200}") from None
        if len(self.owner) != len(self.starts) or self.starts != sorted(self.starts):
            raise ShardfeedError("malformed routing table: starts and owners do not match")

    def owner_of(self, index: int) -> str | None:
        run = bisect.bisect_right(self.starts, index) - 1
        return self.owner[run] if run >= 0 and self.owner else None


class Router:
    """Client-side routing: splits a batch into one part per owning node, and merges the parts.

    The service publishes, per dataset, which replica or worker owns which samples, with
    a version that changes with ownership. Sending each owner its own part saves the
    hop from the node reached to the owner. The table is only advice: any node serves
    any batch correctly, so a stale table costs a hop or a retry, never a wrong, missing
    or reordered sample. A table is fetched on first use, again before the next batch when
    an answer carries a version it has not heard of, within ``refresh`` seconds when answers
    keep naming it or an owner failed, and not for ``retry`` seconds after a fetch failed (a
    service without routing).
    """

    def __init__(self, enabled: bool = True, refresh: float = 1.0, retry: float = 60.0):
        self.enabled = enabled
        self.refresh = refresh
        self.retry = retry
        self._tables: dict[str, RoutingTable] = {}
        self._due: dict[str, float] = {}  # dataset -> monotonic time its table is (re)fetched
        self._fetched: dict[str, float] = {}
        self._news: dict[str, tuple[str, str]] = {}  # dataset -> the last other version an answer named, and by whom

    def due(self, dataset: str) -> bool:
        """Whether ``dataset``'s table should be fetched before the next batch."""
        return self.enabled and self._due.get(dataset, 0.0) <= time.monotonic()

    def load(self, dataset: str, doc: dict | None) -> None:
        """Take a fetched table (``None``: the fetch failed; route nothing for a while)."""
        now = time.monotonic()
        self._fetched[dataset] = now
        table = None
        if doc is not None:
            try:
                table = RoutingTable(doc)
            except ShardfeedError:
                pass
        if table is None:
            self._tables.pop(dataset, None)
            self._due[dataset] = now + self.retry
        else:
            self._tables[dataset] = table
            self._due[dataset] = math.inf

    def saw(self, dataset: str, version: str | None, base: str) -> None:
        """The node at ``base`` answered with routing ``version``: if ours is another, refetch the
        table (from that node first: it has that version) before the next batch when the version
        is news, else within ``refresh`` seconds (answers keep naming it while the nodes still
        disagree: one fetch per change, not one per answer)."""
        table = self._tables.get(dataset)
        if table is None or version is None or version == table.version:
            return
        if self._news.get(dataset, (None,))[0] != version:
            self._news[dataset] = (version, base)
            self._due[dataset] = 0.0
        else:
            self.expire(dataset)

    def teller(self, dataset: str) -> str | None:
        """The node that last named a routing version of ``dataset`` other than ours: the
        table is fetched from it first."""
        return self._news.get(dataset, (None, None))[1]

    def expire(self, dataset: str) -> None:
        """Fetch ``dataset``'s table again soon (an owner failed, or the version moved on)."""
        if dataset in self._tables:
            self._due[dataset] = self._fetched.get(dataset, 0.0) + self.refresh

    def version(self, dataset: str) -> str | None:
        """The version of the table held for ``dataset`` (``None``: no table)."""
        table = self._tables.get(dataset)
        return table.version if table is not None else None

    def owner(self, dataset: str, index: int) -> str | None:
        """The URL of the node that owns sample ``index`` (``None``: no table)."""
        table = self._tables.get(dataset) if self.enabled else None
        return table.owner_of(index) if table is not None and table.urls else None

    def split(self, dataset: str, indices: list[int]) -> list[Part]:
        """The batch as one part per owner (a single ownerless part without a table)."""
        table = self._tables.get(dataset) if self.enabled else None
        if table is None or not table.urls:
            return [Part(None, list(range(len(indices))), indices)]
        parts: dict[str | None, Part] = {}
        for position, index in enumerate(indices):
            owner = table.owner_of(index)
            part = parts.get(owner)
            if part is None:
                part = parts[owner] = Part(owner, [], [])
            part.positions.append(position)
            part.indices.append(index)
        return list(parts.values())


def merge_order(parts: list[Part]) -> list[tuple[int, int]]:
    """For each position of the batch, in order: ``(part, row within that part's answer)``."""
    order: list[tuple[int, int]] = [(0, 0)] * sum(len(p.positions) for p in parts)
    for number, part in enumerate(parts):
        for row, position in enumerate(part.positions):
            order[position] = (number, row)
    return order


class Via:
    """Where the tries of one request go: its owner first, then the client's rotation.

    Moving off the owner expires the dataset's routing table, so the next batch asks
    for a fresh one. A request with no owner (no table, or one naming no owners, as a
    single service's) expires nothing: a fresh table would say the same.
    """

    def __init__(self, endpoints: Endpoints, router: Router, dataset: str, owner: str | None):
        self.endpoints = endpoints
        self.router = router
        self.dataset = dataset
        self.owner = owner
        self.routed = owner is not None

    def pick(self) -> str:
        owner, self.owner = self.owner, None
        if owner is not None:
            return owner
        if self.routed:
            self.router.expire(self.dataset)
        return self.endpoints.pick()


def routing_path(dataset: str) -> str:
    """Path of ``GET /v1/datasets/{name}/routing``."""
    return f"/v1/datasets/{quote(dataset, safe='')}/routing"


def sample_path(dataset: str, index: int, field: str | None = None) -> str:
    """Path of the per-sample routes: ``/v1/datasets/{name}/samples/{i}[/{field}]``."""
    path = f"/v1/datasets/{quote(dataset, safe='')}/samples/{operator.index(index)}"
    return path if field is None else f"{path}/{quote(field, safe='')}"


def dataset_path(dataset: str | None = None) -> str:
    """Path of ``GET /v1/datasets`` or of one dataset's description."""
    return "/v1/datasets" if dataset is None else f"/v1/datasets/{quote(dataset, safe='')}"


def plan_path(dataset: str, plan_id: str | None = None) -> str:
    path = f"{dataset_path(dataset)}/plans"
    return path if plan_id is None else f"{path}/{quote(plan_id, safe='')}"


def batch_body(dataset: str, indices: list[int], fields: Sequence[str] | None,
               continue_on_error: bool) -> bytes:
    """JSON body of ``POST /v1/batch``, encoded."""
    body: dict[str, Any] = {"dataset": dataset, "indices": indices, "format": "tar",
                            "continue_on_error": continue_on_error}
    if fields is not None:
        body["fields"] = list(fields)
    return json.dumps(body, separators=(",", ":")).encode()


def announced_length(headers: Mapping[str, str], default: int) -> int:
    """A batch answer's length as its head states it (``Content-Length``, else the service's
    estimate, ``LENGTH_HEADER``); ``default`` when it states none a number."""
    for name in ("content-length", LENGTH_HEADER):
        value = headers.get(name, "")
        if value.isdigit():
            return int(value)
    return default


def transport_error(url: str, exc: httpx.HTTPError) -> ShardfeedConnectionError:
    """Our error for an httpx transport failure (refused, timed out, reset mid-stream)."""
    connect = isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout))
    reason = str(exc) or type(exc).__name__
    return ShardfeedConnectionError(url, f"{type(exc).__name__}: {reason}", connect=connect)


def status_error(status: int, headers: Mapping[str, str], body: bytes, url: str) -> ShardfeedHTTPError:
    """Our error for an error status, with the service's ``{"error": {code, message}}``."""
    code, message = httpx.codes.get_reason_phrase(status).lower().replace(" ", "_") or "error", ""
    try:
        error = httpx.Response(status, content=body[:ERROR_BODY_LIMIT]).json()["error"]
        code, message = str(error["code"]), str(error["message"])
    except Exception:  # not our JSON (a proxy's page, a truncated body): show the start of it
        message = body[:200].decode("utf-8", "replace").strip() or "(no message)"
    return ShardfeedHTTPError(status, code, message, url, retry_after(headers.get("retry-after")))


def retry_after(value: str | None) -> float | None:
    """Seconds from a ``Retry-After`` header (delta-seconds or an HTTP date)."""
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        return max(0.0, email.utils.parsedate_to_datetime(value).timestamp() - time.time())
    except (TypeError, ValueError):
        return None


def parse_json(response: httpx.Response) -> Any:
    """The JSON body of a successful response."""
    try:
        return response.json()
    except ValueError:
        raise ShardfeedError(f"malformed response from {response.url}: body is not JSON") from None
