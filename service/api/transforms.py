"""``GET /v1/transforms``: the transforms the service runs (``serve --transform``), and the
``"transform"`` of a batch request, which names one (its stage: ``service/transform/batch.py``)."""

from __future__ import annotations

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field, StrictInt

from shardfeed.service.api.common import AppState

router = APIRouter(tags=["transforms"])


class TransformRequest(BaseModel):
    """``"transform"`` of ``POST /v1/batch``: which served transform, and the seed and epoch its
    augmentation draws from (with the sample's number: ``transforms.base.rng_for``)."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1, max_length=64, description="A served transform (GET /v1/transforms).")
    seed: StrictInt = Field(0, ge=0, le=(1 << 64) - 1, description="The run's seed.")
    epoch: StrictInt = Field(0, ge=0, le=(1 << 64) - 1, description="The epoch.")


class OutputShape(BaseModel):
    dtype: str
    shape: list[int | None]


class ServedTransform(BaseModel):
    name: str
    spec: str = Field(description="package.module:factory: a client may load the same transform locally.")
    version: str = Field(description="Changes whenever its prepare output would (part of the prepared cache's key).")
    fields: list[str] | None = Field(description="The sample's fields it reads; null: every field.")
    outputs: dict[str, OutputShape] = Field(description="Its outputs, in the answer's column order.")


class TransformList(BaseModel):
    transforms: list[ServedTransform]


@router.get("/v1/transforms", response_model=TransformList)
async def list_transforms(state: AppState) -> dict:
    """The served transforms, in the order they were registered."""
    return {"transforms": state.transforms.listed()}
