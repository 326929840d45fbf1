"""``windows``: shuffle blocks of ``block`` consecutive samples (about one shard each),
then spread each block's samples uniformly over the ``window`` block slots that start
at its own (Streaming's py1e idea, without the boundaries of ``blocks``).

At any point of the epoch the samples come from about ``window`` blocks, so a cache of
``window`` shards (plus what is read ahead) keeps every block until all its samples are
read: each shard is read from the store once. Shards enter and leave the mix one at a
time, so neighbouring batches share most shards, and the first and last ``window``
slots of an epoch mix fewer shards than the rest. A sample moves at most ``window``
blocks from where its shard landed, so the order is shuffled within and across windows
but never globally: pick the largest window the cache allows.
"""

from __future__ import annotations

import numpy as np


def shuffle(samples: int, rng: np.random.Generator, locality: tuple[int, int] | None) -> np.ndarray:
    block, window = locality
    count = -(-samples // block)
    slot = np.empty(count, dtype=np.int64)
    slot[rng.permutation(count)] = np.arange(count)
    key = slot[np.arange(samples) // block] + rng.random(samples) * window
    return np.argsort(key, kind="stable").astype(np.int64, copy=False)
