"""``POST /v1/batch``: samples as one ordered stream (a tar, or an Arrow IPC stream with
``"format": "arrow"``), through one endpoint, ``BatchEndpoint``.

Its steps, in the order a request meets them:

1. **authenticate**: the request's tenant (``auth.py``: ``TokenAuth`` in front of the app, ``guarded``
   in front of the protocol's offer; without tokens, everyone may read everything);
2. **validate and look up, once**: ``wanted_batch`` checks the body and looks every member up in the
   dataset's index (a ``WantedBatch``), and ``held_group`` finds whether every block is in RAM
   (a ``Decision``);
3. **admit**: a batch slot (``Admission``, 429 beyond);
4. **held or streamed**: a held batch is framed from RAM as it is sent; any other is read group by
   group through the coalescer (``read/stream.py``), its store reads planned at once;
5. **framed**: by the format's framing (``FORMATS``: ``framing.TarFraming``, ``arrow.ArrowFraming``),
   written by the protocol itself (``instant``: a held batch small enough to write at once, without
   the ASGI layers) or as a ``TarStreamResponse``.

The protocol offers the endpoint every request whose body came with its head (``instant``); when
it cannot answer at once, its ``Decision`` (an error to answer included) travels in the request's
scope to the ASGI call, which answers from it: nothing is validated or looked up twice.

Validation happens before the first byte, so a 4xx is a real 4xx; the first group is read before
the status line too, so a store outage is a 503 and not a truncated 200, and a shard replaced in
the store meanwhile (``ObjectChanged``) gets the dataset reopened and the batch answered from the
new version (a second change: 409). A streamed answer states its expected length (``LENGTH_HEADER``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import cached_property

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, StrictInt
from starlette.requests import Request
from starlette.responses import Response

from shardfeed.service.api.auth import tenant_of
from shardfeed.arrowipc import MEDIA_TYPE as ARROW
from shardfeed.service.api.common import (
    ERRORS, TAR, State, answer_changed_once, count_batch, json_body, located_members, parse_json, read_body,
    served_metrics, tar_stream_response,
)
from shardfeed.service.api.routing import ROUTING_HEADER, routing_version
from shardfeed.service.api.tenants import Tenant
from shardfeed.service.datasets.dataset import Dataset
from shardfeed.service.datasets.index import Members, SampleOutOfRange, UnknownField
from shardfeed.service.http.errors import ApiError
from shardfeed.service.http.protocol import INSTANT_BYTES
from shardfeed.service.read.arrow import ArrowFraming
from shardfeed.service.read.fields import placed_from_ram
from shardfeed.service.read.framing import TarFraming
from shardfeed.service.read.stream import batch_groups, stream_batch
from shardfeed.service.read.warm import HeldGroup, held_group

class BatchRequest(BaseModel):
    """Body of ``POST /v1/batch``."""

    model_config = ConfigDict(extra="forbid")
    dataset: str = Field(min_length=1, max_length=256)
    # Strict: "1", 1.5 or true is not a sample number.
    indices: list[StrictInt] = Field(description="Sample numbers, in the order they are wanted; repeats allowed.",
                                     json_schema_extra={"items": {"type": "integer", "minimum": 0}})
    fields: list[str] | None = Field(None, description="Fields per sample, in order; default: all fields.")
    format: str = Field("tar", description="'tar' (members <key>.<field>) or 'arrow' (an Arrow IPC stream, a row "
                                           "per sample: __key__, __index__, a binary column per field).",
                        json_schema_extra={"enum": ["tar", "arrow"]})
    continue_on_error: bool = Field(False, description="Serve a failed sample as a zero-length "
                                                       "__404__/<dataset>/<i> member (a row of nulls in "
                                                       "'arrow') instead of failing.")
    stream: str | None = Field(None, min_length=1, max_length=64, pattern=r"^[A-Za-z0-9._:/-]+$",
                               description="The stream of a mixture this batch belongs to: its samples and "
                                           "bytes are also counted under this name (metrics "
                                           "shardfeed_stream_*, /v1/stats 'streams').")


FORMATS = {"tar": TAR, "arrow": ARROW}
"""The batch formats and their media types."""


@dataclass
class WantedBatch:
    """A valid ``POST /v1/batch``: what to serve, looked up in the dataset's index."""

    dataset: Dataset
    indices: np.ndarray
    members: Members
    continue_on_error: bool
    format: str
    framing: TarFraming | ArrowFraming
    stream: str | None


def wanted_batch(state: State, body: bytes, tenant: Tenant) -> WantedBatch:
    """``body`` checked and looked up; an ``ApiError`` for anything the batch cannot serve,
    or ``tenant`` may not read."""
    config = state.config
    req = parse_json(body, BatchRequest)
    tenant.check_dataset(req.dataset)
    if req.format not in FORMATS:
        raise ApiError(400, "unsupported_format",
                       f"format {req.format!r} is not supported (supported: {', '.join(FORMATS)})")
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
    framing = ArrowFraming(dataset, fields) if req.format == "arrow" else TarFraming()
    return WantedBatch(dataset, indices, members, req.continue_on_error, req.format, framing, req.stream)


@dataclass
class Decision:
    """What ``BatchEndpoint.decide`` found for a request: the batch to serve and whether every block
    of it is in RAM, or the error to answer."""

    body: bytes
    wanted: WantedBatch | None = None
    held: HeldGroup | None = None
    error: ApiError | None = None
    group_bytes: int = 0

    @cached_property
    def length(self) -> int:
        """The answer's length: exact when every block is held, else as the index describes it
        (once, whether the protocol's offer or the ASGI call asks first)."""
        wanted = self.wanted
        groups = batch_groups(wanted.members, len(wanted.indices), self.group_bytes, self.held is not None)
        return wanted.framing.length(wanted.dataset, wanted.members, wanted.indices, self.held, groups)


DECIDED = "shardfeed.batch"
"""The scope key under which a ``Decision`` the protocol's offer did not answer reaches the ASGI call."""


class BatchEndpoint:
    """``POST /v1/batch`` (see the module's docstring for its steps): an ASGI app, mounted in front
    of FastAPI's router (``HeldRoutes``), and the protocol's instant answerer (``instant``)."""

    def __init__(self, state: State):
        self.state = state

    def decide(self, scope, body: bytes) -> Decision:
        """Step 2: ``body`` validated and looked up for the request's tenant; every block looked for in RAM."""
        try:
            wanted = wanted_batch(self.state, body, tenant_of(scope))
        except ApiError as err:
            return Decision(body, error=err)
        members = placed_from_ram(self.state.coalescer, wanted.dataset, wanted.members)
        if members is None:  # records whose headers are not in RAM: streamed, placed first
            return Decision(body, wanted, group_bytes=self.state.config.group_bytes)
        wanted.members = members
        return Decision(body, wanted, held_group(self.state.coalescer, wanted.dataset, members),
                        group_bytes=self.state.config.group_bytes)

    def instant(self, scope, body: bytes) -> tuple[list[tuple[bytes, bytes]], list] | None:
        """The protocol's offer (``protocol.InstantAnswerer``): the 200's headers and parts of a batch
        held in RAM that is written at once; None otherwise, its ``Decision`` left in ``scope``."""
        state = self.state
        if len(body) > state.config.max_body:  # the ASGI call refuses it as it reads the body
            return None
        began = time.perf_counter()
        decision = scope[DECIDED] = self.decide(scope, body)
        wanted, held = decision.wanted, decision.held
        if held is None or not wanted.members.found.all() or state.admission.full("batch"):
            return None
        dataset, members, indices = wanted.dataset, wanted.members, wanted.indices
        length = decision.length
        if length > INSTANT_BYTES:
            return None
        del scope[DECIDED]
        framing = wanted.framing
        parts = [*framing.head(), *framing.held(held, 0, dataset, members, indices), framing.end()]
        _served(state, wanted)(len(indices), length - len(framing.end()))
        count_batch(state, "batch", "200", began)
        headers = [(b"content-type", FORMATS[wanted.format].encode()), (b"content-length", b"%d" % length)]
        headers += [(name.lower().encode(), value.encode())
                    for name, value in _headers(state, dataset, indices).items()]
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

        return await answer_changed_once(answer, lambda: self.state.datasets.reload(decision.wanted.dataset.name))

    async def stream(self, decision: Decision) -> Response:
        """Steps 3 to 5: admitted (``tar_stream_response``), held or streamed, framed."""
        if decision.error is not None:
            raise decision.error
        state, config = self.state, self.state.config
        held, wanted = decision.held, decision.wanted
        if held is None:
            wanted.members = await located_members(state, wanted.dataset, wanted.members)
        dataset, members, indices = wanted.dataset, wanted.members, wanted.indices
        chunks = stream_batch(state.coalescer, dataset, members, indices,
                              continue_on_error=decision.wanted.continue_on_error, group_bytes=config.group_bytes,
                              prefetch=config.prefetch_groups, on_served=_served(state, wanted), held=held,
                              looked=True, framing=decision.wanted.framing)
        headers = _headers(state, dataset, indices)
        # Held: every byte is in RAM, the length is known, no chunked framing. Else the length if every
        # sample is served as the index says: a tensor client sizes its buffer by it.
        headers["Content-Length" if held is not None else LENGTH_HEADER] = str(decision.length)
        return await tar_stream_response(state, "batch", chunks, media_type=FORMATS[decision.wanted.format],
                                         headers=headers,
                                         what=f"batch dataset={dataset.name} samples={len(indices)}",
                                         in_memory=held is not None)


OPENAPI = {"/v1/batch": {"post": {
    "tags": ["samples"], "summary": "Batch", "operationId": "batch_v1_batch_post",
    "description": "Samples, in the order asked, as one tar stream (or an Arrow IPC stream: `format`).",
    **json_body(BatchRequest),
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


def _headers(state: State, dataset: Dataset, indices: np.ndarray) -> dict[str, str]:
    headers = {"X-Shardfeed-Samples": str(len(indices)), VERSION_HEADER: dataset.version}
    if state.cluster is not None:
        headers[ROUTING_HEADER] = routing_version(state.cluster, dataset)
    return headers
