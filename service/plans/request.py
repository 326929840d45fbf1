"""What every plan request carries, whatever its kind."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt


class PlanRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    kind: str = Field(description="How the order is given: 'sampler' or 'indices'.")
    ttl: float | None = Field(None, gt=0, description="Seconds the plan lives after its last use "
                                                     "(default and maximum: the service's --plan-ttl).")
    fields: list[str] | None = Field(None, description="Fields the reader asks for (default: all).")
    share: float = Field(1.0, gt=0, le=1, description=(
        "The share of its reader's reads this plan's order holds (a stream of a mixture: its part of the "
        "mixture); the service compares plans' distances in the reader's reads, a plan position counting "
        "1/share of them."))


class Chunk(BaseModel):
    """Body of ``POST /v1/datasets/{name}/plans/{id}``: the next chunk of an ``indices`` plan."""

    model_config = ConfigDict(extra="forbid")
    indices: list[StrictInt]
    complete: StrictBool = True
