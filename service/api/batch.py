"""``POST /v1/batch``: samples as one ordered tar stream.

Validation happens before the first byte, so a 4xx is a real 4xx; the first group of a
batch is read before the status line too, so a store outage is a 503 and not a
truncated 200, and a shard replaced in the store meanwhile (``ObjectChanged``) gets the
dataset reopened and the batch answered from the new version (a second change: 409). A warm
batch (every block in RAM) is answered by the protocol itself (``instant_batch``), without the
ASGI layers. A streamed answer states its expected length (``LENGTH_HEADER``)."""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field, StrictInt
from starlette.responses import Response, StreamingResponse

from shardfeed.service.api.auth import tenant_of
from shardfeed.service.api.common import (
    TAR, AppState, State, answer_changed_once, count_batch, json_body, parse_json, read_body, served_metrics,
    tar_stream_response,
)
from shardfeed.service.api.routing import ROUTING_HEADER, routing_version
from shardfeed.service.api.tenants import Tenant
from shardfeed.service.datasets.dataset import Dataset
from shardfeed.service.datasets.index import Members, SampleOutOfRange, UnknownField
from shardfeed.service.http.errors import ApiError
from shardfeed.service.http.protocol import INSTANT_BYTES
from shardfeed.service.read.framing import held_stream, stream_length
from shardfeed.service.read.stream import stream_batch
from shardfeed.service.read.warm import held_group
from shardfeed.tar import END_OF_ARCHIVE

router = APIRouter(tags=["samples"])


class BatchRequest(BaseModel):
    """Body of ``POST /v1/batch``."""

    model_config = ConfigDict(extra="forbid")
    dataset: str = Field(min_length=1, max_length=256)
    # Strict: "1", 1.5 or true is not a sample number.
    indices: list[StrictInt] = Field(description="Sample numbers, in the order they are wanted; repeats allowed.",
                                     json_schema_extra={"items": {"type": "integer", "minimum": 0}})
    fields: list[str] | None = Field(None, description="Fields per sample, in order; default: all fields.")
    format: str = Field("tar", description="Only 'tar' for now.", json_schema_extra={"enum": ["tar"]})
    continue_on_error: bool = Field(False, description="Serve a failed sample as a zero-length "
                                                       "__404__/<dataset>/<i> member instead of failing.")


@dataclass
class WantedBatch:
    """A valid ``POST /v1/batch``: what to serve, looked up in the dataset's index."""

    dataset: Dataset
    indices: np.ndarray
    members: Members
    continue_on_error: bool


def wanted_batch(state: State, body: bytes, tenant: Tenant) -> WantedBatch:
    """``body`` checked and looked up; an ``ApiError`` for anything the batch cannot serve,
    or ``tenant`` may not read."""
    config = state.config
    req = parse_json(body, BatchRequest)
    tenant.check_dataset(req.dataset)
    if req.format != "tar":
        raise ApiError(400, "unsupported_format", f"format {req.format!r} is not supported (supported: tar)")
    if len(req.indices) > config.max_batch:
        raise ApiError(413, "too_many_items", f"{len(req.indices)} samples requested; the limit is "
                                              f"{config.max_batch} per batch")
    dataset = state.dataset(req.dataset)
    n = len(dataset.index)
    if req.indices and (min(req.indices) < 0 or max(req.indices) >= n):
        bad = next(i for i in req.indices if i < 0 or i >= n)
        if bad < 0:
            raise ApiError(400, "invalid_index", f"sample index {bad} is negative")
        raise ApiError(404, "sample_out_of_range", f"sample {bad} is out of range: dataset "
                                                   f"{dataset.name!r} has {n} samples")
    indices = np.asarray(req.indices, dtype=np.int64)
    fields = [f.lower() for f in req.fields] if req.fields is not None else None
    try:
        members = dataset.index.lookup(indices, fields)
    except UnknownField as err:
        raise ApiError(404, "unknown_field", str(err)) from None
    except SampleOutOfRange as err:
        raise ApiError(404, "sample_out_of_range", str(err)) from None
    if not req.continue_on_error and not members.found.all():
        row = int(np.flatnonzero(~members.found)[0])
        raise ApiError(404, "unknown_field", f"sample {int(members.sample[row])} has no field "
                                             f"{dataset.index.fields[int(members.field[row])]!r}")
    return WantedBatch(dataset, indices, members, req.continue_on_error)


@router.post("/v1/batch", response_class=StreamingResponse, openapi_extra=json_body(BatchRequest),
             responses={200: {"content": {TAR: {}}, "description": "The samples, as an ordered tar stream."}})
async def batch(request: Request, state: AppState) -> Response:
    body = await read_body(request, state.config.max_body)
    tenant = tenant_of(request.scope)
    # A shard replaced in the store under the batch: answered again from the new version.
    return await answer_changed_once(lambda: _stream(state, wanted_batch(state, body, tenant)),
                                     lambda: state.datasets.reload(parse_json(body, BatchRequest).dataset))


async def _stream(state: State, wanted: WantedBatch) -> Response:
    config = state.config
    dataset, members, indices = wanted.dataset, wanted.members, wanted.indices
    served = _served(state, dataset, indices)
    held = held_group(state.coalescer, dataset, members)
    chunks = stream_batch(state.coalescer, dataset, members, indices, continue_on_error=wanted.continue_on_error,
                          group_bytes=config.group_bytes, prefetch=config.prefetch_groups, on_served=served,
                          held=held)
    headers = _headers(state, dataset, indices)
    if held is not None:  # every byte is in RAM: the length is known, no chunked framing
        headers["Content-Length"] = str(stream_length(dataset, members, indices, held))
    else:  # the length if every sample is served as the index says: a tensor client sizes its buffer by it
        headers[LENGTH_HEADER] = str(stream_length(dataset, members, indices))
    return await tar_stream_response(state, "batch", chunks, media_type=TAR, headers=headers,
                                     what=f"batch dataset={dataset.name} samples={len(indices)}",
                                     in_memory=held is not None)


def instant_batch(state: State, scope, body: bytes) -> tuple[list[tuple[bytes, bytes]], list] | None:
    """``POST /v1/batch`` answered by the protocol (``protocol.InstantAnswerer``) when every
    member is found and held in RAM and the stream is small enough to write at once; None
    (nothing done) for any other request, which ``batch`` answers, errors included."""
    if len(body) > state.config.max_body or state.admission.full("batch"):
        return None
    began = time.perf_counter()
    try:
        wanted = wanted_batch(state, body, tenant_of(scope))
    except ApiError:
        return None
    dataset, members, indices = wanted.dataset, wanted.members, wanted.indices
    held = held_group(state.coalescer, dataset, members) if members.found.all() else None
    if held is None:
        return None
    length = stream_length(dataset, members, indices, held)
    if length > INSTANT_BYTES:
        return None
    parts = held_stream(dataset, members, indices, held)
    _served(state, dataset, indices)(len(indices), length - len(END_OF_ARCHIVE))
    count_batch(state, "batch", "200", began)
    headers = [(b"content-type", TAR.encode()), (b"content-length", b"%d" % length)]
    headers += [(name.lower().encode(), value.encode())
                for name, value in _headers(state, dataset, indices).items()]
    return headers, parts


def _served(state: State, dataset: Dataset, indices: np.ndarray):
    """The batch is being served: plans learn their position from it (and the prefetcher may
    act on that); its samples and bytes are counted by the returned ``on_served``."""
    state.plans.observe(dataset, indices)
    state.prefetcher.wake()
    return served_metrics(state)


LENGTH_HEADER = "X-Shardfeed-Length"
"""On a streamed (chunked) answer: its length if every sample is served as the index describes it
(a failed sample, or a shard's own headers sent as they are, can make it differ: an estimate)."""
VERSION_HEADER = "X-Shardfeed-Dataset-Version"
"""The version of the dataset (``Dataset.version``) every sample of the answer was read from."""


def _headers(state: State, dataset: Dataset, indices: np.ndarray) -> dict[str, str]:
    headers = {"X-Shardfeed-Samples": str(len(indices)), VERSION_HEADER: dataset.version}
    if state.cluster is not None:
        headers[ROUTING_HEADER] = routing_version(state.cluster, dataset)
    return headers
