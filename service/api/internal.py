"""Replica to replica and worker to worker: the bytes of members of shards this node owns,
a worker's status figures, and the plans it holds (for a restarted sibling, ``plans/adopt.py``)."""

from __future__ import annotations

import json
import time
from typing import Annotated, Literal

import numpy as np
from fastapi import APIRouter, Query, Request
from pydantic import BaseModel, ConfigDict, Field, StrictInt
from starlette.responses import Response

from shardfeed.service.api.common import AppState, PartsResponse, json_body, read_json
from shardfeed.service.api.status import worker_figures
from shardfeed.service.datasets.index import Members
from shardfeed.service.http.errors import DatasetChanged, InvalidRequest, StoreUnavailable
from shardfeed.service.read.planner import pieces
from shardfeed.service.stores import StoreError

router = APIRouter(tags=["internal"])

RECHECK = 1.0
"""Seconds after a listing within which a sender of another version does not cause another."""


class RangeRead(BaseModel):
    """Body of ``POST /v1/internal/read``: members by shard code, offset and size."""

    model_config = ConfigDict(extra="forbid")
    dataset: str = Field(min_length=1, max_length=256)
    version: str | None = Field(None, max_length=64, description="The sender's ``Dataset.version``; "
                                "another version here is a 409 (shard codes and offsets would mean other bytes).")
    # Bounded, so that offset + size cannot overflow int64 and slip past the range check;
    # 2**53, so that a client reading the bound as a JSON double gets it exactly.
    shard: list[Annotated[StrictInt, Field(ge=0, lt=2**31)]]
    offset: list[Annotated[StrictInt, Field(ge=0, lt=2**53)]]
    size: list[Annotated[StrictInt, Field(ge=0, lt=2**53)]]
    scope: Literal["host", "node"] = Field(
        "host", description="host: a replica sent these, route them to the owning worker here; "
                            "node: a sibling worker sent them, read them here.")


@router.post("/v1/internal/read", response_class=Response, openapi_extra=json_body(RangeRead))
async def internal_read(request: Request, state: AppState) -> Response:
    """The members' bytes, concatenated in request order (sent from their pieces, unjoined)."""
    req = await read_json(request, RangeRead, 4 * state.config.max_body)
    dataset = state.dataset(req.dataset)
    if req.version is not None and req.version != dataset.version:
        if time.time() - dataset.checked > RECHECK:  # one of the two is out of date: look at the store
            state.datasets.changed(dataset)
        raise DatasetChanged(f"dataset {dataset.name!r} is at version {dataset.version} here, "
                             f"{req.version} at the sender")
    n = len(req.shard)
    if len(req.offset) != n or len(req.size) != n or n > 4 * state.config.max_batch:
        raise InvalidRequest("shard, offset and size must have the same, bounded length")
    shard = np.asarray(req.shard, dtype=np.int64) if n else np.zeros(0, np.int64)
    offset = np.asarray(req.offset, dtype=np.int64) if n else np.zeros(0, np.int64)
    size = np.asarray(req.size, dtype=np.int64) if n else np.zeros(0, np.int64)
    if n and ((shard >= len(dataset.index.shards)).any()
              or (offset + size > dataset.extents[shard]).any()):
        raise InvalidRequest("a range lies outside the dataset's shards")
    members = Members(position=np.arange(n), sample=np.zeros(n, np.int64), field=np.zeros(n, np.int32),
                      shard=shard.astype(np.int32), offset=offset, size=size, found=np.ones(n, bool),
                      row=np.full(n, -1, np.int64))
    payloads = await state.coalescer.read_members(dataset, members, scope=req.scope)
    for payload in payloads:
        if isinstance(payload, StoreError):
            raise StoreUnavailable(str(payload))
    return PartsResponse([piece for payload in payloads for piece in pieces(payload)], "application/octet-stream")


@router.get("/v1/internal/stats", response_class=Response)
async def internal_stats(state: AppState,
                         span: list[Annotated[float, Field(gt=0, le=86400)]] = Query(..., min_length=1, max_length=4),
                         since: float | None = Query(None)) -> Response:
    """This worker's status figures for a sibling summing the host's (``hoststats.py``):
    counter growth over each ``span`` seconds, series points newer than ``since``."""
    figures = worker_figures(state, tuple(span), since)
    return Response(json.dumps(figures, separators=(",", ":"), allow_nan=False), media_type="application/json")


@router.get("/v1/internal/plans")
async def internal_plans(state: AppState) -> list[dict]:
    """Every plan this node holds, with its fields."""
    state.plans.expire()
    return [{**plan.describe(), "fields": plan.fields} for plan in state.plans.live()]


@router.get("/v1/internal/plans/{name}/{plan_id}/order", response_class=Response)
async def internal_plan_order(name: str, plan_id: str, state: AppState) -> Response:
    """A plan's order: its sample indices as little-endian int64s."""
    plan = state.plans.get(state.dataset(name), plan_id)
    return Response(plan.order.astype("<i8").tobytes(), media_type="application/octet-stream")
