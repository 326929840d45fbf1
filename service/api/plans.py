"""Plans: ``/v1/datasets/{name}/plans[/{id}]`` (``service/plans/``).

    POST   .../plans        register a plan (201): {"kind": "sampler"|"indices", ...}
    GET    .../plans        the dataset's plans
    GET    .../plans/{id}   one plan: its length, position and time left
    POST   .../plans/{id}   the next chunk of an ``indices`` plan
    DELETE .../plans/{id}   drop it (204)

With workers or replicas, every node holds every plan: what one node is told it relays to
the others (``Cluster.relay``, the same id and owner), so each reads ahead for the shards it
owns and evicts by next use, and any node answers for the plan.

A plan's owner is the tenant that registered it (``tenants.py``): any token that may read the
dataset may read its plans, but only the owner, or an admin, may extend or delete one.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re

import numpy as np
from fastapi import APIRouter, Request
from starlette.responses import Response

from shardfeed.service.api.auth import tenant_of
from shardfeed.service.api.common import AppState, json_body, parse_json, read_body, relay, relayed_copy
from shardfeed.service.datasets.dataset import Dataset
from shardfeed.service.datasets.index import UnknownField
from shardfeed.service.http.errors import ApiError, InvalidRequest
from shardfeed.service.plans import KINDS
from shardfeed.service.plans.registry import check_order
from shardfeed.service.plans.request import Chunk, PlanRequest

router = APIRouter(tags=["plans"])

PLAN_ID_HEADER = "X-Shardfeed-Plan-Id"
"""On a relayed registration: the id the first node gave the plan."""
PLAN_OWNER_HEADER = "X-Shardfeed-Plan-Owner"
"""On a relayed registration: the tenant that registered the plan at the first node."""


@router.post("/v1/datasets/{name}/plans", status_code=201, openapi_extra=json_body(PlanRequest))
async def create_plan(name: str, request: Request, state: AppState) -> dict:
    dataset = state.dataset(name)
    copy = relayed_copy(request)
    plan_id = request.headers.get(PLAN_ID_HEADER) if copy else None
    owner = request.headers.get(PLAN_OWNER_HEADER) if copy else tenant_of(request.scope).name
    if plan_id is not None and not re.fullmatch(r"[0-9a-f]{16}", plan_id):
        raise InvalidRequest(f"invalid {PLAN_ID_HEADER} {plan_id[:40]!r}: 16 hexadecimal digits expected")
    body = await read_body(request, state.config.max_body)
    try:
        kind = json.loads(body).get("kind")
    except (ValueError, AttributeError):
        raise InvalidRequest("invalid request: the body must be a JSON object with a 'kind'") from None
    module = KINDS.get(kind) if isinstance(kind, str) else None
    if module is None:
        raise ApiError(400, "unknown_plan_kind", f"plan kind {str(kind)[:50]!r} is not one of: {', '.join(KINDS)}")
    req = parse_json(body, module.Request)
    fields = _fields(dataset, req.fields)
    state.plans.check_room(0)
    try:
        order = await asyncio.to_thread(module.order, req, len(dataset.index))
    except ValueError as err:
        raise InvalidRequest(f"invalid plan: {err}") from None
    check_order(dataset, order)
    state.plans.check_room(len(order))
    plan = await asyncio.to_thread(state.plans.build, dataset, kind, order, req.ttl,
                                   getattr(req, "complete", True), fields, plan_id, owner, req.share)
    state.plans.insert(plan)
    state.prefetcher.wake()
    relayed = {PLAN_ID_HEADER: plan.id, PLAN_OWNER_HEADER: owner} if owner else {PLAN_ID_HEADER: plan.id}
    await relay(state, request, copy, body, relayed)
    return plan.describe()


@router.get("/v1/datasets/{name}/plans")
async def list_plans(name: str, state: AppState) -> list[dict]:
    dataset = state.dataset(name)
    state.plans.expire()
    return [plan.describe() for plan in state.plans.live(dataset)]


@router.get("/v1/datasets/{name}/plans/{plan_id}")
async def get_plan(name: str, plan_id: str, state: AppState) -> dict:
    return state.plans.get(state.dataset(name), plan_id).describe()


@router.post("/v1/datasets/{name}/plans/{plan_id}", openapi_extra=json_body(Chunk))
async def extend_plan(name: str, plan_id: str, request: Request, state: AppState) -> dict:
    dataset = state.dataset(name)
    copy = relayed_copy(request)
    plan = state.plans.get(dataset, plan_id)
    tenant_of(request.scope).check_owner(plan.owner, f"extend plan {plan_id!r}")
    body = await read_body(request, state.config.max_body)
    chunk = parse_json(body, Chunk)
    if plan.complete:
        raise ApiError(409, "plan_complete", f"plan {plan_id!r} is complete; register a new one")
    order = np.asarray(chunk.indices, dtype=np.int64)
    check_order(dataset, order)
    state.plans.check_room(len(plan.order) + len(order), new=False)
    longer = await asyncio.to_thread(dataclasses.replace, plan, order=np.concatenate([plan.order, order]),
                                     complete=chunk.complete)
    longer.touch()
    state.plans.replace(longer)
    state.prefetcher.wake()
    await relay(state, request, copy, body)
    return longer.describe()


@router.delete("/v1/datasets/{name}/plans/{plan_id}", status_code=204)
async def delete_plan(name: str, plan_id: str, request: Request, state: AppState) -> Response:
    copy = relayed_copy(request)
    plan = state.plans.get(state.dataset(name), plan_id)
    tenant_of(request.scope).check_owner(plan.owner, f"delete plan {plan_id!r}")
    state.plans.remove(plan)
    await relay(state, request, copy, b"")
    return Response(status_code=204)


def _fields(dataset: Dataset, fields: list[str] | None) -> list[str] | None:
    if fields is None:
        return None
    fields = [f.lower() for f in fields]
    try:
        dataset.index.field_codes(fields)
    except UnknownField as err:
        raise ApiError(404, "unknown_field", str(err)) from None
    return fields
