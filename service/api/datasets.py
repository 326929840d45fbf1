"""Dataset listing and description."""

from __future__ import annotations

from fastapi import APIRouter

from shardfeed.service.api.common import AppState

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
