"""The HTTP API v1 (DESIGN.md): request parsing, validation and admission, then the
planner/coalescer/stream stages. Validation happens before the first byte, so a 4xx is
a real 4xx; the first group of a batch is read before the status line too, so a store
outage is a 503 and not a truncated 200."""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Annotated

import numpy as np
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import JSONResponse, Response, StreamingResponse

from shardfeed.tar import END_OF_ARCHIVE, member_header, padding

from .cache import BlockCache
from .coalescer import Coalescer
from .config import ServiceConfig
from .datasets import Dataset
from .errors import ApiError, error_response
from .index import Members, SampleOutOfRange, UnknownField
from .metrics import Metrics
from .peers import Cluster
from .samples import SampleBatcher
from .stores import StoreError
from .stream import SampleFailed, stream_batch

log = logging.getLogger("shardfeed.api")

TAR = "application/x-tar"
RETRY_AFTER = {"Retry-After": "1"}
BODY_TIMEOUT = 10.0
"""Seconds a client has to send a request body (a stalled upload is answered 408)."""


class ErrorDetail(BaseModel):
    code: str
    message: str


class ErrorBody(BaseModel):
    """Every error answer: ``{"error": {"code", "message"}}``."""

    error: ErrorDetail


ERRORS = {status: {"model": ErrorBody, "description": text} for status, text in [
    (400, "Malformed or invalid request"), (401, "Missing or wrong bearer token"),
    (404, "Unknown dataset, sample, field or route"), (408, "Request body not sent in time"),
    (413, "Too many items or body too large"), (429, "Overloaded; retry after Retry-After seconds"),
    (503, "Store unreachable after retries")]}


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
class State:
    config: ServiceConfig
    datasets: dict[str, Dataset]
    metrics: Metrics
    coalescer: Coalescer
    batcher: SampleBatcher
    inflight: dict[str, int] = field(default_factory=lambda: {"batch": 0, "sample": 0})


def create_app(config: ServiceConfig, datasets: dict[str, Dataset], cache: BlockCache,
               metrics: Metrics, cluster: Cluster | None = None) -> FastAPI:
    """The ASGI app over already opened datasets and cache (see ``server.py``)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if cluster is not None:
            cluster.start()
        yield
        if cluster is not None:
            await cluster.close()
        await state.coalescer.close()
        for dataset in datasets.values():
            await dataset.store.close()

    app = FastAPI(title="shardfeed", version="1", lifespan=lifespan, responses=ERRORS,
                  description="Batched, ordered sample loading from S3-compatible storage.")
    coalescer = Coalescer(cache, metrics, config, cluster)
    state = State(config, datasets, metrics, coalescer, SampleBatcher(coalescer, config.sample_window))

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, err: ApiError) -> JSONResponse:
        return err.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, err: RequestValidationError) -> JSONResponse:
        return error_response(400, "invalid_request", _describe(err.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, err: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(err.status_code, "http_error")
        return error_response(err.status_code, code, str(err.detail), getattr(err, "headers", None))

    if config.tokens:
        app.add_middleware(_TokenAuth, tokens=config.tokens)

    @app.get("/healthz", tags=["ops"])
    async def healthz() -> dict:
        return {"status": "ok", "datasets": len(datasets)}

    @app.get("/metrics", tags=["ops"], response_class=Response)
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/cluster", tags=["ops"])
    async def cluster_map() -> dict:
        """This replica and its peers; a client may route batches to shard owners itself."""
        if cluster is None:
            return {"node_id": None, "peers": []}
        return cluster.describe()

    @app.get("/v1/datasets", tags=["datasets"])
    async def list_datasets() -> list[dict]:
        return [d.info() for d in datasets.values()]

    @app.get("/v1/datasets/{name}", tags=["datasets"])
    async def dataset_info(name: str) -> dict:
        return _dataset(state, name).info()

    @app.get("/v1/datasets/{name}/samples/{i}/{field}", tags=["samples"], response_class=Response)
    async def get_member(name: str, i: str, field: str) -> Response:
        dataset = _dataset(state, name)
        sample = _sample_number(dataset, i)
        try:
            code = int(dataset.index.field_codes([field.lower()])[0])
        except UnknownField as err:
            raise ApiError(404, "unknown_field", str(err)) from None
        parts = await _read_sample(state, dataset, sample, code)
        if not parts:
            raise ApiError(404, "unknown_field", f"sample {sample} of dataset {name!r} has no field {field!r}")
        return Response(bytes(parts[0][1]), media_type="application/octet-stream")

    @app.get("/v1/datasets/{name}/samples/{i}", tags=["samples"], response_class=Response)
    async def get_sample(name: str, i: str) -> Response:
        dataset = _dataset(state, name)
        sample = _sample_number(dataset, i)
        parts = await _read_sample(state, dataset, sample, -1)
        key = dataset.index.key(sample)
        out = []
        for code, payload in parts:
            out += [member_header(f"{key}.{dataset.index.fields[code]}", len(payload)), payload,
                    b"\0" * padding(len(payload))]
        out.append(END_OF_ARCHIVE)
        return Response(b"".join(out), media_type=TAR)

    @app.post("/v1/batch", tags=["samples"], response_class=StreamingResponse,
              openapi_extra={"requestBody": {"required": True, "content": {"application/json": {
                  "schema": BatchRequest.model_json_schema()}}}},
              responses={200: {"content": {TAR: {}}, "description": "The samples, as an ordered tar stream."}})
    async def batch(request: Request) -> Response:
        return await _batch(state, request)

    @app.post("/v1/internal/read", tags=["internal"], response_class=Response,
              openapi_extra={"requestBody": {"required": True, "content": {"application/json": {
                  "schema": RangeRead.model_json_schema()}}}})
    async def internal_read(request: Request) -> Response:
        """Replica to replica: the bytes of members of shards this replica owns, concatenated."""
        return await _internal_read(state, request)

    return app


# -- replica sub-batches -------------------------------------------------------------------

class RangeRead(BaseModel):
    """Body of ``POST /v1/internal/read``: members by shard code, offset and size."""

    model_config = ConfigDict(extra="forbid")
    dataset: str = Field(min_length=1, max_length=256)
    # Bounded, so that offset + size cannot overflow int64 and slip past the range check.
    shard: list[Annotated[StrictInt, Field(ge=0, lt=2**31)]]
    offset: list[Annotated[StrictInt, Field(ge=0, lt=2**62)]]
    size: list[Annotated[StrictInt, Field(ge=0, lt=2**62)]]


async def _internal_read(state: State, request: Request) -> Response:
    body = await _read_body(request, 4 * state.config.max_body)
    try:
        req = RangeRead.model_validate_json(body)
    except ValidationError as err:
        raise ApiError(400, "invalid_request", _describe(err.errors())) from None
    dataset = _dataset(state, req.dataset)
    n = len(req.shard)
    if len(req.offset) != n or len(req.size) != n or n > 4 * state.config.max_batch:
        raise ApiError(400, "invalid_request", "shard, offset and size must have the same, bounded length")
    shard = np.asarray(req.shard, dtype=np.int64) if n else np.zeros(0, np.int64)
    offset = np.asarray(req.offset, dtype=np.int64) if n else np.zeros(0, np.int64)
    size = np.asarray(req.size, dtype=np.int64) if n else np.zeros(0, np.int64)
    if n and ((shard < 0).any() or (shard >= len(dataset.index.shards)).any() or (offset < 0).any()
              or (size < 0).any() or (offset + size > dataset.extents[np.clip(shard, 0, None)]).any()):
        raise ApiError(400, "invalid_request", "a range lies outside the dataset's shards")
    members = Members(position=np.arange(n), sample=np.zeros(n, np.int64), field=np.zeros(n, np.int32),
                      shard=shard.astype(np.int32), offset=offset, size=size, found=np.ones(n, bool))
    payloads = await state.coalescer.read_members(dataset, members, local=True)
    for payload in payloads:
        if isinstance(payload, StoreError):
            raise ApiError(503, "store_unavailable", str(payload), RETRY_AFTER)
    return Response(b"".join(payloads), media_type="application/octet-stream")


# -- per-sample path ------------------------------------------------------------------------

def _dataset(state: State, name: str) -> Dataset:
    dataset = state.datasets.get(name)
    if dataset is None:
        raise ApiError(404, "unknown_dataset", f"no dataset named {name[:200]!r} "
                                               f"(datasets: {', '.join(state.datasets) or 'none'})")
    return dataset


def _sample_number(dataset: Dataset, text: str) -> int:
    if not (text.isascii() and text.isdigit()) or len(text) > 19:
        raise ApiError(400, "invalid_index", f"sample index must be a non-negative integer, not {text[:40]!r}")
    sample = int(text)
    if sample >= len(dataset.index):
        raise ApiError(404, "sample_out_of_range",
                       f"sample {sample} is out of range: dataset {dataset.name!r} has {len(dataset.index)} samples")
    return sample


async def _read_sample(state: State, dataset: Dataset, sample: int, field: int) -> list:
    if state.inflight["sample"] >= state.config.max_inflight_samples:
        state.metrics.rejected.inc()
        raise ApiError(429, "overloaded", "too many per-sample requests in flight; retry later", RETRY_AFTER)
    began = time.perf_counter()
    state.inflight["sample"] += 1
    state.metrics.inflight_requests.inc()
    try:
        parts = await state.batcher.get(dataset, sample, field)
    finally:
        state.inflight["sample"] -= 1
        state.metrics.inflight_requests.dec()
    for _, payload in parts:
        if payload is None or isinstance(payload, StoreError):
            state.metrics.requests.labels("sample", "503").inc()
            raise ApiError(503, "store_unavailable", f"sample {sample} of {dataset.name!r} could not be "
                                                     f"read from the store: {payload}", RETRY_AFTER)
    state.metrics.requests.labels("sample", "200").inc()
    state.metrics.samples.inc()
    state.metrics.bytes_served.inc(sum(len(p) for _, p in parts))
    elapsed = time.perf_counter() - began
    state.metrics.sample_latency.observe(elapsed)
    if log.isEnabledFor(logging.DEBUG):
        log.debug("sample dataset=%s i=%d members=%d ms=%.2f", dataset.name, sample, len(parts), 1e3 * elapsed)
    return parts


# -- batch path ----------------------------------------------------------------------------

async def _batch(state: State, request: Request) -> Response:
    config, metrics = state.config, state.metrics
    body = await _read_body(request, config.max_body)
    try:
        req = BatchRequest.model_validate_json(body)
    except ValidationError as err:
        raise ApiError(400, "invalid_request", _describe(err.errors())) from None
    if req.format != "tar":
        raise ApiError(400, "unsupported_format", f"format {req.format!r} is not supported (supported: tar)")
    if len(req.indices) > config.max_batch:
        raise ApiError(413, "too_many_items", f"{len(req.indices)} samples requested; the limit is "
                                              f"{config.max_batch} per batch")
    dataset = _dataset(state, req.dataset)
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

    if state.inflight["batch"] >= config.max_inflight_batches:
        metrics.rejected.inc()
        raise ApiError(429, "overloaded", "too many batches in flight; retry later", RETRY_AFTER)
    state.inflight["batch"] += 1
    metrics.inflight_requests.inc()
    began = time.perf_counter()

    def served(samples: int, nbytes: int) -> None:
        metrics.samples.inc(samples)
        metrics.bytes_served.inc(nbytes)

    chunks = stream_batch(state.coalescer, dataset, members, indices, continue_on_error=req.continue_on_error,
                          group_bytes=config.group_bytes, prefetch=config.prefetch_groups, on_served=served)
    try:
        first = await anext(chunks)
    except BaseException as err:
        _finish(state, began, "503" if isinstance(err, SampleFailed) else "500")
        await chunks.aclose()
        if isinstance(err, SampleFailed):
            raise ApiError(503, "store_unavailable", str(err), RETRY_AFTER) from None
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
            _finish(state, began, status)
            log.debug("batch dataset=%s samples=%d status=%s ms=%.1f", dataset.name, len(indices), status,
                      1e3 * (time.perf_counter() - began))

    return StreamingResponse(body_stream(), media_type=TAR, headers={"X-Shardfeed-Samples": str(len(indices))})


def _finish(state: State, began: float, status: str) -> None:
    state.inflight["batch"] -= 1
    state.metrics.inflight_requests.dec()
    state.metrics.requests.labels("batch", status).inc()
    state.metrics.batch_latency.observe(time.perf_counter() - began)


async def _read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > limit):
        raise ApiError(413, "body_too_large", f"request body over {limit} bytes")
    body = bytearray()

    async def receive() -> None:
        async for chunk in request.stream():
            body.extend(chunk)
            if len(body) > limit:
                raise ApiError(413, "body_too_large", f"request body over {limit} bytes")

    try:
        await asyncio.wait_for(receive(), BODY_TIMEOUT)
    except asyncio.TimeoutError:
        raise ApiError(408, "request_timeout", f"request body not received within {BODY_TIMEOUT:g} s",
                       {"Connection": "close"}) from None
    except ClientDisconnect:  # nobody will read this answer, but it must not log a traceback
        raise ApiError(400, "incomplete_body", "the client went away before sending the whole body") from None
    return bytes(body)


def _describe(errors) -> str:
    parts = []
    for e in list(errors)[:3]:
        where = ".".join(str(p) for p in e.get("loc", ()) if p != "body")
        parts.append(f"{where}: {e.get('msg')}" if where else str(e.get("msg")))
    return "invalid request: " + "; ".join(parts)


class _TokenAuth:
    """Bearer-token check for every route but /healthz (constant-time comparison)."""

    def __init__(self, app, tokens: frozenset[str]):
        self.app = app
        self.tokens = [t.encode() for t in tokens]

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] == "/healthz":
            return await self.app(scope, receive, send)
        given = b""
        for name, value in scope["headers"]:
            if name == b"authorization" and value[:7].lower() == b"bearer ":
                given = value[7:].strip()
        ok = False
        for token in self.tokens:  # compare with every token: timing says nothing about which matched
            ok |= hmac.compare_digest(given, token)
        if not ok:
            response = error_response(401, "unauthorized", "missing or wrong bearer token",
                                      {"WWW-Authenticate": "Bearer"})
            return await response(scope, receive, send)
        return await self.app(scope, receive, send)
