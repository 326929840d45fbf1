"""Where each request goes: the client's URLs, and the owner of each sample.

:class:`Endpoints` rotates over the URLs the client was given and skips one that refused
a connection; :class:`Router` holds the service's routing tables and splits a batch into
one :class:`Part` per owning node; :class:`Via` says where the tries of one request go
(its owner first, then the rotation). Both clients use these as they are: no I/O here.
"""

from __future__ import annotations

import bisect
import math
import operator
import random
import time
from collections.abc import Sequence
from typing import NamedTuple, TypeVar

import numpy as np

from .errors import ShardfeedError

T = TypeVar("T")

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
            self._owner_codes = np.array([operator.index(o) for o in doc["owner"]], np.int64)
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            raise ShardfeedError(f"malformed routing table: {exc!r:.200}") from None
        if len(self.owner) != len(self.starts) or self.starts != sorted(self.starts):
            raise ShardfeedError("malformed routing table: starts and owners do not match")
        self._starts = np.array(self.starts, np.int64)
        self._urls = dict(enumerate(self.urls))

    def owner_of(self, index: int) -> str | None:
        run = bisect.bisect_right(self.starts, index) - 1
        return self.owner[run] if run >= 0 and self.owner else None

    def parts(self, indices: list[int]) -> list[Part]:
        """``indices`` as one part per owner, in the order each owner first appears: owners found
        with one ``searchsorted`` (a batch of 64 routed sample by sample cost about 40 us)."""
        runs = np.searchsorted(self._starts, np.asarray(indices, np.int64), side="right") - 1
        owners = np.where(runs >= 0, self._owner_codes[np.maximum(runs, 0)], -1)
        codes, first = np.unique(owners, return_index=True)
        parts = []
        for code in codes[np.argsort(first)].tolist():
            positions = np.flatnonzero(owners == code)
            parts.append(Part(self._urls.get(code), positions.tolist(), [indices[p] for p in positions.tolist()]))
        return parts


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
        return table.parts(indices)


def merge_order(parts: list[Part]) -> list[tuple[int, int]]:
    """For each position of the batch, in order: ``(part, row within that part's answer)``."""
    order: list[tuple[int, int]] = [(0, 0)] * sum(len(p.positions) for p in parts)
    for number, part in enumerate(parts):
        for row, position in enumerate(part.positions):
            order[position] = (number, row)
    return order


def merged(parts: list[Part], answers: list[list[T]]) -> list[T]:
    """The parts' answers (``answers[p]``: part ``p``'s samples) as one batch, in the order asked."""
    return [answers[part][row] for part, row in merge_order(parts)]


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

    def again(self, base: str) -> None:
        """The next try goes to ``base`` again (the same node, asked another way)."""
        self.owner = base
