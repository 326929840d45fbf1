"""Replicas: shard ownership by rendezvous (HRW) hashing, peer health, and sub-batch reads.

Every replica lists the same peers. Each shard is owned by the live peer with the
highest hash of (peer id, dataset URL, shard path), so every replica computes the same
owner without talking to the others, and when a peer goes down only its shards move.
The coalescer sends the members of shards owned elsewhere to their owner in one
``POST /v1/internal/read`` per owner; if the owner is down or misses the deadline, the
replica reads those members from the store itself, so no sample is lost.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
from dataclasses import dataclass
from urllib.parse import urlparse

import aiohttp
import numpy as np

from .index import Members
from .metrics import Metrics

log = logging.getLogger("shardfeed.peers")


class PeerError(Exception):
    """A peer did not answer a sub-batch in time, or answered with an error."""


@dataclass
class Peer:
    id: str
    url: str
    up: bool = True


def parse_peers(spec: str, node_id: str) -> tuple[list[Peer], int]:
    """Peers from ``URL,URL,...`` or ``ID=URL,...``, and the position of this node among them.

    Without ``ID=``, a peer's id is its URL's host name, or ``host:port`` when several
    peers share a host (replicas on one machine, different ports); this node is the peer
    whose id, URL, or first host label equals ``node_id`` (``shardfeed-0`` matches
    ``http://shardfeed-0.shardfeed-peers:8080``).
    """
    named: list[tuple[str, str]] = []  # (given id or "", URL)
    for entry in filter(None, (e.strip() for e in spec.split(","))):
        name, sep, url = entry.partition("=")
        if not sep:
            name, url = "", entry
        parsed = urlparse(url)
        try:
            parsed.port
        except ValueError:
            raise ValueError(f"peer {entry!r} has a bad port") from None
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise ValueError(f"peer {entry!r} is not an http(s) URL")
        named.append((name, url.rstrip("/")))
    hosts = [urlparse(url).hostname for name, url in named if not name]
    shared = {h for h in hosts if hosts.count(h) > 1}
    peers = [Peer(name or _default_id(url, shared), url) for name, url in named]
    ids = [p.id for p in peers]
    if len(set(ids)) != len(ids):
        raise ValueError(f"peer ids must be unique (got {', '.join(ids)}); name them with ID=URL")
    exact = [i for i, p in enumerate(peers) if node_id in (p.id, p.url)]
    if exact:
        return peers, exact[0]
    by_host = [i for i, p in enumerate(peers)
               if node_id in (urlparse(p.url).hostname, urlparse(p.url).hostname.split(".")[0])]
    if len(by_host) > 1:
        raise ValueError(f"--node-id {node_id!r} matches several of --peers ({', '.join(ids)}); "
                         "give this replica's id or URL")
    if by_host:
        return peers, by_host[0]
    raise ValueError(f"--node-id {node_id!r} is not one of --peers ({', '.join(ids)})")


def _default_id(url: str, shared_hosts: set[str]) -> str:
    """A peer's id when not named: its host name, or ``host:port`` on a host shared with another peer."""
    parsed = urlparse(url)
    if parsed.hostname not in shared_hosts:
        return parsed.hostname
    return f"{parsed.hostname}:{parsed.port or (443 if parsed.scheme == 'https' else 80)}"


def _score(peer: str, dataset_url: str, shard: str) -> int:
    digest = hashlib.blake2b(f"{peer}\0{dataset_url}\0{shard}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


class Cluster:
    """This replica's view of its peers.

    Args:
        peers: every replica, this one included, in the same order on all replicas.
        me: this replica's position in ``peers``.
        token: bearer token for peer requests (the cluster shares its tokens).
        timeout: seconds a sub-batch may take before the data is read from the store
            instead; grows by one second per 50 MB asked for.
        health_interval: seconds between health checks of each peer.
    """

    def __init__(self, peers: list[Peer], me: int, metrics: Metrics, *, token: str | None = None,
                 timeout: float = 2.0, health_interval: float = 1.0):
        self.peers = peers
        self.me = me
        self.metrics = metrics
        self.timeout = timeout
        self.health_interval = health_interval
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._ranks: dict[str, np.ndarray] = {}
        self._session: aiohttp.ClientSession | None = None
        self._health: asyncio.Task | None = None

    @property
    def node_id(self) -> str:
        return self.peers[self.me].id

    def describe(self) -> dict:
        return {"node_id": self.node_id,
                "peers": [{"id": p.id, "url": p.url, "up": p.up, "self": i == self.me}
                          for i, p in enumerate(self.peers)]}

    # -- ownership ---------------------------------------------------------------------
    def rank(self, dataset_url: str, shards: list[str]) -> np.ndarray:
        """Per shard, the peers in preference order (computed once per dataset)."""
        ranks = self._ranks.get(dataset_url)
        if ranks is None:
            scores = np.array([[_score(p.id, dataset_url, s) for p in self.peers] for s in shards], dtype=np.uint64)
            ranks = self._ranks[dataset_url] = np.argsort(scores, axis=1)[:, ::-1]
        return ranks

    def owners(self, dataset_url: str, shards: list[str], shard_codes: np.ndarray) -> np.ndarray:
        """The live owner of each shard code (this replica counts as live)."""
        live = np.array([p.up or i == self.me for i, p in enumerate(self.peers)])
        ranks = self.rank(dataset_url, shards)[shard_codes]
        first_live = np.argmax(live[ranks], axis=1)
        return ranks[np.arange(len(ranks)), first_live]

    # -- sub-batches -------------------------------------------------------------------
    async def read(self, peer: int, dataset: str, members: Members) -> list[bytes]:
        """The bytes of ``members`` (all found) as read by ``peer``; ``PeerError`` otherwise."""
        target = self.peers[peer]
        sizes = members.size.tolist()
        body = json.dumps({"dataset": dataset, "shard": members.shard.tolist(),
                           "offset": members.offset.tolist(), "size": sizes})
        timeout = self.timeout + sum(sizes) / 50e6
        try:
            async with self._client().post(f"{target.url}/v1/internal/read", data=body, headers={
                    **self._headers, "Content-Type": "application/json"},
                    timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
                if resp.status != 200:
                    raise PeerError(f"peer {target.id} answered {resp.status}: {(await resp.text())[:200]}")
                payload = await resp.read()
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as err:
            self.mark(peer, up=False, why=f"{type(err).__name__}: {err}")
            self.metrics.peer_requests.labels(target.id, "error").inc()
            raise PeerError(f"peer {target.id} unreachable: {err!r}") from None
        except PeerError:
            self.metrics.peer_requests.labels(target.id, "error").inc()
            raise
        if len(payload) != sum(sizes):
            self.metrics.peer_requests.labels(target.id, "error").inc()
            raise PeerError(f"peer {target.id} sent {len(payload)} bytes, expected {sum(sizes)}")
        self.metrics.peer_requests.labels(target.id, "ok").inc()
        view, out, pos = memoryview(payload), [], 0
        for size in sizes:
            out.append(view[pos:pos + size])
            pos += size
        return out

    # -- health ------------------------------------------------------------------------
    def mark(self, peer: int, *, up: bool, why: str = "") -> None:
        target = self.peers[peer]
        if target.up != up:
            log.warning("peer %s is %s%s", target.id, "up" if up else "down", f" ({why})" if why else "")
            target.up = up
            self.metrics.peers_up.set(sum(p.up for p in self.peers))

    async def _check(self, peer: int) -> None:
        try:
            async with self._client().get(f"{self.peers[peer].url}/healthz",
                                          timeout=aiohttp.ClientTimeout(total=self.health_interval)) as resp:
                self.mark(peer, up=resp.status == 200, why=f"health check {resp.status}")
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as err:
            self.mark(peer, up=False, why=f"health check: {type(err).__name__}")

    async def _health_loop(self) -> None:
        while True:
            await asyncio.gather(*(self._check(i) for i in range(len(self.peers)) if i != self.me))
            await asyncio.sleep(self.health_interval)

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=64))
        return self._session

    def start(self) -> None:
        self.metrics.peers_up.set(len(self.peers))
        self._health = asyncio.create_task(self._health_loop())

    async def close(self) -> None:
        if self._health is not None:
            self._health.cancel()
            await asyncio.gather(self._health, return_exceptions=True)
        if self._session is not None:
            await self._session.close()
