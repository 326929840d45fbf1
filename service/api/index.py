"""A dataset's index as per-sample columns, for clients that select a subset of its samples
(issue 41's subsets; ``datasets/columns.py`` makes them).

    GET /v1/datasets/{name}/index           {"dataset", "version", "samples", "shards", "columns"}
    GET /v1/datasets/{name}/index/{column}  one column, a value per sample in sample order, as .npy
    GET /v1/datasets/{name}/index/shards    the shards' paths, a JSON list: the ``shard`` column's codes

A column is a NumPy ``.npy`` file (``numpy.lib.format``'s header, then the values), streamed a
chunk at a time as it is made, each chunk in a thread while the one before is sent: the service
never holds more than two chunks of it (``columns.CHUNK_BYTES`` each), however many samples the
dataset has. Its
``Content-Length`` is known before the first chunk is made. Each answer names the dataset
version it describes in ``X-Shardfeed-Dataset-Version``: a subset chosen from it holds for
that version.
"""

from __future__ import annotations

import asyncio
import io
import json
from collections.abc import AsyncIterator

import numpy as np
from fastapi import APIRouter
from starlette.responses import StreamingResponse

from shardfeed.service.api.batch import VERSION_HEADER
from shardfeed.service.api.common import AppState
from shardfeed.service.datasets import columns
from shardfeed.service.http.errors import ApiError

router = APIRouter(tags=["datasets"])

NPY = "application/x-npy"
SHARD_NAMES = 4096
"""Shard paths put in JSON at a time (on the event loop: about a millisecond's work)."""


@router.get("/v1/datasets/{name}/index")
async def index_columns(name: str, state: AppState) -> dict:
    """The index's columns, and its samples and shards: what ``.../index/{column}`` serves."""
    dataset = state.dataset(name)
    return {"dataset": name, "version": dataset.version, "samples": len(dataset.index),
            "shards": len(dataset.index.shards), "columns": columns.column_names(dataset.index)}


PATHS = {"application/json": {"schema": {"type": "array", "items": {"type": "string"}}}}


@router.get("/v1/datasets/{name}/index/shards", response_class=StreamingResponse,
            responses={200: {"content": PATHS, "description": "The shards' paths"}})
async def shard_names(name: str, state: AppState) -> StreamingResponse:
    """The shards' paths relative to the dataset's root, in code order: the ``shard`` column's
    value ``i`` is the shard ``shards[i]``. A loose object is a shard of its own (layout ``objects``)."""
    dataset = state.dataset(name)
    shards = dataset.index.shards

    async def body() -> AsyncIterator[bytes]:
        yield b"["
        for low in range(0, len(shards), SHARD_NAMES):
            yield (b"," if low else b"") + json.dumps(shards[low:low + SHARD_NAMES])[1:-1].encode()
        yield b"]"

    return StreamingResponse(body(), media_type="application/json", headers={VERSION_HEADER: dataset.version})


@router.get("/v1/datasets/{name}/index/{column}", response_class=StreamingResponse,
            responses={200: {"content": {NPY: {}}, "description": "The column as a NumPy .npy file"}})
async def index_column(name: str, column: str, state: AppState) -> StreamingResponse:
    """One column of the index, a value per sample in sample order, as a ``.npy`` file: ``key``
    (``S<longest key>``, UTF-8), ``shard`` (int32), ``bytes`` (int64), ``bytes.<field>`` (int64).
    404 ``unknown_column`` names the columns there are."""
    dataset = state.dataset(name)
    index = dataset.index
    try:
        wanted = await asyncio.to_thread(columns.column, index, column)  # the key column scans the keys
    except columns.UnknownColumn as err:
        raise ApiError(404, "unknown_column", f"dataset {name!r} has {err}") from None
    header = npy_header(wanted.dtype, len(index))
    return StreamingResponse(_chunks(header, wanted, len(index)), media_type=NPY, headers={
        "Content-Length": str(len(header) + len(index) * wanted.dtype.itemsize), VERSION_HEADER: dataset.version})


def npy_header(dtype: np.dtype, samples: int) -> bytes:
    """The start of a ``.npy`` file holding ``samples`` values of ``dtype``: its magic and header."""
    out = io.BytesIO()
    np.lib.format.write_array_header_1_0(out, {"descr": np.lib.format.dtype_to_descr(dtype),
                                               "fortran_order": False, "shape": (samples,)})
    return out.getvalue()


async def _chunks(header: bytes, wanted: columns.Column, samples: int) -> AsyncIterator[bytes | memoryview]:
    """The ``.npy`` file: its header, then each chunk of the column, the next one made in a thread
    while this one is sent (two chunks held at most)."""
    def make(low: int) -> asyncio.Future:
        return asyncio.ensure_future(asyncio.to_thread(wanted.chunk, low, min(samples, low + wanted.rows)))

    yield header
    made = make(0)
    try:
        for low in range(0, samples, wanted.rows):
            values = await made
            if low + wanted.rows < samples:
                made = make(low + wanted.rows)
            yield memoryview(values.view(np.uint8))
    finally:
        made.cancel()  # the client went away: its thread finishes, unheard
