"""Plan kind ``sampler``: the sampler's parameters, from which the service computes the order.

The cheapest plan to send (a few numbers for any dataset size) and exact, because the
service runs the client's own sampler (``shardfeed.client.sampling.EpochSampler``); it
covers what a shardfeed sampler yields, nothing else. Use ``indices`` for any other order.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
from pydantic import ConfigDict, Field, StrictBool, StrictInt

from shardfeed.client.sampling import EpochSampler
from shardfeed.service.plans.request import PlanRequest


class Request(PlanRequest):
    """The sampler of one rank: the samples it yields from ``consumed`` to the end of ``epoch``."""

    model_config = ConfigDict(extra="forbid")
    kind: Literal["sampler"]
    seed: StrictInt = 0
    epoch: StrictInt = Field(0, ge=0)
    rank: StrictInt = Field(0, ge=0)
    world_size: StrictInt = Field(1, ge=1, le=1 << 20)
    batch_size: StrictInt = Field(ge=1, le=1 << 24)
    shuffle: StrictBool | str = Field(True, description="False, True, or a shuffle mode's name "
                                                         "(shardfeed.client.shuffles).")
    locality: list[StrictInt] | None = Field(None, min_length=2, max_length=2,
                                             description="[block, window] of the locality shuffles.")
    drop_last: StrictBool = False
    consumed: StrictInt = Field(0, ge=0, description="Samples of the epoch already consumed (all ranks).")


def order(request: Request, samples: int) -> np.ndarray:
    """This rank's samples in the order it reads them (``ValueError`` for bad parameters)."""
    sampler = EpochSampler(samples, request.batch_size, seed=request.seed, shuffle=request.shuffle,
                           drop_last=request.drop_last, rank=request.rank, world_size=request.world_size,
                           locality=tuple(request.locality) if request.locality else None)
    sampler.set_epoch(request.epoch)
    sampler.consumed = min(request.consumed, samples)
    return sampler.rank_order()
