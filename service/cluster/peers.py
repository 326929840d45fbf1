"""Replicas and workers: shard ownership by rendezvous (HRW) hashing, health, sub-batch reads.

Every replica lists the same peers (a source may change them: ``replace_hosts``). Each shard is
owned by the live peer with the highest hash of (peer id, dataset URL, shard path), so every
replica computes the same owner without talking to the others; when a peer goes down, leaves
or joins, only the shards it loses or takes move.
A replica started with ``--workers N`` is N processes (``workers.py``); a shard the
replica owns is owned, in turn, by one of its live workers, by the same hashing over
the worker ids. Together that is a two-level owner: host, then worker.

The coalescer sends the members of shards owned elsewhere to their owner in one
``POST /v1/internal/read`` per owner: over TCP to another replica, over a Unix socket to
a sibling worker (``peerreader.py``), for the blocks that sibling has not cached (those it
has are read from its directory, ``siblings.py``). If the owner is down or misses the deadline, the
members are read from the store here instead, so no sample is lost. While a sibling worker
is down, its shards have a stand-in owner (the next live worker by the same hashing), but
its directory is still read first (``down_homes``).

What a client tells one node about its future reads (plans) is relayed to the others
(``Cluster.relay``): each node reads ahead of the plan for the shards it owns.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import numpy as np

from shardfeed.service.cluster.peerreader import PeerError, PeerReader
from shardfeed.service.observe.metrics import Metrics

log = logging.getLogger("shardfeed.peers")


COPY_HEADER = "X-Shardfeed-Copy"
"""Marks a request one node relays to others (``Cluster.relay``): ``host`` when another
replica sent it (relay it on to this host's workers), ``node`` when a sibling worker did
(keep it here)."""

COPIES = ("host", "node")


@dataclass
class Peer:
    id: str
    url: str
    up: bool = True
    socket: str | None = None
    """A sibling worker's Unix socket: its sub-batches go there rather than to ``url``."""
    cache_dir: Path | None = None
    """A sibling worker's block cache directory, read directly (``siblings.py``)."""
    counters: Path | None = None
    """A sibling worker's kept counters, read while it does not answer (``keptcounters.py``)."""


def _score(peer: str, dataset_url: str, shard: str) -> int:
    digest = hashlib.blake2b(f"{peer}\0{dataset_url}\0{shard}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


class Cluster:
    """This process's view of the replicas and of its sibling workers.

    Nodes are the places a sub-batch can go: this host's workers (this one included,
    at ``me``), then the other replicas.

    Args:
        hosts: every replica, this one included, in the same order on all replicas
            (one entry, this host, when there are no peers).
        host: this replica's position in ``hosts``.
        workers: this replica's worker processes, with their Unix sockets (``None``:
            one process, this one).
        worker: this process's position in ``workers``.
        token: bearer token for peer requests (the cluster shares its tokens).
        timeout: seconds a sub-batch may take before the data is read from the store
            instead; grows by one second per 50 MB asked for.
        health_interval: seconds between health checks of each node.
        tls: whether the nodes speak HTTPS (sibling sockets included).
        follow: a task that keeps ``hosts`` those the membership source names, through
            ``replace_hosts`` (``sources.follow``); ``None``: a fixed set.
    """

    def __init__(self, hosts: list[Peer], host: int, metrics: Metrics, *, workers: list[Peer] | None = None,
                 worker: int = 0, token: str | None = None, timeout: float = 2.0,
                 health_interval: float = 1.0, tls: bool = False,
                 follow: Callable[[Cluster], Awaitable[None]] | None = None):
        self.workers = workers or [hosts[host]]
        self.me = worker
        self._lone_process = workers is None
        self._set_hosts(hosts, host)
        self.metrics = metrics
        self.timeout = timeout
        self.health_interval = health_interval
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        # Each kept with the shard list it was drawn from: a reopened dataset (another
        # version) brings another list, and is ranked anew.
        self._ranks: dict[tuple[str, str], tuple[list[str], np.ndarray]] = {}
        self._owners: dict[tuple[str, bool], tuple[list[str], np.ndarray]] = {}
        self._readers: dict[int, PeerReader] = {}
        self.tls = tls
        self._health: asyncio.Task | None = None
        self._follow = follow
        self._following: asyncio.Task | None = None
        self._version: str | None = None

    def _set_hosts(self, hosts: list[Peer], host: int) -> None:
        self.hosts = hosts
        self.host = host
        if self._lone_process:
            self.workers = [hosts[host]]
        self.peers = self.workers + [p for i, p in enumerate(hosts) if i != host]
        """Every node: this host's workers first, then the other replicas."""
        self._host_node = np.array([-1 if i == host else len(self.workers) + i - (i > host)
                                    for i in range(len(hosts))], dtype=np.int64)
        self._node_host = np.array([host] * len(self.workers) + [i for i in range(len(hosts)) if i != host],
                                   dtype=np.int64)

    async def replace_hosts(self, hosts: list[Peer], host: int) -> bool:
        """Take the replicas a membership source names now (``sources.py``); ``False`` if they
        are those known. Ownership is ranked anew over them, so only the shards rendezvous
        hashing moves change owner, and the routing version changes. A replica known before
        keeps its state; a new one is down (owns nothing) until its health check answers, so
        it takes its share once it can serve it; one left out is dropped, its reader closed."""
        if [(p.id, p.url) for p in hosts] == [(p.id, p.url) for p in self.hosts] and hosts[host].id == self.node_id:
            return False
        known = {(p.id, p.url): p for p in self.hosts}
        hosts = [known.get((p.id, p.url), p) for p in hosts]
        for i, peer in enumerate(hosts):
            if (peer.id, peer.url) not in known:
                peer.up = i == host
        readers = {id(reader.target): reader for node, reader in self._readers.items() if not self.is_worker(node)}
        self._set_hosts(hosts, host)
        self._readers = {node: reader for node, reader in self._readers.items() if self.is_worker(node)}
        for node in range(len(self.workers), len(self.peers)):
            if (reader := readers.pop(id(self.peers[node]), None)) is not None:
                reader.node, self._readers[node] = node, reader
        self._ranks = {key: kept for key, kept in self._ranks.items() if key[0] != "hosts"}
        self._owners.clear()
        self._version = None
        self.metrics.peers_up.set(sum(p.up for p in self.hosts))
        for reader in readers.values():  # in flight, a dropped replica's read fails over to the store
            reader.node = None
            await reader.close()
        return True

    @property
    def node_id(self) -> str:
        return self.hosts[self.host].id

    def describe(self) -> dict:
        return {"node_id": self.node_id,
                "peers": [{"id": p.id, "url": p.url, "up": p.up, "self": i == self.host}
                          for i, p in enumerate(self.hosts)],
                "workers": [{"id": p.id, "url": p.url, "up": p.up, "self": i == self.me}
                            for i, p in enumerate(self.workers)] if len(self.workers) > 1 else []}

    def version(self) -> str:
        """Changes whenever the owner of some shard may have changed: a digest of the live
        replicas and of this host's down workers, so that every node agrees on it while
        all are up, whatever their worker counts."""
        if self._version is None:
            hosts = ",".join(f"{p.id}={int(p.up or i == self.host)}" for i, p in enumerate(self.hosts))
            down = ",".join(p.id for i, p in enumerate(self.workers) if not p.up and i != self.me)
            self._version = hashlib.blake2b(f"{hosts};{down}".encode(), digest_size=6).hexdigest()
        return self._version

    # -- ownership ---------------------------------------------------------------------
    def rank(self, dataset_url: str, shards: list[str], level: str = "hosts") -> np.ndarray:
        """Per shard, the hosts (or this host's workers) in preference order (once per dataset)."""
        kept = self._ranks.get((level, dataset_url))
        if kept is not None and kept[0] is shards:
            return kept[1]
        members = self.hosts if level == "hosts" else self.workers
        scores = np.array([[_score(p.id, dataset_url, s) for p in members] for s in shards], dtype=np.uint64)
        ranks = np.argsort(scores, axis=1)[:, ::-1]
        self._ranks[level, dataset_url] = (shards, ranks)
        return ranks

    def owners(self, dataset_url: str, shards: list[str], shard_codes: np.ndarray, *,
               within_host: bool = False) -> np.ndarray:
        """The live owner (a node) of each shard code; this process counts as live.

        ``within_host`` picks among this host's workers only, for the shards a peer sent
        here because it takes this host for their owner.
        """
        return self._owner_table(dataset_url, shards, within_host)[shard_codes]

    def _owner_table(self, dataset_url: str, shards: list[str], within_host: bool) -> np.ndarray:
        """Every shard's live owner, ranked once per dataset until a node goes up or down
        (``mark``): a batch then costs one gather instead of a ranking."""
        kept = self._owners.get((dataset_url, within_host))
        if kept is not None and kept[0] is shards:
            return kept[1]
        codes = np.arange(len(shards))
        owner = np.empty(len(codes), dtype=np.int64)
        mine = np.ones(len(codes), dtype=bool)
        if len(self.hosts) > 1 and not within_host:
            host = _first_live(self.rank(dataset_url, shards)[codes], self.hosts, self.host)
            owner[:] = self._host_node[host]
            mine = host == self.host
        if mine.any():
            ranks = self.rank(dataset_url, shards, "workers")[codes[mine]]
            owner[mine] = _first_live(ranks, self.workers, self.me)
        self._owners[dataset_url, within_host] = (shards, owner)
        return owner

    def down_homes(self, dataset_url: str, shards: list[str], shard_codes: np.ndarray,
                   owner: np.ndarray) -> np.ndarray:
        """Per shard code, the sibling worker that owns it while every worker is up, where that
        worker is down now and ``owner`` (its owner from ``owners``) stands in for it; -1
        elsewhere. A down worker's slabs stay in its directory while it restarts."""
        home = np.full(len(shard_codes), -1, dtype=np.int64)
        here = owner < len(self.workers)  # the others are replicas': their hosts sort them out
        if len(self.workers) > 1 and here.any():
            first = self.rank(dataset_url, shards, "workers")[shard_codes[here], 0]
            home[here] = np.where(first != owner[here], first, -1)
        return home

    def host_of(self, nodes: np.ndarray) -> np.ndarray:
        """The replica (position in ``hosts``) of each node."""
        return self._node_host[nodes]

    def is_worker(self, node: int) -> bool:
        """Whether ``node`` is one of this host's workers (else another replica)."""
        return node < len(self.workers)

    def reader(self, node: int) -> PeerReader:
        """The reader of sub-batches for ``node`` (not this process); ``PeerError`` for a node
        that a change of replicas (``replace_hosts``) has dropped since it was picked."""
        if node >= len(self.peers):
            raise PeerError(f"node {node} left the cluster")
        reader = self._readers.get(node)
        if reader is None:
            reader = self._readers[node] = PeerReader(self, node)
        return reader

    # -- relays ------------------------------------------------------------------------
    def relay_targets(self, copy: str | None) -> list[tuple[int, str]]:
        """The nodes a request that came as ``copy`` (``None``: from a client) goes on to,
        each with the copy it is sent as: a client's request to every other node (this
        host's workers, one worker of each other replica, which relays it to its siblings)."""
        targets = [(node, "node") for node in range(len(self.workers)) if node != self.me] if copy != "node" else []
        if copy is None:
            targets += [(node, "host") for node in range(len(self.workers), len(self.peers))]
        return targets

    async def relay(self, method: str, path: str, body: bytes, copy: str | None,
                    headers: dict[str, str] | None = None, timeout: float | None = None,
                    down_too: bool = False) -> None:
        """Send a request this node has carried out on to ``relay_targets(copy)``, at once and
        within ``timeout`` seconds (default the peers' ``timeout``). Best effort: a node that
        is down, refuses or is late is logged and left out (it goes on without what the
        request said). ``down_too``: also to the nodes believed down (one just restarted may
        not be known up yet), for what a node must not miss (a dataset added or removed)."""
        async def one(reader: PeerReader, copy_as: str) -> None:
            try:
                async with reader.session().request(
                        method, f"{reader.base}{path}", data=body, ssl=reader.ssl,
                        headers={**self.headers, **(headers or {}), COPY_HEADER: copy_as,
                                 "Content-Type": "application/json"},
                        timeout=aiohttp.ClientTimeout(total=timeout or self.timeout)) as resp:
                    if resp.status >= 300:
                        log.warning("%s %s refused %s %s: %d %s", reader.kind, reader.target.id, method, path,
                                    resp.status, (await resp.text())[:200])
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as err:
                log.warning("%s %s did not take %s %s: %s", reader.kind, reader.target.id, method, path,
                            type(err).__name__)

        await asyncio.gather(*(one(self.reader(node), copy_as) for node, copy_as in self.relay_targets(copy)
                               if down_too or self.peers[node].up))

    # -- health ------------------------------------------------------------------------
    def mark(self, node: int | None, *, up: bool, why: str = "") -> None:
        """Mark ``node`` up or down; ``None``: a replica dropped since (``replace_hosts``)."""
        if node is None:
            return
        target = self.peers[node]
        if target.up != up:
            log.warning("%s %s is %s%s", "worker" if self.is_worker(node) else "peer", target.id,
                        "up" if up else "down", f" ({why})" if why else "")
            target.up = up
            self._version = None
            self._owners.clear()
            self.metrics.peers_up.set(sum(p.up for p in self.hosts))

    async def _check(self, reader: PeerReader) -> None:
        """One health check; marks ``reader.node``, which a change of replicas may have moved meanwhile."""
        try:
            async with reader.session().get(f"{reader.base}/healthz", ssl=reader.ssl,
                                            timeout=aiohttp.ClientTimeout(total=self.health_interval)) as resp:
                self.mark(reader.node, up=resp.status == 200, why=f"health check {resp.status}")
        except asyncio.TimeoutError:
            if reader.kind == "replica":
                self.mark(reader.node, up=False, why="health check timed out")
        except (aiohttp.ClientError, OSError) as err:
            self.mark(reader.node, up=False, why=f"health check: {type(err).__name__}")

    async def _health_loop(self) -> None:
        while True:
            await asyncio.gather(*(self._check(self.reader(i)) for i in range(len(self.peers)) if i != self.me))
            await asyncio.sleep(self.health_interval)

    def start(self) -> None:
        self.metrics.peers_up.set(len(self.hosts))
        self._health = asyncio.create_task(self._health_loop())
        if self._follow is not None:
            self._following = asyncio.create_task(self._follow(self))

    async def close(self) -> None:
        for task in filter(None, (self._health, self._following)):
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        for reader in self._readers.values():
            await reader.close()


def _first_live(ranks: np.ndarray, members: list[Peer], me: int) -> np.ndarray:
    """Per row of ``ranks``, the first member that is up (``me`` always is)."""
    live = np.array([p.up or i == me for i, p in enumerate(members)])
    return ranks[np.arange(len(ranks)), np.argmax(live[ranks], axis=1)]
