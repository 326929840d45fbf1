"""Per-sample GETs, batched: requests that arrive within ``window`` seconds are looked up
and read together, so thousands of concurrent ``GET .../samples/{i}/{field}`` cost a few
merged store reads instead of one each."""

from __future__ import annotations

import asyncio
from collections import defaultdict

import numpy as np

from shardfeed.service.datasets.dataset import Dataset
from shardfeed.service.read.coalescer import Coalescer
from shardfeed.service.read.fields import located
from shardfeed.service.read.planner import take


class SampleBatcher:
    """Collects per-sample reads for a short window, then resolves them as one batch.

    Args:
        coalescer: where the reads go.
        window: seconds to wait for more requests after the first one of a batch.
        max_batch: a batch is flushed at once when it reaches this many requests.
    """

    def __init__(self, coalescer: Coalescer, window: float, max_batch: int = 4096):
        self.coalescer = coalescer
        self.window = window
        self.max_batch = max_batch
        self._pending: dict[str, list[tuple[Dataset, int, int, asyncio.Future]]] = defaultdict(list)
        self._timers: dict[str, asyncio.TimerHandle] = {}
        self._tasks: set[asyncio.Task] = set()

    async def get(self, dataset: Dataset, sample: int, field: int = -1) -> list[tuple[int, object]]:
        """``[(field code, bytes | StoreError | None), ...]`` for one field, or every field if -1.

        An empty list means the sample has no such field.
        """
        future = asyncio.get_running_loop().create_future()
        pending = self._pending[dataset.name]
        pending.append((dataset, sample, field, future))
        if len(pending) >= self.max_batch:
            self._flush(dataset.name)
        elif dataset.name not in self._timers:
            self._timers[dataset.name] = asyncio.get_running_loop().call_later(
                self.window, self._flush, dataset.name)
        return await future

    def _flush(self, name: str) -> None:
        timer = self._timers.pop(name, None)
        if timer is not None:
            timer.cancel()
        batch = self._pending.pop(name, [])
        if batch:
            task = asyncio.create_task(self._resolve(batch))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _resolve(self, batch: list[tuple[Dataset, int, int, asyncio.Future]]) -> None:
        dataset = batch[0][0]
        try:
            indices = np.fromiter((b[1] for b in batch), np.int64, len(batch))
            wanted = np.fromiter((b[2] for b in batch), np.int64, len(batch))
            members = dataset.index.lookup(indices)
            keep = (wanted[members.position] < 0) | (members.field == wanted[members.position])
            members = await located(self.coalescer, dataset, take(members, keep))
            payloads = await self.coalescer.read_members(dataset, members)
            results: list[list] = [[] for _ in batch]
            for position, field, payload in zip(members.position.tolist(), members.field.tolist(), payloads):
                results[position].append((field, payload))
            for (_, _, _, future), result in zip(batch, results):
                if not future.done():
                    future.set_result(result)
        except BaseException as err:  # never leave a waiter hanging
            for *_, future in batch:
                if not future.done():
                    future.set_exception(err)
            if not isinstance(err, Exception):
                raise
