"""Datasets: listing, description, and reopening one that changed in the store.

    GET  /v1/datasets                every dataset served, with its version
    GET  /v1/datasets/{name}         one, and the cache it is read through
    POST /v1/datasets/{name}/reload  list it and read its index again (relayed to every node)
"""

from __future__ import annotations

from fastapi import APIRouter, Request

from shardfeed.service.api.common import AppState, relay, relayed_copy
from shardfeed.service.datasets.indexfile import IndexFormatError
from shardfeed.service.http.errors import ApiError, StoreUnavailable
from shardfeed.service.stores import StoreError

router = APIRouter(tags=["datasets"])


@router.get("/v1/datasets")
async def list_datasets(state: AppState) -> list[dict]:
    return [d.info() for d in state.datasets.values()]


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
