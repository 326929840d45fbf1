"""What every route module shares: the service ``State`` (one dependency), admission
control, bounded body reading and the error schema of the OpenAPI document."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Annotated, TypeVar

from fastapi import Depends, Request
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect
from starlette.responses import Response, StreamingResponse

from shardfeed.service.cluster.peers import COPIES, COPY_HEADER, Cluster
from shardfeed.service.config import ServiceConfig
from shardfeed.service.datasets.dataset import Dataset
from shardfeed.service.datasets.index import Members
from shardfeed.service.datasets.indexfile import IndexFormatError
from shardfeed.service.datasets.objects import Catalog
from shardfeed.service.datasets.served import ServedDatasets
from shardfeed.service.http.errors import (
    ApiError,
    DatasetChanged,
    InvalidRequest,
    Overloaded,
    StoreUnavailable,
    UnknownDataset,
)
from shardfeed.service.http.protocol import PARTS
from shardfeed.service.observe.metrics import Metrics
from shardfeed.service.observe.stats import StatsRecorder
from shardfeed.service.plans.prefetch import Prefetcher
from shardfeed.service.plans.registry import Plans
from shardfeed.service.read.coalescer import Coalescer
from shardfeed.service.read.fields import located
from shardfeed.service.read.framing import chunks_of
from shardfeed.service.read.samples import SampleBatcher
from shardfeed.service.read.stream import SampleFailed
from shardfeed.service.stores import CorruptObject, ObjectChanged, StoreError
from shardfeed.service.transform.pool import TransformPool
from shardfeed.service.transform.prepared import PreparedCache
from shardfeed.service.transform.registry import Transforms

log = logging.getLogger("shardfeed.api")

TAR = "application/x-tar"
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
    (403, "The token lacks the scope the request needs"),
    (404, "Unknown dataset, sample, field, index column, transform or route"), (408, "Request body not sent in time"),
    (413, "Too many items or body too large"),
    (422, "A shard disagrees with its dataset's index (MDS, LitData), or a sample's transform failed"),
    (429, "Overloaded; retry after Retry-After seconds"),
    (503, "Store unreachable after retries")]}


class Admission:
    """Requests in flight per kind (``batch``, ``sample``); 429 beyond each kind's limit."""

    def __init__(self, limits: dict[str, int], metrics: Metrics):
        self.limits = limits
        self.inflight = dict.fromkeys(limits, 0)
        self.metrics = metrics

    def acquire(self, kind: str) -> None:
        if self.inflight[kind] >= self.limits[kind]:
            self.metrics.rejected.inc()
            raise Overloaded(f"too many {kind} requests in flight; retry later")
        self.inflight[kind] += 1
        self.metrics.inflight_requests.inc()

    def full(self, kind: str) -> bool:
        """Whether ``acquire(kind)`` would refuse now."""
        return self.inflight[kind] >= self.limits[kind]

    def release(self, kind: str) -> None:
        self.inflight[kind] -= 1
        self.metrics.inflight_requests.dec()

    @contextmanager
    def slot(self, kind: str):
        self.acquire(kind)
        try:
            yield
        finally:
            self.release(kind)


@dataclass
class State:
    """Everything a route needs, built once by ``create_app``."""

    config: ServiceConfig
    datasets: ServedDatasets
    metrics: Metrics
    coalescer: Coalescer
    batcher: SampleBatcher
    admission: Admission
    cluster: Cluster | None
    stats: StatsRecorder
    catalog: Catalog
    """Where GetBatch finds entries: the ``--bucket`` buckets (none: every bucket is refused)."""
    plans: Plans
    prefetcher: Prefetcher
    transforms: Transforms = field(default_factory=lambda: Transforms({}))
    """The served transforms (``serve --transform``)."""
    pool: TransformPool | None = None
    """Where they run; ``None`` when none is served."""
    prepared: PreparedCache | None = None
    """Their ``prepare`` outputs, in the block cache."""

    def dataset(self, name: str) -> Dataset:
        dataset = self.datasets.get(name)
        if dataset is None:
            raise UnknownDataset(name, list(self.datasets))
        return dataset


class HeldRoutes:
    """ASGI middleware in front of the FastAPI app (``ShardfeedAPI``), for the hottest requests,
    which skip its middleware stack, the router's matching, dependency resolution and exception
    middleware:

    - ``direct`` maps ``(method, path)`` to an endpoint mounted here, an ASGI app (as Starlette
      mounts them) that answers its own errors (``batch.BatchEndpoint``);
    - each of ``handlers``, ``(state, scope, send) -> bool``, may answer a request whose data
      is at hand (in RAM) without even a request object; when none does, the routed endpoint
      answers it, errors included, so every check and error is written once."""

    def __init__(self, app, state: State, direct: dict, handlers):
        self.app = app
        self.state = state
        self.direct = direct
        self.handlers = handlers

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            endpoint = self.direct.get((scope["method"], scope["path"]))
            if endpoint is not None:
                return await endpoint(scope, receive, send)
            for handler in self.handlers:
                if await handler(self.state, scope, send):
                    return
        await self.app(scope, receive, send)


def on_public_port(request: Request, state: State) -> bool:
    """Whether ``request`` came to the port all the workers of ``--workers N`` share, where
    ``/metrics`` and ``/v1/stats`` answer for the whole host (not to a worker's own port or
    Unix socket, where they answer for that worker)."""
    server = request.scope.get("server")
    return state.config.worker is not None and server is not None and server[1] == state.config.port


async def _state(request: Request) -> State:  # async: FastAPI would run a plain function in a thread
    return request.app.state.shardfeed


AppState = Annotated[State, Depends(_state)]
"""A route's parameter of this type receives the service state."""

Model = TypeVar("Model", bound=BaseModel)


async def read_json(request: Request, model: type[Model], limit: int) -> Model:
    """The request body, at most ``limit`` bytes, validated as ``model`` (400 otherwise)."""
    return parse_json(await read_body(request, limit), model)


def parse_json(body: bytes, model: type[Model]) -> Model:
    """``body`` validated as ``model`` (400 otherwise)."""
    try:
        return model.model_validate_json(body)
    except ValidationError as err:
        raise InvalidRequest(describe(err.errors())) from None


async def read_body(request: Request, limit: int) -> bytes:
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


def describe(errors) -> str:
    """pydantic's validation errors as one line (the first three)."""
    parts = []
    for e in list(errors)[:3]:
        where = ".".join(str(p) for p in e.get("loc", ()) if p != "body")
        parts.append(f"{where}: {e.get('msg')}" if where else str(e.get("msg")))
    return "invalid request: " + "; ".join(parts)


def json_body(model: type[BaseModel]) -> dict:
    """``openapi_extra`` documenting a body that the route reads itself (bounded) as ``model``."""
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": model.model_json_schema()}}}}


def served_metrics(state: State, stream: str | None = None) -> Callable[[int, int], None]:
    """The ``on_served`` callback of ``stream_batch``: counts samples and bytes sent, under
    ``stream`` too when the request named one. Only the node that answers the client counts:
    what a sibling or replica reads for it (``/v1/internal/read``) is no sample served."""
    metrics = state.metrics
    counters = [(metrics.samples, metrics.bytes_served)]
    if stream is not None:
        counters.append(metrics.stream_counters(stream))

    def served(samples: int, nbytes: int) -> None:
        for samples_counter, bytes_counter in counters:
            samples_counter.inc(samples)
            bytes_counter.inc(nbytes)

    return served


class TarStreamResponse(StreamingResponse):
    """A batch stream: the parts of one group at a time (``stream.stream_batch``). With a
    server that offers ``protocol.PARTS``, each group goes out in one gathered write,
    uncopied (a chunk of its own where no Content-Length is known); otherwise as
    ``chunks_of``. ``in_memory`` (every part framed from RAM, nothing to read): sent without
    Starlette's disconnect listener (a task group per request), which only stops reads that a
    gone client would waste."""

    def __init__(self, groups: AsyncIterator[list], *, in_memory: bool, **kwargs):
        super().__init__(groups, **kwargs)
        self.in_memory = in_memory
        self.gathered = False

    async def __call__(self, scope, receive, send) -> None:
        self.gathered = PARTS in scope.get("extensions", {})
        if self.in_memory:
            await self.stream_response(send)
        else:
            await super().__call__(scope, receive, send)

    async def stream_response(self, send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers,
                    "parts": self.gathered})  # with the first parts, in one write
        async for parts in self.body_iterator:
            if self.gathered:
                await send({"type": "http.response.body", "parts": parts, "more_body": True})
                continue
            for chunk in chunks_of(parts):
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


class PartsResponse(Response):
    """A 200 whose body is all in memory as ``parts`` (members' pieces, views of blocks among
    them, and their framing): with a server that offers ``protocol.PARTS``, one gathered write
    of them, uncopied, as a held batch group goes; otherwise joined."""

    def __init__(self, parts: Sequence, media_type: str):
        super().__init__(media_type=media_type, headers={"content-length": str(sum(map(len, parts)))})
        self.parts = parts

    async def __call__(self, scope, receive, send) -> None:
        gathered = PARTS in scope.get("extensions", {})
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers,
                    "parts": gathered})  # with the parts, in one write
        if gathered:
            await send({"type": "http.response.body", "parts": self.parts})
        else:
            await send({"type": "http.response.body", "body": b"".join(self.parts)})


def relayed_copy(request: Request) -> str | None:
    """Which relayed copy this request is (``peers.COPY_HEADER``); ``None`` from a client."""
    copy = request.headers.get(COPY_HEADER)
    if copy is not None and copy not in COPIES:
        raise InvalidRequest(f"invalid {COPY_HEADER} {copy[:40]!r}: one of {', '.join(COPIES)} expected")
    return copy


async def relay(state: State, request: Request, copy: str | None, body: bytes, headers: dict | None = None,
                **options) -> None:
    """Carry this request, already done here, to the cluster's other nodes (``Cluster.relay``
    with its ``options``)."""
    if state.cluster is not None:
        await state.cluster.relay(request.method, request.url.path, body, copy, headers, **options)


async def answer_changed_once(answer: Callable[[], Awaitable[Response]],
                              refresh: Callable[[], Awaitable[object]]) -> Response:
    """``answer()``; if what it read changed in the store before its first byte was sent
    (``DatasetChanged``), ``refresh()`` and answer once more, from the new version. A second
    change, or a refresh that fails (the store cannot be listed now), reaches the client as
    the 409."""
    try:
        return await answer()
    except DatasetChanged as changed_error:
        try:
            await refresh()
        except (StoreError, IndexFormatError) as err:
            log.warning("reopening after a change failed: %s", err)
            raise changed_error from None
        return await answer()


async def located_members(state: State, dataset: Dataset, members: Members) -> Members:
    """``members`` at their fields' own extents (``read/fields.py``), a failure to learn them an
    answer (``not_located``)."""
    try:
        return await located(state.coalescer, dataset, members)
    except (StoreError, IndexFormatError) as err:
        raise not_located(err) from None


def not_located(err: StoreError | IndexFormatError) -> ApiError:
    """The answer to a record whose fields could not be placed: its shard replaced (the 409 that
    reopens the dataset), a shard that is not what its dataset says (422, naming it: a record
    that disagrees with its shard's header, a compressed shard that does not decompress), or
    the store unreachable (503)."""
    if isinstance(err, ObjectChanged):
        return DatasetChanged(str(err))
    if isinstance(err, (IndexFormatError, CorruptObject)):
        return ApiError(422, "shard_disagrees", str(err))
    return StoreUnavailable(str(err))


def count_batch(state: State, route: str, status: str, began: float) -> None:
    """A batch request answered with ``status``, ``began`` at that ``perf_counter``."""
    state.metrics.requests.labels(route, status).inc()
    state.metrics.batch_latency.observe(time.perf_counter() - began)


async def tar_stream_response(state: State, route: str, chunks: AsyncIterator[list], *, media_type: str,
                              headers: dict[str, str], what: str,
                              failed: Callable[[SampleFailed], ApiError] = lambda err: StoreUnavailable(str(err)),
                              in_memory: bool = False) -> TarStreamResponse:
    """Serve a batch stream under admission control (kind ``batch``), with its metrics.

    The first chunk is read before the status line, so a sample that fails in the first
    group is a real error answer (``failed`` picks it; 503 by default), not a truncated 200.
    Later failures can only end the response early: the client sees a truncated stream.
    ``chunks`` yields lists of parts (``stream_batch``); ``in_memory``: every part is framed
    from RAM, nothing is read (``held_group``).
    """
    state.admission.acquire("batch")
    began = time.perf_counter()

    def finish(status: str) -> None:
        state.admission.release("batch")
        count_batch(state, route, status, began)

    try:
        first = await anext(chunks)
    except BaseException as err:
        await chunks.aclose()
        if isinstance(err, SampleFailed):
            answer = not_located(err.cause) if isinstance(err.cause, (ObjectChanged, CorruptObject)) else failed(err)
            finish(str(answer.status))
            raise answer from None
        if isinstance(err, ApiError):  # the batch's own answer (a transformed batch's 422)
            finish(str(err.status))
            raise
        finish("500")
        raise

    async def body_stream():
        status = "500"
        try:
            yield first
            async for parts in chunks:
                yield parts
            status = "200"
        except SampleFailed as err:
            # Headers are gone: end the response early so the client sees a truncated stream.
            log.warning("%s aborted mid-stream: %s", route, err)
            raise
        finally:
            await chunks.aclose()
            finish(status)
            log.debug("%s status=%s ms=%.1f", what, status, 1e3 * (time.perf_counter() - began))

    return TarStreamResponse(body_stream(), in_memory=in_memory, media_type=media_type, headers=headers)
