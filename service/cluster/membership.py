"""Who the cluster's members are: replicas from a membership source, sibling workers from ``--workers``.

``build_cluster`` makes this process's ``Cluster`` (``peers.py``) from the configuration:
the replicas its membership source names now (``sources.py``: ``--peers``, or
``--peers-from``, followed while serving), and the sibling workers of this host with
their ports, sockets, cache and counter directories.
"""

from __future__ import annotations

import logging
from functools import partial

from shardfeed.service.cluster.peers import Cluster, Peer
from shardfeed.service.cluster.sources import MembershipError, follow, open_source
from shardfeed.service.config import ServiceConfig
from shardfeed.service.observe.metrics import Metrics

log = logging.getLogger("shardfeed.peers")


async def build_cluster(config: ServiceConfig, metrics: Metrics) -> Cluster | None:
    """This process's cluster: replicas from ``peers`` or ``peers_from``, sibling workers from
    ``worker``; ``None`` for a lone single-process service."""
    source = open_source(config)
    if source is None and config.worker is None:
        return None
    scheme = "https" if config.tls_cert else "http"
    host = f"[{config.host}]" if ":" in config.host else config.host
    hosts, me = [Peer(config.node_id or "local", f"{scheme}://{host}:{config.port}")], 0
    if source is not None:
        try:
            hosts, me = await source.peers()
        except MembershipError as err:  # a DNS name that does not list this replica yet: alone until it does
            log.warning("membership: %s; serving alone until it names this replica", err)
        log.info("replica %s of %d: %s", hosts[me].id, len(hosts), ", ".join(p.url for p in hosts))
    workers, worker = None, 0
    if config.worker is not None:
        place = config.worker
        workers = [Peer(f"w{i}", f"{scheme}://{host}:{port}", socket=path,
                        cache_dir=place.cache_dirs[i], counters=place.counter_dirs[i])
                   for i, (port, path) in enumerate(zip(place.ports, place.sockets))]
        worker = place.index
    return Cluster(hosts, me, metrics, workers=workers, worker=worker, token=min(config.tokens, default=None),
                   timeout=config.peer_timeout, tls=config.tls_cert is not None,
                   follow=None if source is None else partial(follow, source=source, interval=config.peers_refresh))
