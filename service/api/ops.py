"""Operations: liveness, Prometheus metrics, the cluster map."""

from __future__ import annotations

from fastapi import APIRouter
from starlette.responses import Response

from .common import AppState

router = APIRouter(tags=["ops"])


@router.get("/healthz")
async def healthz(state: AppState) -> dict:
    return {"status": "ok", "datasets": len(state.datasets)}


@router.get("/metrics", response_class=Response)
async def prometheus(state: AppState) -> Response:
    return Response(state.metrics.render(), media_type="text/plain; version=0.0.4")


@router.get("/v1/cluster")
async def cluster_map(state: AppState) -> dict:
    """This replica and its peers; a client may route batches to shard owners itself."""
    if state.cluster is None:
        return {"node_id": None, "peers": []}
    return state.cluster.describe()
