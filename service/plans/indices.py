"""Plan kind ``indices``: the order itself, in chunks.

Any order at all (a custom sampler, curriculum, a replayed log), at the price of sending
8-10 bytes per position; a long order comes in chunks (``complete: false``, then
``POST /v1/datasets/{name}/plans/{id}`` with the next chunk), each within the body limit.
The plan works from its first chunk on.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
from pydantic import ConfigDict, Field, StrictBool, StrictInt

from shardfeed.service.plans.request import PlanRequest


class Request(PlanRequest):
    """The first chunk of an explicit order."""

    model_config = ConfigDict(extra="forbid")
    kind: Literal["indices"]
    indices: list[StrictInt] = Field(description="Sample numbers in the order they will be read.")
    complete: StrictBool = Field(True, description="False: more chunks follow.")


def order(request: Request, samples: int) -> np.ndarray:
    return np.asarray(request.indices, dtype=np.int64)
