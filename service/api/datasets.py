"""Datasets: listing, description, adding and removing at runtime, and reopening one that
changed in the store.

    GET    /v1/datasets                every dataset served, with its version
    POST   /v1/datasets                serve {"name", "url"} from now on (relayed to every node)
    GET    /v1/datasets/{name}         one, and the cache it is read through
    DELETE /v1/datasets/{name}         serve it no more (relayed to every node)
    POST   /v1/datasets/{name}/reload  list it and read its index again (relayed to every node)
"""

from __future__ import annotations

import asyncio
import re
from urllib.parse import urlparse

from fastapi import APIRouter, Query, Request
from pydantic import BaseModel, Field
from starlette.responses import JSONResponse

from shardfeed.service.api.auth import tenant_of
from shardfeed.service.api.common import AppState, json_body, read_json, relay, relayed_copy
from shardfeed.service.datasets.dataset import Dataset
from shardfeed.service.datasets.indexfile import IndexFormatError
from shardfeed.service.datasets.served import NameTaken
from shardfeed.service.http.errors import ApiError, InvalidRequest, StoreUnavailable, UnknownDataset
from shardfeed.service.stores import StoreError
from shardfeed.service.stores import StoreUnavailable as StoreDown

router = APIRouter(tags=["datasets"])

NAME = r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}"
"""A dataset's name: it is a path segment of every route, so no slash and nothing to escape."""

REGISTER_WAIT = 5.0
"""Seconds ``POST /v1/datasets`` waits for the dataset to open before answering 202 (tar
shards being indexed), by default (``?wait=``): the client sends the same request again to
learn the outcome."""

RELAY_TIMEOUT = 120.0
"""Seconds the other nodes have to open a registered dataset (its index is made by then)."""


class DatasetSpec(BaseModel):
    name: str = Field(pattern=f"^{NAME}$", description="the name the routes use")
    url: str = Field(min_length=1, max_length=4096,
                     description="its root: s3://bucket/prefix, file:///abs/dir or an absolute path")


@router.get("/v1/datasets")
async def list_datasets(request: Request, state: AppState) -> list[dict]:
    """The datasets served that the request's token may read."""
    tenant = tenant_of(request.scope)
    return [d.info() for d in state.datasets.values() if tenant.may_read(d.name)]


@router.get("/v1/datasets/{name}")
async def dataset_info(name: str, state: AppState) -> dict:
    """The dataset, and the cache it is read through (clients size locality shuffles by it)."""
    cache = state.coalescer.cache
    return {**state.dataset(name).info(),
            "cache": {"bytes": cache.capacity if cache.writable else 0, "block_size": cache.block_size}}


@router.post("/v1/datasets/{name}/reload")
async def reload_dataset(name: str, request: Request, state: AppState) -> dict:
    """Reopen the dataset after its shards or index changed in the store: one listing of its
    root, and its index read again. Batches already being read finish on the versions
    they began with (or fail with 409 ``dataset_changed``); later ones read the new. The
    dataset as it is now, ``version`` and ``checked`` included."""
    state.dataset(name)
    copy = relayed_copy(request)
    try:
        dataset = await state.datasets.reload(name)
    except IndexFormatError as err:
        raise ApiError(422, "invalid_index", f"dataset {name!r} not reloaded (still served as it was): {err}") from None
    except StoreError as err:
        raise StoreUnavailable(f"dataset {name!r} not reloaded (still served as it was): {err}") from None
    await relay(state, request, copy, b"")
    return {"dataset": dataset.info()}


@router.post("/v1/datasets", openapi_extra=json_body(DatasetSpec),
             responses={202: {"description": "Being indexed: send the same request again for the outcome"},
                        409: {"description": "The name is taken by another URL"},
                        422: {"description": "The URL holds no dataset that can be served"}})
async def register_dataset(request: Request, state: AppState, wait: float = Query(
        REGISTER_WAIT, ge=0, le=60, description="seconds to wait for the dataset to open before answering 202"),
                           ) -> JSONResponse:
    """Serve the dataset at ``url`` as ``name`` from now on, on every node of the cluster.
    Its root holds ``index.parquet``, or WebDataset ``.tar`` shards, which are indexed now
    (headers only; progress on the status page and in the 202's ``registering``): the
    index is written beside them, or kept in the service's cache directory where the
    prefix is read-only. Idempotent: the same name and URL again answers 200 once served."""
    spec = await read_json(request, DatasetSpec, 64 * 1024)
    _check_url(spec.url)
    copy = relayed_copy(request)

    async def spread(dataset: Dataset) -> None:  # part of the registration: done even if nobody waits
        await relay(state, request, copy, spec.model_dump_json().encode(), timeout=RELAY_TIMEOUT, down_too=True)

    try:
        task = state.datasets.register(spec.name, spec.url, then=spread)
    except NameTaken as err:
        raise ApiError(409, "dataset_exists", str(err)) from None
    if copy is not None:
        # A relayed copy needs the dataset served here, not this node's own relays: two nodes
        # registering the same name at once (two ranks' clients) would each wait on the other's.
        task = asyncio.ensure_future(state.datasets.opened(spec.name, task))
    done, _ = await asyncio.wait([task], timeout=None if copy else wait)
    if not done:
        registration = state.datasets.registering[spec.name]
        return JSONResponse({"registering": registration.info(spec.name)}, status_code=202,
                            headers={"Retry-After": "1"})
    try:
        dataset = task.result()
    except IndexFormatError as err:
        raise ApiError(422, "invalid_index", f"dataset {spec.name!r} not registered: {err}") from None
    except StoreDown as err:
        raise StoreUnavailable(f"dataset {spec.name!r} not registered: {err}") from None
    except StoreError as err:
        raise ApiError(422, "no_dataset", f"dataset {spec.name!r} not registered: {err}") from None
    return JSONResponse({"dataset": dataset.info()})


@router.delete("/v1/datasets/{name}")
async def remove_dataset(name: str, request: Request, state: AppState) -> dict:
    """Serve the dataset no more, on every node. Batches already being read finish; its plans
    are dropped; its cached blocks stay until evicted (registering it again is warm)."""
    copy = relayed_copy(request)
    if name in state.datasets.registering:
        raise ApiError(409, "dataset_registering", f"dataset {name!r} is being registered: remove it once "
                                                   "its registration is done")
    try:
        dataset = await state.datasets.remove(name)
    except KeyError:
        if copy is not None:  # not (or no longer) served on this node: nothing to do here
            return {"removed": None}
        raise UnknownDataset(name, list(state.datasets)) from None
    await relay(state, request, copy, b"", down_too=True)
    return {"removed": dataset.info()}


def _check_url(url: str) -> None:
    """A URL the service can open wherever it runs: a relative path would be the service's."""
    scheme = urlparse(url).scheme
    if scheme not in ("", "file", "s3") or (scheme == "" and not url.startswith("/")):
        raise InvalidRequest(f"invalid dataset URL {url[:200]!r}: s3://bucket/prefix, file:///abs/dir or an "
                             "absolute path expected")
    if re.search(r"[\x00-\x1f]", url):
        raise InvalidRequest("invalid dataset URL: control characters")
