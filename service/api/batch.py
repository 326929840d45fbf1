"""``POST /v1/batch``: samples as one ordered tar stream.

Validation happens before the first byte, so a 4xx is a real 4xx; the first group of a
batch is read before the status line too, so a store outage is a 503 and not a
truncated 200."""

from __future__ import annotations

import logging
import time

import numpy as np
from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field, StrictInt
from starlette.responses import Response, StreamingResponse

from ..errors import ApiError, StoreUnavailable
from ..index import SampleOutOfRange, UnknownField
from ..stream import SampleFailed, stream_batch
from .common import TAR, AppState, json_body, read_json
from .routing import ROUTING_HEADER

log = logging.getLogger("shardfeed.api")
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
    config, metrics = state.config, state.metrics
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

    state.admission.acquire("batch")
    began = time.perf_counter()
    state.plans.observe(dataset, indices)
    state.prefetcher.wake()

    def finish(status: str) -> None:
        state.admission.release("batch")
        metrics.requests.labels("batch", status).inc()
        metrics.batch_latency.observe(time.perf_counter() - began)

    def served(samples: int, nbytes: int) -> None:
        metrics.samples.inc(samples)
        metrics.bytes_served.inc(nbytes)

    chunks = stream_batch(state.coalescer, dataset, members, indices, continue_on_error=req.continue_on_error,
                          group_bytes=config.group_bytes, prefetch=config.prefetch_groups, on_served=served)
    try:
        first = await anext(chunks)
    except BaseException as err:
        finish("503" if isinstance(err, SampleFailed) else "500")
        await chunks.aclose()
        if isinstance(err, SampleFailed):
            raise StoreUnavailable(str(err)) from None
        raise

    async def body_stream():
        status = "500"
        try:
            yield first
            async for chunk in chunks:
                yield chunk
            status = "200"
        except SampleFailed as err:
            # Headers are gone: end the response early so the client sees a truncated tar.
            log.warning("batch aborted mid-stream: %s", err)
            raise
        finally:
            await chunks.aclose()
            finish(status)
            log.debug("batch dataset=%s samples=%d status=%s ms=%.1f", dataset.name, len(indices), status,
                      1e3 * (time.perf_counter() - began))

    headers = {"X-Shardfeed-Samples": str(len(indices))}
    if state.cluster is not None:
        headers[ROUTING_HEADER] = state.cluster.version()
    return StreamingResponse(body_stream(), media_type=TAR, headers=headers)
