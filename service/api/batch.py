"""``POST /v1/batch``: samples as one ordered tar stream.

Validation happens before the first byte, so a 4xx is a real 4xx; the first group of a
batch is read before the status line too, so a store outage is a 503 and not a
truncated 200."""

from __future__ import annotations

import numpy as np
from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field, StrictInt
from starlette.responses import Response, StreamingResponse

from ..errors import ApiError
from ..index import SampleOutOfRange, UnknownField
from ..stream import stream_batch, stream_length
from ..warm import held_group
from .common import TAR, AppState, json_body, read_json, served_metrics, tar_stream_response
from .routing import ROUTING_HEADER

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


@router.post("/v1/batch", response_class=StreamingResponse, openapi_extra=json_body(BatchRequest),
             responses={200: {"content": {TAR: {}}, "description": "The samples, as an ordered tar stream."}})
async def batch(request: Request, state: AppState) -> Response:
    config = state.config
    req = await read_json(request, BatchRequest, config.max_body)
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

    state.plans.observe(dataset, indices)  # a plan learns its position from the batches it serves
    state.prefetcher.wake()
    held = held_group(state.coalescer, dataset, members)
    chunks = stream_batch(state.coalescer, dataset, members, indices, continue_on_error=req.continue_on_error,
                          group_bytes=config.group_bytes, prefetch=config.prefetch_groups,
                          on_served=served_metrics(state), held=held)
    headers = {"X-Shardfeed-Samples": str(len(indices))}
    if state.cluster is not None:
        headers[ROUTING_HEADER] = state.cluster.version()
    if held is not None:  # every byte is in RAM: the length is known, no chunked framing
        headers["Content-Length"] = str(stream_length(dataset, members, indices, held))
    return await tar_stream_response(state, "batch", chunks, media_type=TAR, headers=headers,
                                     what=f"batch dataset={dataset.name} samples={len(indices)}",
                                     in_memory=held is not None)
