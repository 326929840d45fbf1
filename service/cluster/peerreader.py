"""The link to one other node: its sub-batch reads (``POST /v1/internal/read``), and the
session its health checks and relays go over (``peers.Cluster``)."""

from __future__ import annotations

import asyncio
import json
from typing import TYPE_CHECKING

import aiohttp

from shardfeed.service.datasets.dataset import Dataset
from shardfeed.service.datasets.index import Members

if TYPE_CHECKING:  # the cluster makes its readers
    from shardfeed.service.cluster.peers import Cluster


class PeerError(Exception):
    """A peer did not answer a sub-batch in time, or answered with an error."""


class PeerReader:
    """Sub-batches for one node: ``POST /v1/internal/read`` over TCP to another replica,
    or over a Unix socket to a sibling worker (which reads them itself: ``scope: node``).

    A sibling that is slow is busy, not down (a dead one's socket refuses connections at
    once), so a timeout marks only a replica down: ownership stays put on a loaded host.
    """

    def __init__(self, cluster: Cluster, node: int):
        self.cluster = cluster
        self.node = node
        self.target = cluster.peers[node]
        self.kind = "worker" if cluster.is_worker(node) else "replica"
        scheme = "https" if cluster.tls else "http"
        # A sibling's certificate names the host, not its socket: the socket's permissions vouch for it.
        self.base = f"{scheme}://worker" if self.target.socket else self.target.url
        self.ssl = False if self.target.socket else None
        self.scope = "node" if self.target.socket else "host"
        self._session: aiohttp.ClientSession | None = None

    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            connector = (aiohttp.UnixConnector(self.target.socket, limit=64) if self.target.socket
                         else aiohttp.TCPConnector(limit=64))
            self._session = aiohttp.ClientSession(connector=connector)
        return self._session

    async def read(self, dataset: Dataset, members: Members) -> list[memoryview]:
        """The bytes of ``members`` (all found) as read by the node; ``PeerError`` otherwise,
        also when the node holds another version of the dataset (its shard codes and
        offsets may mean other bytes)."""
        target, metrics = self.target, self.cluster.metrics
        sizes = members.size.tolist()
        body = json.dumps({"dataset": dataset.name, "version": dataset.version,
                           "shard": members.shard.tolist(), "scope": self.scope,
                           "offset": members.offset.tolist(), "size": sizes})
        timeout = self.cluster.timeout + sum(sizes) / 50e6
        try:
            async with self.session().post(f"{self.base}/v1/internal/read", data=body, ssl=self.ssl, headers={
                    **self.cluster.headers, "Content-Type": "application/json"},
                    timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
                if resp.status != 200:
                    raise PeerError(f"{self.kind} {target.id} answered {resp.status}: {(await resp.text())[:200]}")
                payload = await resp.read()
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as err:
            if self.kind == "replica" or not isinstance(err, asyncio.TimeoutError):
                self.cluster.mark(self.node, up=False, why=f"{type(err).__name__}: {err}")
            metrics.peer_requests.labels(target.id, self.kind, "error").inc()
            raise PeerError(f"{self.kind} {target.id} unreachable: {err!r}") from None
        except PeerError:
            metrics.peer_requests.labels(target.id, self.kind, "error").inc()
            raise
        if len(payload) != sum(sizes):
            metrics.peer_requests.labels(target.id, self.kind, "error").inc()
            raise PeerError(f"{self.kind} {target.id} sent {len(payload)} bytes, expected {sum(sizes)}")
        metrics.peer_requests.labels(target.id, self.kind, "ok").inc()
        view, out, pos = memoryview(payload), [], 0
        for size in sizes:
            out.append(view[pos:pos + size])
            pos += size
        return out

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
