"""``GET /v1/datasets/{name}/routing``: which node owns which samples, for client-side routing.

A client that sends each owner its own part of a batch saves the hop from the node it
reached to the owner (another replica, or a sibling worker). The table is advisory: any
node serves any batch correctly, so a stale table costs a hop or a retry, never a wrong
sample. ``version`` changes whenever ownership may have (a node went down or came back, the
dataset was reopened at another version);
every batch answer carries the answering node's version in ``X-Shardfeed-Routing``, so a
client notices a stale table and fetches a new one.

Owners are URLs: a replica's URL from ``--peers``; for this host's workers, that URL (or,
without peers, the one the client used) with the port replaced by the worker's own port;
for a lone process, nothing (``urls`` is empty: no routing to do).
"""

from __future__ import annotations

import numpy as np
from fastapi import APIRouter, Request
from starlette.datastructures import URL

from shardfeed.service.api.common import AppState
from shardfeed.service.cluster.peers import Cluster
from shardfeed.service.datasets.dataset import Dataset

ROUTING_HEADER = "X-Shardfeed-Routing"
"""Response header of batch answers: the answering node's routing table version."""

router = APIRouter(tags=["datasets"])


@router.get("/v1/datasets/{name}/routing")
async def routing_table(name: str, request: Request, state: AppState) -> dict:
    """``{"dataset", "version", "starts", "owner", "urls"}``: samples ``starts[i]`` up to
    ``starts[i + 1]`` are owned by ``urls[owner[i]]``."""
    dataset = state.dataset(name)
    cluster = state.cluster
    if cluster is None:
        return {"dataset": name, "version": "", "starts": [], "owner": [], "urls": []}
    starts, shards = dataset.index.shard_runs()
    nodes = cluster.owners(dataset.url, dataset.index.shards, shards)
    used, owner = np.unique(nodes, return_inverse=True)
    return {"dataset": name, "version": routing_version(cluster, dataset), "starts": starts.tolist(),
            "owner": owner.tolist(),
            "urls": [_url(request, cluster, int(node)) for node in used]}


def routing_version(cluster: Cluster, dataset: Dataset) -> str:
    """The version of a dataset's table: ownership's and the dataset's own (a reopened dataset
    may number its shards and samples anew)."""
    return f"{cluster.version()}.{dataset.version}"


def _url(request: Request, cluster: Cluster, node: int) -> str:
    if not cluster.is_worker(node):
        return cluster.peers[node].url
    # This host: as named in --peers (clients reach replicas there), else as the client reached it.
    base = URL(cluster.hosts[cluster.host].url) if len(cluster.hosts) > 1 else request.base_url
    if len(cluster.workers) > 1:
        base = base.replace(port=URL(cluster.workers[node].url).port)
    return str(base).rstrip("/")
