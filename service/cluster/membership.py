"""Who the cluster's members are: replicas from ``--peers``, sibling workers from ``--workers``.

``parse_peers`` reads the ``--peers`` list; ``build_cluster`` makes this process's
``Cluster`` (``peers.py``) from the configuration: the replicas it lists, and the
sibling workers of this host with their ports, sockets, cache and counter directories.
"""

from __future__ import annotations

import logging
from urllib.parse import urlparse

from shardfeed.service.cluster.peers import Cluster, Peer
from shardfeed.service.config import ServiceConfig
from shardfeed.service.observe.metrics import Metrics

log = logging.getLogger("shardfeed.peers")


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


def build_cluster(config: ServiceConfig, metrics: Metrics) -> Cluster | None:
    """This process's cluster: replicas from ``peers``, sibling workers from ``worker``;
    ``None`` for a lone single-process service."""
    if not config.peers and config.worker is None:
        return None
    scheme = "https" if config.tls_cert else "http"
    host = f"[{config.host}]" if ":" in config.host else config.host
    if config.peers:
        hosts, me = parse_peers(config.peers, config.node_id)
        log.info("replica %s of %d: %s", hosts[me].id, len(hosts), ", ".join(p.url for p in hosts))
    else:
        hosts, me = [Peer(config.node_id or "local", f"{scheme}://{host}:{config.port}")], 0
    workers, worker = None, 0
    if config.worker is not None:
        place = config.worker
        workers = [Peer(f"w{i}", f"{scheme}://{host}:{port}", socket=path,
                        cache_dir=place.cache_dirs[i], counters=place.counter_dirs[i])
                   for i, (port, path) in enumerate(zip(place.ports, place.sockets))]
        worker = place.index
    return Cluster(hosts, me, metrics, workers=workers, worker=worker, token=min(config.tokens, default=None),
                   timeout=config.peer_timeout, tls=config.tls_cert is not None)
