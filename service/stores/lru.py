"""A bounded async memo: one load per key in flight (singleflight), the least recently used
values dropped past a weight budget. GetBatch keeps its HEADs and member tables in one
(``datasets/objects.py``), the compressed store its decompressed shards (``compressed.py``)."""

from __future__ import annotations

import asyncio
import math
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class Lru(Generic[K, V]):
    """An async memo of ``load(key)``: one load per key in flight, at most ``capacity`` weight kept
    (least recently used dropped first), each value for at most ``ttl`` seconds. Errors are
    not remembered."""

    def __init__(self, load: Callable[[K], Awaitable[V]], capacity: int, weight: Callable[[V], int] = lambda v: 1,
                 ttl: float = math.inf):
        self._load = load
        self._capacity = capacity
        self._weight = weight
        self._ttl = ttl
        self._values: OrderedDict[K, tuple[V, int, float]] = OrderedDict()  # value, weight, loaded at
        self._total = 0
        self._loading: dict[K, asyncio.Future] = {}

    def peek(self, key: K) -> V | None:
        """The value if it is loaded already and not expired (counts as a use), else ``None``."""
        entry = self._values.get(key)
        if entry is None:
            return None
        if time.monotonic() - entry[2] >= self._ttl:
            self.forget(key)
            return None
        self._values.move_to_end(key)
        return entry[0]

    def has(self, key: K) -> bool:
        """Whether the value is loaded (counts as a use) or being loaded."""
        return self.peek(key) is not None or key in self._loading

    @property
    def weight(self) -> int:
        """The weight of the values kept."""
        return self._total

    async def get(self, key: K) -> V:
        value = self.peek(key)
        if value is not None:
            return value
        pending = self._loading.get(key)
        if pending is None:
            pending = self._loading[key] = asyncio.ensure_future(self._load(key))
            pending.add_done_callback(lambda f: self._loaded(key, f))
        return await asyncio.shield(pending)

    def forget(self, key: K) -> None:
        entry = self._values.pop(key, None)
        if entry is not None:
            self._total -= entry[1]

    def _loaded(self, key: K, future: asyncio.Future) -> None:
        self._loading.pop(key, None)
        if future.cancelled() or future.exception() is not None:
            return
        value = future.result()
        weight = self._weight(value)
        if weight > self._capacity:
            return
        self.forget(key)
        self._values[key] = (value, weight, time.monotonic())
        self._total += weight
        while self._total > self._capacity:
            _, (_, dropped, _) = self._values.popitem(last=False)
            self._total -= dropped
