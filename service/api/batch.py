"""``POST /v1/batch``: samples as one ordered stream (a tar, or an Arrow IPC stream with
``"format": "arrow"``), through one endpoint, ``BatchEndpoint``; or several datasets' samples in
one request (``parts``), each part's Arrow stream after the other's.

A plain batch is its own one part: every step below serves a list of parts, each exactly as a
plain batch of it is served (validated, observed by plans, counted under its stream, read from
its owners), one after the other.

Its steps, in the order a request meets them:

1. **authenticate**: the request's tenant (``auth.py``: ``TokenAuth`` in front of the app, ``guarded``
   in front of the protocol's offer; without tokens, everyone may read everything);
2. **validate and look up, once**: ``wanted_batch`` checks the body and looks every member up in the
   dataset's index (a ``WantedBatch`` per part), and ``held_group`` finds whether every block is in
   RAM (a ``Decision``);
3. **admit**: a batch slot (``Admission``, 429 beyond);
4. **held or streamed**: a held batch is framed from RAM as it is sent; any other is read group by
   group through the coalescer (``read/stream.py``), its store reads planned at once;
5. **framed**: by the format's framing (``FORMATS``: ``framing.TarFraming``, ``arrow.ArrowFraming``),
   written by the protocol itself (``instant``: a held batch small enough to write at once, without
   the ASGI layers) or as a ``TarStreamResponse``.

A request with ``"transform"`` leaves these steps at step 2 (``BatchEndpoint.decide``): validated by
``wanted_transformed``, it is answered by its own stage (``service/transform/batch.py``: prepared
cache, raw reads, the pool, the outputs' Arrow framing), admitted and counted as any batch.

The protocol offers the endpoint every request whose body came with its head (``instant``); when
it cannot answer at once, its ``Decision`` (an error to answer included) travels in the request's
scope to the ASGI call, which answers from it: nothing is validated or looked up twice.

Validation happens before the first byte, so a 4xx is a real 4xx; the first group is read before
the status line too, so a store outage is a 503 and not a truncated 200, and a shard replaced in
the store meanwhile (``ObjectChanged``) gets the dataset reopened and the batch answered from the
new version (a second change: 409). A streamed answer states its expected length (``LENGTH_HEADER``).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cached_property
from typing import Annotated

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, StrictInt
from starlette.requests import Request
from starlette.responses import Response

from shardfeed.service.api.auth import tenant_of
from shardfeed.arrowipc import MEDIA_TYPE as ARROW
from shardfeed.service.api.common import (
    ERRORS, TAR, State, answer_changed_once, count_batch, located_members, not_located, parse_json, read_body,
    served_metrics, tar_stream_response,
)
from shardfeed.service.api.routing import ROUTING_HEADER, routing_version
from shardfeed.service.api.tenants import Tenant
from shardfeed.service.api.transforms import TransformRequest
from shardfeed.service.datasets.dataset import Dataset
from shardfeed.service.datasets.index import Members, SampleOutOfRange, UnknownField
from shardfeed.service.datasets.indexfile import IndexFormatError
from shardfeed.service.http.errors import ApiError, InvalidRequest
from shardfeed.service.http.protocol import INSTANT_BYTES
from shardfeed.service.read.arrow import ArrowFraming
from shardfeed.service.read.fields import placed_from_ram
from shardfeed.service.read.framing import TarFraming
from shardfeed.service.read.planner import take
from shardfeed.service.read.stream import batch_groups, stream_batch
from shardfeed.service.read.warm import HeldGroup, held_group
from shardfeed.service.stores import StoreError
from shardfeed.transforms import fields_read
from shardfeed.service.transform.batch import TransformedBatch, transformed_answer

MAX_PARTS = 64
"""The most parts one batch of several datasets' samples has (``parts``)."""

DatasetName = Annotated[str, Field(min_length=1, max_length=256)]
# Strict: "1", 1.5 or true is not a sample number.
SampleNumbers = Annotated[list[StrictInt], Field(
    description="Sample numbers, in the order they are wanted; repeats allowed.",
    json_schema_extra={"items": {"type": "integer", "minimum": 0}})]


class BatchPart(BaseModel):
    """One dataset's samples: what a plain batch names at its top, and each of ``parts``."""

    model_config = ConfigDict(extra="forbid")
    dataset: DatasetName
    indices: SampleNumbers
    fields: list[str] | None = Field(None, description="Fields per sample, in order; default: all fields.")
    stream: str | None = Field(None, min_length=1, max_length=64, pattern=r"^[A-Za-z0-9._:/-]+$",
                               description="The stream of a mixture this batch belongs to: its samples and "
                                           "bytes are also counted under this name (metrics "
                                           "shardfeed_stream_*, /v1/stats 'streams').")


class BatchRequest(BatchPart):
    """Body of ``POST /v1/batch``: one dataset's samples, named at the top (a plain batch, its own
    one part), or several datasets' samples as its ``parts`` (answered as Arrow); one or the other
    (``batch_parts``)."""

    dataset: DatasetName | None = None
    indices: SampleNumbers | None = None
    parts: list[BatchPart] | None = Field(None, min_length=1, max_length=MAX_PARTS,
                                          description="Several datasets' samples in one request, in place of "
                                                      "dataset, indices, fields and stream: each part's Arrow "
                                                      "stream after the other's (format 'arrow' only).")
    format: str = Field("tar", description="'tar' (members <key>.<field>) or 'arrow' (an Arrow IPC stream, a row "
                                           "per sample: __key__, __index__, a binary column per field).",
                        json_schema_extra={"enum": ["tar", "arrow"]})
    continue_on_error: bool = Field(False, description="Serve a failed sample as a zero-length "
                                                       "__404__/<dataset>/<i> member (a row of nulls in "
                                                       "'arrow') instead of failing.")
    transform: TransformRequest | None = Field(None, description="Run this served transform on every sample "
                                                                 "(format 'arrow', no fields or parts): a row "
                                                                 "per sample, a column per output.")

    def batch_parts(self) -> list[BatchPart]:
        """The parts to serve: ``parts``, or the request itself (a plain batch); a 400 naming the
        fields when it gives both, or neither."""
        top = [name for name in BatchPart.model_fields if name in self.model_fields_set]
        if self.parts is not None and not top:
            return self.parts
        if "parts" not in self.model_fields_set and self.dataset is not None and self.indices is not None:
            return [self]
        given = [f"{name}=null" if getattr(self, name) is None else name
                 for name in [*top, "parts"] if name in self.model_fields_set]
        raise InvalidRequest("invalid request: a batch names its samples by dataset and indices (and fields, "
                             f"stream) or by parts, one or the other; given: {', '.join(given) or 'neither'}")


FORMATS = {"tar": TAR, "arrow": ARROW}
"""The batch formats and their media types."""


@dataclass
class WantedBatch:
    """A valid ``POST /v1/batch``'s part: what to serve, looked up in the dataset's index."""

    dataset: Dataset
    indices: np.ndarray
    members: Members
    continue_on_error: bool
    format: str
    framing: TarFraming | ArrowFraming
    stream: str | None


def wanted_batch(state: State, req: BatchRequest, tenant: Tenant) -> list[WantedBatch]:
    """``req`` checked and looked up, a ``WantedBatch`` per part (a plain batch: one); an
    ``ApiError`` for anything the batch cannot serve, or ``tenant`` may not read, naming the
    part when the request has ``parts``."""
    config = state.config
    parts = req.batch_parts()
    for number, part in enumerate(parts):
        with _naming(req, number, part):
            tenant.check_dataset(part.dataset)
    if req.format not in FORMATS:
        raise ApiError(400, "unsupported_format",
                       f"format {req.format!r} is not supported (supported: {', '.join(FORMATS)})")
    if req.parts is not None and req.format != "arrow":
        raise ApiError(400, "unsupported_format", f"format {req.format!r}: parts are answered as Arrow only "
                                                  '("format": "arrow")')
    samples = sum(len(part.indices) for part in parts)
    if samples > config.max_batch:
        raise ApiError(413, "too_many_items", f"{samples} samples requested; the limit is "
                                              f"{config.max_batch} per batch")
    wanted = []
    for number, part in enumerate(parts):
        with _naming(req, number, part):
            wanted.append(_wanted_part(state, part, req))
    return wanted


def wanted_transformed(state: State, req: BatchRequest, tenant: Tenant) -> TransformedBatch:
    """A request with ``"transform"`` checked and looked up (its samples' members: the transform's
    declared fields); an ``ApiError`` for anything it cannot serve, or ``tenant`` may not use."""
    if req.format != "arrow":
        raise ApiError(400, "unsupported_format", f"format {req.format!r}: a transformed batch is answered as "
                                                  'Arrow only ("format": "arrow")')
    for given in ("parts", "fields"):
        if getattr(req, given) is not None:  # null is as good as absent
            raise InvalidRequest(f"invalid request: a transformed batch takes no {given} (the transform reads "
                                 "its declared fields of one dataset's samples)")
    part = req.batch_parts()[0]
    tenant.check_dataset(part.dataset)
    name = req.transform.name
    served = state.transforms.get(name)
    if served is None:
        raise ApiError(404, "unknown_transform", f"transform {name[:64]!r} is not served (served: "
                                                 f"{', '.join(state.transforms.served) or 'none'})")
    tenant.check_transform(name)
    if len(part.indices) > state.config.max_batch:
        raise ApiError(413, "too_many_items", f"{len(part.indices)} samples requested; the limit is "
                                              f"{state.config.max_batch} per batch")
    have = state.dataset(part.dataset).index.fields
    fields = fields_read(served.transform.fields, have)
    if fields is not None and not set(fields) & set(have):
        raise ApiError(404, "unknown_field", f"dataset {part.dataset[:200]!r} has none of transform {name!r}'s "
                                             f"fields {', '.join(fields)} (it has: {', '.join(have)})")
    # A sample's absent fields are left out of what prepare is given (prepare decides what it needs).
    wanted = _wanted_part(state, part.model_copy(update={"fields": fields}),
                          req.model_copy(update={"continue_on_error": True}))
    members = take(wanted.members, np.flatnonzero(wanted.members.found))
    return TransformedBatch(wanted.dataset, wanted.indices, members, served, req.transform.seed,
                            req.transform.epoch, req.continue_on_error, part.stream)


@contextmanager
def _naming(req: BatchRequest, number: int, part: BatchPart):
    """An ``ApiError`` about a request's ``parts[number]`` says which part (a plain batch's, as it is)."""
    try:
        yield
    except ApiError as err:
        if req.parts is None:
            raise
        raise ApiError(err.status, err.code, f"part {number} (dataset {part.dataset[:200]!r}): {err.message}",
                       err.headers) from None


def _wanted_part(state: State, part: BatchPart, req: BatchRequest) -> WantedBatch:
    """One part looked up in its dataset's index, to be served as ``req`` asks."""
    dataset = state.dataset(part.dataset)
    n = len(dataset.index)
    if part.indices and (min(part.indices) < 0 or max(part.indices) >= n):
        bad = next(i for i in part.indices if i < 0 or i >= n)
        if bad < 0:
            raise ApiError(400, "invalid_index", f"sample index {bad} is negative")
        raise ApiError(404, "sample_out_of_range", f"sample {bad} is out of range: dataset "
                                                   f"{dataset.name!r} has {n} samples")
    indices = np.asarray(part.indices, dtype=np.int64)
    fields = [f.lower() for f in part.fields] if part.fields is not None else None
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
    framing = ArrowFraming(dataset, fields) if req.format == "arrow" else TarFraming()
    return WantedBatch(dataset, indices, members, req.continue_on_error, req.format, framing, part.stream)


@dataclass
class DecidedPart:
    """A part of a request (a plain batch's one) as ``BatchEndpoint.decide`` found it: what to serve and
    whether every block of it is in RAM."""

    wanted: WantedBatch
    held: HeldGroup | None
    group_bytes: int

    @cached_property
    def length(self) -> int:
        """Its stream's length: exact when every block is held, else as the index describes it
        (once, whether the protocol's offer or the ASGI call asks first)."""
        wanted = self.wanted
        groups = batch_groups(wanted.members, len(wanted.indices), self.group_bytes, self.held is not None)
        return wanted.framing.length(wanted.dataset, wanted.members, wanted.indices, self.held, groups)


@dataclass
class Decision:
    """What ``BatchEndpoint.decide`` found for a request: its parts, or the error to answer."""

    body: bytes
    parts: list[DecidedPart] = field(default_factory=list)
    error: ApiError | None = None
    transformed: TransformedBatch | None = None
    """A request with ``"transform"``: answered by its own stage, never at once (``instant``)."""

    @property
    def held(self) -> bool:
        """Whether every block of every part is in RAM (a transformed batch: not a question)."""
        return self.error is None and self.transformed is None and all(part.held is not None for part in self.parts)

    @property
    def length(self) -> int:
        """The answer's length: its parts' streams, one after the other."""
        return sum(part.length for part in self.parts)

    @property
    def media_type(self) -> str:
        """The answer's (every part has the request's format)."""
        return FORMATS[self.parts[0].wanted.format]


DECIDED = "shardfeed.batch"
"""The scope key under which a ``Decision`` the protocol's offer did not answer reaches the ASGI call."""


class BatchEndpoint:
    """``POST /v1/batch`` (see the module's docstring for its steps): an ASGI app, mounted in front
    of FastAPI's router (``HeldRoutes``), and the protocol's instant answerer (``instant``)."""

    def __init__(self, state: State):
        self.state = state

    def decide(self, scope, body: bytes) -> Decision:
        """Step 2: ``body`` validated and looked up for the request's tenant; every block looked for in
        RAM. A transformed batch leaves here for its own stage."""
        try:
            req = parse_json(body, BatchRequest)
            if req.transform is not None:
                return Decision(body, transformed=wanted_transformed(self.state, req, tenant_of(scope)))
            wanted = wanted_batch(self.state, req, tenant_of(scope))
        except ApiError as err:
            return Decision(body, error=err)
        return Decision(body, [self._decide_part(part) for part in wanted])

    def _decide_part(self, wanted: WantedBatch) -> DecidedPart:
        group_bytes = self.state.config.group_bytes
        members = placed_from_ram(self.state.coalescer, wanted.dataset, wanted.members)
        if members is None:  # records whose headers are not in RAM: streamed, placed first
            return DecidedPart(wanted, None, group_bytes)
        wanted.members = members
        return DecidedPart(wanted, held_group(self.state.coalescer, wanted.dataset, members), group_bytes)

    def instant(self, scope, body: bytes) -> tuple[list[tuple[bytes, bytes]], list] | None:
        """The protocol's offer (``protocol.InstantAnswerer``): the 200's headers and parts of a batch
        held in RAM that is written at once; None otherwise, its ``Decision`` left in ``scope``."""
        state = self.state
        if len(body) > state.config.max_body:  # the ASGI call refuses it as it reads the body
            return None
        began = time.perf_counter()
        decision = scope[DECIDED] = self.decide(scope, body)
        if not decision.held or state.admission.full("batch") or \
                not all(part.wanted.members.found.all() for part in decision.parts):
            return None
        length = decision.length
        if length > INSTANT_BYTES:
            return None
        del scope[DECIDED]
        parts = []
        for part in decision.parts:
            wanted, framing = part.wanted, part.wanted.framing
            dataset, members, indices = wanted.dataset, wanted.members, wanted.indices
            parts += [*framing.head(), *framing.held(part.held, 0, dataset, members, indices), framing.end()]
            _served(state, wanted)(len(indices), part.length - len(framing.end()))
        count_batch(state, "batch", "200", began)
        headers = [(b"content-type", decision.media_type.encode()), (b"content-length", b"%d" % length)]
        headers += [(name.lower().encode(), value.encode())
                    for name, value in _headers(state, [part.wanted for part in decision.parts]).items()]
        return headers, parts

    async def __call__(self, scope, receive, send) -> None:
        try:
            response = await self.respond(scope, receive)
        except ApiError as err:
            response = err.response()
        await response(scope, receive, send)

    async def respond(self, scope, receive) -> Response:
        """The answer to a request the protocol did not answer: from its ``Decision``, or one made now."""
        decision = scope.pop(DECIDED, None)
        if decision is None:
            decision = self.decide(scope, await read_body(Request(scope, receive), self.state.config.max_body))
        first = [decision]

        def answer():  # the first try from the decision; after a change in the store, from a new one
            return self.stream(first.pop() if first else self.decide(scope, decision.body))

        # Which part's dataset changed is not told: each is reopened (an unchanged one stays as it is).
        names = dict.fromkeys([part.wanted.dataset.name for part in decision.parts] +
                              ([decision.transformed.dataset.name] if decision.transformed is not None else []))
        return await answer_changed_once(
            answer, lambda: asyncio.gather(*(self.state.datasets.reload(name) for name in names)))

    async def stream(self, decision: Decision) -> Response:
        """Steps 3 to 5: admitted (``tar_stream_response``), held or streamed, framed: part after part."""
        if decision.error is not None:
            raise decision.error
        state = self.state
        if decision.transformed is not None:
            return await self._transformed(decision.transformed)
        for part in decision.parts:  # every part placed before the first byte
            if part.held is None:
                part.wanted.members = await located_members(state, part.wanted.dataset, part.wanted.members)
        streams = [self._part_stream(part) for part in decision.parts]
        wanted = [part.wanted for part in decision.parts]
        headers = _headers(state, wanted)
        # Held: every byte is in RAM, the length is known, no chunked framing. Else the length if every
        # sample is served as the index says: a tensor client sizes its buffer by it.
        headers["Content-Length" if decision.held else LENGTH_HEADER] = str(decision.length)
        return await tar_stream_response(state, "batch", _in_turn(streams), media_type=decision.media_type,
                                         headers=headers,
                                         what=f"batch dataset={','.join(w.dataset.name for w in wanted)} "
                                              f"samples={sum(len(w.indices) for w in wanted)}",
                                         in_memory=decision.held)

    async def _transformed(self, batch: TransformedBatch) -> Response:
        """A transformed batch, computed whole under admission (``tar_stream_response`` reads its one
        group before the status line), then sent from memory with its Content-Length."""
        state, served = self.state, batch.served
        on_served = _served(state, batch)
        headers = _transformed_headers(state, batch)

        async def answer() -> AsyncIterator[list]:
            try:
                parts = await transformed_answer(batch, state.coalescer, state.pool, state.prepared, state.metrics)
            except (StoreError, IndexFormatError) as err:  # a record's fields not placed
                raise not_located(err) from None
            length = sum(map(len, parts))
            headers["Content-Length"] = str(length)  # read by the response, made after this first group
            on_served(len(batch.indices), length)
            yield parts

        return await tar_stream_response(
            state, "batch", answer(), media_type=ARROW, headers=headers, in_memory=True,
            what=f"batch dataset={batch.dataset.name} samples={len(batch.indices)} transform={served.name}")

    def _part_stream(self, part: DecidedPart) -> AsyncIterator[list]:
        """A part's stream, as a plain batch of it is sent (plans observe it now)."""
        state, config, wanted = self.state, self.state.config, part.wanted
        return stream_batch(state.coalescer, wanted.dataset, wanted.members, wanted.indices,
                            continue_on_error=wanted.continue_on_error, group_bytes=config.group_bytes,
                            prefetch=config.prefetch_groups, on_served=_served(state, wanted), held=part.held,
                            looked=True, framing=wanted.framing)


async def _in_turn(streams: list[AsyncIterator[list]]) -> AsyncIterator[list]:
    """The parts' streams one after the other. Every part's first group is read at once, together,
    before the first is yielded: before the status line (``tar_stream_response``), so a store failure
    or a change there is answered as a plain batch's first group's is (the first part's in part
    order), not as a truncated 200; and the parts' first reads overlap."""
    try:
        firsts = await asyncio.gather(*(anext(stream) for stream in streams), return_exceptions=True)
        for first in firsts:
            if isinstance(first, BaseException):
                raise first
        for stream, first in zip(streams, firsts):
            yield first
            async for parts in stream:
                yield parts
    finally:
        for stream in streams:
            await stream.aclose()


def _request_schema() -> dict:
    """``BatchRequest``'s schema as ``batch_parts`` and ``wanted_transformed`` read it: a plain batch
    (a part's fields at the top), ``parts`` (with format 'arrow'), or a transformed batch (one
    dataset's samples and ``transform``, format 'arrow', no fields): one of the three."""
    part, answer = BatchPart.model_json_schema(), BatchRequest.model_json_schema()["properties"]
    arrow = {"type": "string", "enum": ["arrow"]}
    plain = {**part, "title": "Batch", "description": "One dataset's samples.",
             "properties": {**part["properties"], "format": answer["format"],
                            "continue_on_error": answer["continue_on_error"]}}
    parts = {"title": "BatchOfParts", "type": "object", "additionalProperties": False, "required": ["parts", "format"],
             "properties": {"parts": {"type": "array", "items": part, "minItems": 1, "maxItems": MAX_PARTS,
                                      "description": answer["parts"]["description"]},
                            "format": arrow, "continue_on_error": answer["continue_on_error"]}}
    transformed = {"title": "TransformedBatch", "type": "object", "additionalProperties": False,
                   "description": "One dataset's samples, each run through a served transform.",
                   "required": ["dataset", "indices", "transform", "format"],
                   "properties": {**{k: v for k, v in part["properties"].items() if k != "fields"}, "format": arrow,
                                  "continue_on_error": answer["continue_on_error"],
                                  "transform": {**TransformRequest.model_json_schema(),
                                                "description": answer["transform"]["description"]}}}
    return {"oneOf": [plain, parts, transformed]}


OPENAPI = {"/v1/batch": {"post": {
    "tags": ["samples"], "summary": "Batch", "operationId": "batch_v1_batch_post",
    "description": "Samples, in the order asked, as one tar stream (or an Arrow IPC stream: `format`); "
                   "several datasets' samples (`parts`) as each part's Arrow IPC stream in turn.",
    "requestBody": {"required": True, "content": {"application/json": {"schema": _request_schema()}}},
    "responses": {"200": {"description": "The samples, as an ordered tar stream or Arrow IPC stream.",
                          "content": {media_type: {} for media_type in FORMATS.values()}},
                  **{str(status): {"description": error["description"], "content": {"application/json": {
                      "schema": {"$ref": "#/components/schemas/ErrorBody"}}}} for status, error in ERRORS.items()}},
}}}
"""The endpoint's entry in the OpenAPI document (it is mounted in front of FastAPI's router)."""


def _served(state: State, wanted: WantedBatch):
    """The batch is being served: plans learn their position from it (and the prefetcher may
    act on that); its samples and bytes are counted by the returned ``on_served`` (under its
    stream too)."""
    state.plans.observe(wanted.dataset, wanted.indices)
    state.prefetcher.wake()
    return served_metrics(state, wanted.stream)


LENGTH_HEADER = "X-Shardfeed-Length"
"""On a streamed (chunked) answer: its length if every sample is served as the index describes it
(a failed sample, or a shard's own headers sent as they are, can make it differ: an estimate)."""
VERSION_HEADER = "X-Shardfeed-Dataset-Version"
"""The version of the dataset (``Dataset.version``) every sample of the answer was read from."""


TRANSFORM_HEADER = "X-Shardfeed-Transform"
"""On a transformed batch: ``<name>;version=<version>`` of the transform that made it."""
OUTPUTS_HEADER = "X-Shardfeed-Outputs"
"""On a transformed batch: its outputs (``describe(t)["outputs"]``) as JSON, in column order."""


def _transformed_headers(state: State, batch: TransformedBatch) -> dict[str, str]:
    """A transformed batch's headers: a plain batch's, and its transform's name, version and outputs."""
    served = batch.served
    return {**_headers(state, [batch]), TRANSFORM_HEADER: f"{served.name};version={served.version}",
            OUTPUTS_HEADER: json.dumps(served.description["outputs"], separators=(",", ":"))}


def _headers(state: State, parts: list[WantedBatch]) -> dict[str, str]:
    """The answer's headers: its samples, and per part (comma-separated, in part order) the dataset's
    version and (in a cluster) its routing table's."""
    headers = {"X-Shardfeed-Samples": str(sum(len(part.indices) for part in parts)),
               VERSION_HEADER: ",".join(part.dataset.version for part in parts)}
    if state.cluster is not None:
        headers[ROUTING_HEADER] = ",".join(routing_version(state.cluster, part.dataset) for part in parts)
    return headers
