"""``uniform``: a uniformly random permutation.

The order every training recipe assumes, and the hardest on a cache smaller than the
dataset: every block is touched all through the epoch, so with plans the service reads
most samples as single ranges (about one store request per sample, the dataset's bytes
once) instead of whole blocks.
"""

from __future__ import annotations

import numpy as np


def shuffle(samples: int, rng: np.random.Generator, locality: tuple[int, int] | None) -> np.ndarray:
    return rng.permutation(samples).astype(np.int64, copy=False)
