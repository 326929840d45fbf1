"""Shuffle modes: how one epoch's order is drawn. One module each, one signature:
``shuffle(samples, rng, locality) -> order`` (a permutation of ``range(samples)``).

    none      index order
    uniform   every order equally likely: the best mixing, no locality at all
    blocks    whole windows of shards in turn, shuffled inside (Streaming's py1b idea)
    windows   a window of shards sliding through the epoch (Streaming's py1e idea)

``locality`` is ``(block, window)``: about one shard's samples per block (shards hold runs
of consecutive indices) and how many blocks the cache should hold at once. The client
and the service (plans) compute orders with this code alone, so they agree exactly.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from . import blocks, uniform, windows

Shuffle = Callable[[int, np.random.Generator, "tuple[int, int] | None"], np.ndarray]


def _none(samples: int, rng: np.random.Generator, locality: tuple[int, int] | None) -> np.ndarray:
    return np.arange(samples, dtype=np.int64)


SHUFFLES: dict[str, Shuffle] = {"none": _none, "uniform": uniform.shuffle, "blocks": blocks.shuffle,
                                "windows": windows.shuffle}
LOCAL = frozenset({"blocks", "windows"})
"""The modes that need ``locality``."""


CACHE_SHARE = 0.75
"""Share of the service's cache a locality window may fill; the rest holds what is read ahead."""

TAR_OVERHEAD = 1.1
"""Shard bytes per payload byte (tar headers and padding), for small samples."""


def cache_window(info: dict) -> int:
    """Shards in play at once that fit the cache a dataset description reports
    (``GET /v1/datasets/{name}``); all of them when the cache holds the dataset.

    A shard takes its bytes in cache blocks, plus one block where it starts and ends
    mid-block."""
    shards = max(1, int(info["shards"]))
    cache = info.get("cache", {})
    block = max(1, int(cache.get("block_size", 1 << 20)))
    footprint = TAR_OVERHEAD * int(info["bytes"]) / shards / block + 1
    return int(max(1, min(shards, CACHE_SHARE * cache.get("bytes", 0) / block // footprint)))


def shard_samples(info: dict) -> int:
    """Samples per shard, the locality modes' ``block``: shards hold runs of consecutive
    indices, typically ``shard_samples`` long (older services: samples / shards)."""
    typical = int(info.get("shard_samples") or 0)
    return typical if typical > 0 else -(-int(info["samples"]) // max(1, int(info["shards"])))
