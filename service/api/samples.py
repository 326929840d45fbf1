"""Per-sample GETs: one member's raw bytes, or one sample as a tar. Concurrent GETs are
coalesced into batches by ``SampleBatcher`` (``--sample-window-ms``)."""

from __future__ import annotations

import logging
import time

from fastapi import APIRouter
from starlette.responses import Response

from shardfeed.tar import END_OF_ARCHIVE, frame

from ..datasets import Dataset
from ..errors import ApiError, StoreUnavailable
from ..index import UnknownField
from ..stores import StoreError
from .common import TAR, AppState, State

log = logging.getLogger("shardfeed.api")
router = APIRouter(tags=["samples"])


@router.get("/v1/datasets/{name}/samples/{i}/{field}", response_class=Response)
async def get_member(name: str, i: str, field: str, state: AppState) -> Response:
    dataset = state.dataset(name)
    sample = sample_number(dataset, i)
    try:
        code = int(dataset.index.field_codes([field.lower()])[0])
    except UnknownField as err:
        raise ApiError(404, "unknown_field", str(err)) from None
    parts = await _read_sample(state, dataset, sample, code)
    if not parts:
        raise ApiError(404, "unknown_field", f"sample {sample} of dataset {name!r} has no field {field!r}")
    return Response(bytes(parts[0][1]), media_type="application/octet-stream")


@router.get("/v1/datasets/{name}/samples/{i}", response_class=Response)
async def get_sample(name: str, i: str, state: AppState) -> Response:
    dataset = state.dataset(name)
    sample = sample_number(dataset, i)
    parts = await _read_sample(state, dataset, sample, -1)
    key = dataset.index.key(sample)
    out = []
    for code, payload in parts:
        out += frame(f"{key}.{dataset.index.fields[code]}", payload)
    out.append(END_OF_ARCHIVE)
    return Response(b"".join(out), media_type=TAR)


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
        parts = await state.batcher.get(dataset, sample, field)
    metrics = state.metrics
    for _, payload in parts:
        if payload is None or isinstance(payload, StoreError):
            metrics.requests.labels("sample", "503").inc()
            raise StoreUnavailable(f"sample {sample} of {dataset.name!r} could not be read from the store: {payload}")
    metrics.requests.labels("sample", "200").inc()
    metrics.samples.inc()
    metrics.bytes_served.inc(sum(len(p) for _, p in parts))
    elapsed = time.perf_counter() - began
    metrics.sample_latency.observe(elapsed)
    if log.isEnabledFor(logging.DEBUG):
        log.debug("sample dataset=%s i=%d members=%d ms=%.2f", dataset.name, sample, len(parts), 1e3 * elapsed)
    return parts
