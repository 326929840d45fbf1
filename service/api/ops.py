"""Operations: liveness, Prometheus metrics, the cluster map."""

from __future__ import annotations

import asyncio
import os

from fastapi import APIRouter, Request
from starlette.responses import Response

from shardfeed.service.api.common import AppState, on_public_port
from shardfeed.service.cluster.hostmetrics import sibling_counters, sibling_texts, summed

router = APIRouter(tags=["ops"])


@router.get("/healthz")
async def healthz(state: AppState) -> dict:
    # The pid lets a starter tell its own process from a stale one left on a reused port.
    return {"status": "ok", "datasets": len(state.datasets), "pid": os.getpid()}


@router.get("/metrics", response_class=Response)
async def prometheus(request: Request, state: AppState) -> Response:
    """This process's metrics; on the public port of ``--workers N``, the whole host's
    (every worker's summed, ``hostmetrics.py``)."""
    if not on_public_port(request, state):
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4")
    texts = await sibling_texts(state.cluster)
    body = await asyncio.to_thread(summed, state.metrics, texts, sibling_counters(state.cluster))
    return Response(body, media_type="text/plain; version=0.0.4")


@router.get("/v1/cluster")
async def cluster_map(state: AppState) -> dict:
    """This replica and its peers; a client may route batches to shard owners itself."""
    if state.cluster is None:
        return {"node_id": None, "peers": []}
    return state.cluster.describe()
