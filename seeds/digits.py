"""A tiny real dataset for the demo: scikit-learn's bundled handwritten digits.

1797 images of 8x8 pixels ship inside scikit-learn, so the demo needs no download.
Each sample has ``npy`` (the image as a float32 ``.npy`` file, values 0-16) and ``cls``
(the digit as ASCII).
"""

from __future__ import annotations

import io
from collections.abc import Iterator

import numpy as np

from shardfeed.service.datasets.index import Index
from shardfeed.service.datasets.shards import Sample, write_shards
from shardfeed.service.stores import Store

DEFAULT_SHARD_SIZE = 512 << 10  # a few shards, so the demo exercises more than one


def iter_digits() -> Iterator[Sample]:
    from sklearn.datasets import load_digits  # the demo extra; imported only when used

    digits = load_digits()
    for i, (image, label) in enumerate(zip(digits.images.astype(np.float32), digits.target)):
        buf = io.BytesIO()
        np.save(buf, image)
        yield f"{i:06d}", [("npy", buf.getvalue()), ("cls", str(int(label)).encode())]


async def seed_digits(store: Store, *, shard_size: int = DEFAULT_SHARD_SIZE, progress: bool = True) -> Index:
    """Write the digits as shards + index into ``store``; returns the index.

    shard_size: target shard size in bytes (each sample takes about 2KiB of tar).
    """
    return await write_shards(store, iter_digits(), shard_size=shard_size, desc="digits", progress=progress)
