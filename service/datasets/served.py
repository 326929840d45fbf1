"""The datasets a service serves, by name, and their reopening when the store changes.

A dataset is reopened (``reload``: listed again, its index read again) when someone asks
(``POST /v1/datasets/{name}/reload``, SIGHUP) or when a read finds one of its shards
replaced (``changed``, from the fetcher's ``ObjectChanged``). An unchanged listing only
refreshes ``checked``. A changed one puts a new ``Dataset`` in place: requests that began
on the old one finish on its versions or fail (their reads are conditional), new ones
read the new versions, the cache drops the replaced shards' blocks, and the listeners
(plans, GetBatch's catalog) move to the new dataset. Reloads of one dataset share one
listing: a burst of changed reads costs one.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterator, Mapping

from shardfeed.service.cache.disk import BlockCache
from shardfeed.service.datasets.dataset import Dataset, open_dataset

log = logging.getLogger("shardfeed.datasets")

Reloaded = Callable[[Dataset, Dataset], Awaitable[None]]
"""A listener told ``(old, new)`` when a dataset is replaced by a changed version."""


class ServedDatasets(Mapping[str, Dataset]):
    def __init__(self, datasets: dict[str, Dataset], cache: BlockCache, *, store_options: dict | None = None,
                 index_objects: bool = False):
        self._datasets = dict(datasets)
        self.cache = cache
        self.store_options = store_options
        self.index_objects = index_objects
        self.listeners: list[Reloaded] = []
        self._reloads: dict[str, asyncio.Task] = {}

    def __getitem__(self, name: str) -> Dataset:
        return self._datasets[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._datasets)

    def __len__(self) -> int:
        return len(self._datasets)

    def retain_cached(self) -> None:
        """Drop the cached blocks of versions no dataset serves (blocking: at start, in a thread)."""
        for dataset in self._datasets.values():
            self.cache.retain(dataset.id, dataset.shard_ids)

    async def reload(self, name: str) -> Dataset:
        """The dataset as the store holds it now (``StoreError``/``IndexFormatError`` if it cannot
        be opened: the current one stays). Joins a reload of it already under way."""
        task = self._reloads.get(name)
        if task is None:
            task = self._reloads[name] = asyncio.create_task(self._reload(self._datasets[name]))
            task.add_done_callback(lambda _: self._reloads.pop(name, None))
        return await asyncio.shield(task)

    async def reload_all(self) -> None:
        """``reload`` every dataset; a failure is logged and leaves that dataset as it was."""
        results = await asyncio.gather(*(self.reload(name) for name in self._datasets), return_exceptions=True)
        for name, result in zip(self._datasets, results):
            if isinstance(result, Exception):
                log.warning("dataset %s not reloaded: %s", name, result)

    def changed(self, dataset: Dataset) -> None:
        """A read found a shard of ``dataset`` replaced: reload it, unless that happened already."""
        if dataset.owned and self._datasets.get(dataset.name) is dataset and dataset.name not in self._reloads:
            asyncio.ensure_future(self.reload(dataset.name)).add_done_callback(_log_failure)

    async def _reload(self, old: Dataset) -> Dataset:
        new = await open_dataset(old.name, old.url, self.store_options, index_objects=self.index_objects,
                                 store=old.store)
        if new.version == old.version:
            old.checked = new.checked
            return old
        self._datasets[old.name] = new
        await asyncio.to_thread(self.cache.retain, new.id, new.shard_ids)
        for listener in self.listeners:
            await listener(old, new)
        log.info("dataset %s changed in the store: version %s -> %s (%d samples, %d shards)", new.name,
                 old.version, new.version, len(new.index), len(new.index.shards))
        return new


def _log_failure(future: asyncio.Future) -> None:
    if not future.cancelled() and future.exception() is not None:
        log.warning("dataset reload failed: %s", future.exception())
