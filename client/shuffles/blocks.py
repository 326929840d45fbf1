"""``blocks``: shuffle blocks of ``block`` consecutive samples (about one shard each), cut
the shuffled blocks into windows of ``window`` blocks, and shuffle the samples of each
window; windows come one after the other (Streaming's py1b idea).

The service needs only ``window`` shards cached at a time. The price: the order is
random only within a window, and at a window's boundary the set of shards changes all
at once, so the first batches of a window all come from shards no earlier batch saw.
"""

from __future__ import annotations

import numpy as np


def shuffle(samples: int, rng: np.random.Generator, locality: tuple[int, int] | None) -> np.ndarray:
    block, window = locality
    count = -(-samples // block)
    # The window of each block, in a random order of blocks; samples sort by
    # (window, random key): whole windows in turn, shuffled inside.
    window_of_block = np.empty(count, dtype=np.int64)
    window_of_block[rng.permutation(count)] = np.arange(count) // window
    window_of_sample = window_of_block[np.arange(samples) // block]
    return np.lexsort((rng.random(samples), window_of_sample)).astype(np.int64, copy=False)
