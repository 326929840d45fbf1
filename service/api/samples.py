"""Per-sample GETs: one member's raw bytes, or one sample as a tar. Concurrent GETs are
coalesced into batches by ``SampleBatcher`` (``--sample-window-ms``). A member whose block
is in RAM is answered at once by ``held_member``, a plain ASGI handler (``HeldRoutes``)."""

from __future__ import annotations

import logging
import time

from fastapi import APIRouter
from starlette.responses import Response

from shardfeed.service.api.common import TAR, AppState, PartsResponse, State, answer_changed_once, not_located
from shardfeed.service.datasets.dataset import Dataset
from shardfeed.service.datasets.index import UnknownField
from shardfeed.service.datasets.indexfile import IndexFormatError
from shardfeed.service.http.errors import ApiError, DatasetChanged, StoreUnavailable
from shardfeed.service.read.fields import known_member
from shardfeed.service.read.planner import pieces, size_of
from shardfeed.service.read.warm import held_member as held_bytes
from shardfeed.service.stores import ObjectChanged, StoreError
from shardfeed.tar import END_OF_ARCHIVE, frame

log = logging.getLogger("shardfeed.api")
router = APIRouter(tags=["samples"])


@router.get("/v1/datasets/{name}/samples/{i}/{field}", response_class=Response)
async def get_member(name: str, i: str, field: str, state: AppState) -> Response:
    return await answer_changed_once(lambda: _member(state, name, i, field), lambda: state.datasets.reload(name))


async def _member(state: State, name: str, i: str, field: str) -> Response:
    dataset = state.dataset(name)
    sample = sample_number(dataset, i)
    try:
        code = int(dataset.index.field_codes([field.lower()])[0])
    except UnknownField as err:
        raise ApiError(404, "unknown_field", str(err)) from None
    parts = await _read_sample(state, dataset, sample, code)
    if not parts:
        raise ApiError(404, "unknown_field", f"sample {sample} of dataset {name!r} has no field {field!r}")
    return PartsResponse(pieces(parts[0][1]), "application/octet-stream")


@router.get("/v1/datasets/{name}/samples/{i}", response_class=Response)
async def get_sample(name: str, i: str, state: AppState) -> Response:
    return await answer_changed_once(lambda: _sample(state, name, i), lambda: state.datasets.reload(name))


async def _sample(state: State, name: str, i: str) -> Response:
    dataset = state.dataset(name)
    sample = sample_number(dataset, i)
    parts = await _read_sample(state, dataset, sample, -1)
    key = dataset.index.key(sample)
    out = []
    for code, payload in parts:
        out += frame(f"{key}.{dataset.index.fields[code]}", *pieces(payload))
    out.append(END_OF_ARCHIVE)
    return PartsResponse(out, TAR)


async def held_member(state: State, scope, send) -> bool:
    """``GET /v1/datasets/{name}/samples/{i}/{field}`` of a member held in RAM, answered here;
    ``False`` (nothing sent) for any other request, which ``get_member`` then answers."""
    parts = scope["path"].split("/")
    if len(parts) != 7 or parts[4] != "samples" or parts[2] != "datasets" or parts[1] != "v1" \
            or scope["method"] != "GET":
        return False
    dataset, text = state.datasets.get(parts[3]), parts[5]
    if dataset is None or not (text.isascii() and text.isdigit()) or len(text) > 19 \
            or int(text) >= len(dataset.index) or state.admission.full("sample"):
        return False
    began = time.perf_counter()
    sample = int(text)
    member = known_member(dataset, sample, parts[6].lower())
    payload = held_bytes(state.coalescer, dataset, *member) if member is not None and member[2] else None
    if payload is None:
        return False
    with state.admission.slot("sample"):
        await send({"type": "http.response.start", "status": 200, "headers": [
            (b"content-type", b"application/octet-stream"), (b"content-length", b"%d" % len(payload))]})
        await send({"type": "http.response.body", "body": payload})  # a view of the RAM block: no copy
    _count_served(state, dataset, sample, 1, len(payload), began)
    return True


def sample_number(dataset: Dataset, text: str) -> int:
    if not (text.isascii() and text.isdigit()) or len(text) > 19:
        raise ApiError(400, "invalid_index", f"sample index must be a non-negative integer, not {text[:40]!r}")
    sample = int(text)
    if sample >= len(dataset.index):
        raise ApiError(404, "sample_out_of_range",
                       f"sample {sample} is out of range: dataset {dataset.name!r} has {len(dataset.index)} samples")
    return sample


async def _read_sample(state: State, dataset: Dataset, sample: int, field: int) -> list:
    began = time.perf_counter()
    with state.admission.slot("sample"):
        try:
            parts = await state.batcher.get(dataset, sample, field)
        except (StoreError, IndexFormatError) as err:  # the record's header could not be read
            raise not_located(err) from None
    metrics = state.metrics
    for _, payload in parts:
        if isinstance(payload, ObjectChanged):
            metrics.requests.labels("sample", "409").inc()
            raise DatasetChanged(f"sample {sample} of {dataset.name!r}: {payload}")
        if payload is None or isinstance(payload, StoreError):
            metrics.requests.labels("sample", "503").inc()
            raise StoreUnavailable(f"sample {sample} of {dataset.name!r} could not be read from the store: {payload}")
    if parts:  # none: the sample lacks the field, and the caller answers 404
        _count_served(state, dataset, sample, len(parts), sum(size_of(p) for _, p in parts), began)
    return parts


def _count_served(state: State, dataset: Dataset, sample: int, members: int, nbytes: int, began: float) -> None:
    metrics = state.metrics
    metrics.requests.labels("sample", "200").inc()
    metrics.samples.inc()
    metrics.bytes_served.inc(nbytes)
    elapsed = time.perf_counter() - began
    metrics.sample_latency.observe(elapsed)
    if log.isEnabledFor(logging.DEBUG):
        log.debug("sample dataset=%s i=%d members=%d ms=%.2f", dataset.name, sample, members, 1e3 * elapsed)
