"""The datasets a service serves, by name: opened at start, added and removed at runtime,
and reopened when the store changes.

A dataset is reopened (``reload``: listed again, its index read again) when someone asks
(``POST /v1/datasets/{name}/reload``, SIGHUP) or when a read finds one of its shards
replaced (``changed``, from the fetcher's ``ObjectChanged``). An unchanged listing only
refreshes ``checked``. A changed one, its changed shards checked against its index first
(``agreement.py``), puts a new ``Dataset`` in place: requests that began
on the old one finish on its versions or fail (their reads are conditional), new ones
read the new versions, the cache drops the replaced shards' blocks, and the listeners
(plans, GetBatch's catalog) move to the new dataset. Reloads of one dataset share one
listing: a burst of changed reads costs one.

A dataset is added (``register``, ``POST /v1/datasets``) under a name not taken by another
URL; registering the same name and URL again joins the first registration, or finds it
done. Tar shards without an index are indexed then (``autoindex.py``), which may take a
while: ``registering`` shows how far each is. With ``--workers N`` the runtime datasets are
also written to the supervisor's registry file, which a restarted worker opens at start.
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import logging
from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from shardfeed.service.cache.disk import BlockCache
from shardfeed.service.config import ServiceConfig
from shardfeed.service.datasets.agreement import agreed
from shardfeed.service.datasets.autoindex import IndexKeeper, IndexProgress, write_atomically
from shardfeed.service.datasets.dataset import Dataset, open_dataset
from shardfeed.service.datasets.index import Share, unshared
from shardfeed.service.datasets.mapped import SharedIndexes
from shardfeed.service.stores import Store

log = logging.getLogger("shardfeed.datasets")

Replaced = Callable[[Dataset | None, Dataset | None], Awaitable[None]]
"""A listener told ``(old, new)`` when a dataset is replaced by a changed version, added
(``old`` None) or removed (``new`` None)."""

STORE_LINGER = 60.0
"""Seconds a removed dataset's store stays open, for the requests that began on it."""


class NameTaken(Exception):
    """The name is served, or being registered, with another URL."""


@dataclass
class Opener:
    """How this service opens a dataset: store options, hedging, and what to do without an index."""

    store_options: dict = field(default_factory=dict)
    index_objects: bool = False
    """Without ``index.parquet``, index the root's loose objects (``layouts.py``)."""
    keeper: IndexKeeper | None = None
    """Without ``index.parquet`` (and not ``index_objects``), index the root's tar shards."""
    wrap: Callable[[Store], Store] = lambda store: store
    """Applied to every store opened (``hedge.Hedger.wrap``)."""
    share: Share = unshared
    """How an ``index.parquet`` read is kept for the host's other processes (``mapped.py``)."""

    @classmethod
    def of(cls, config: ServiceConfig, wrap: Callable[[Store], Store] | None = None) -> Opener:
        """A service's: its store options, each store opened wrapped in ``wrap``; indexes kept,
        and mapped once per host, in its index directory."""
        share = SharedIndexes(config.index_dir / "mapped").share
        return cls(config.store_options, config.index_objects, IndexKeeper(config.index_dir, share),
                   wrap=wrap or (lambda store: store), share=share)

    async def __call__(self, name: str, url: str, *, store: Store | None = None,
                       progress: IndexProgress | None = None, before: Dataset | None = None) -> Dataset:
        """The dataset at ``url`` now, its shards checked against its index (``agreement.py``:
        those changed since ``before``, or a sample of them on a first opening)."""
        dataset = await open_dataset(name, url, self.store_options, index_objects=self.index_objects, store=store,
                                     keeper=self.keeper, progress=progress, share=self.share)
        dataset.store = self.wrap(dataset.store)  # its reads hedged; its opening read each thing once
        return await agreed(before, dataset)


@dataclass
class Registration:
    """A dataset being added: its URL, its opening, and how far its indexing is."""

    url: str
    task: asyncio.Task
    progress: IndexProgress = field(default_factory=IndexProgress)
    opened: asyncio.Event = field(default_factory=asyncio.Event)
    """Set once the dataset is served here, before the registration's ``then`` (its relays)."""

    def info(self, name: str) -> dict:
        return {"name": name, "url": self.url, "indexing": self.progress.info() if self.progress.bytes else None}


class ServedDatasets(Mapping[str, Dataset]):
    def __init__(self, datasets: dict[str, Dataset], cache: BlockCache, opener: Opener | None = None,
                 registry: Path | None = None):
        self._datasets = dict(datasets)
        self.cache = cache
        self.opener = opener or Opener()
        self.registry = registry
        self.listeners: list[Replaced] = []
        self.registering: dict[str, Registration] = {}
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

    # -- runtime registration ----------------------------------------------------------
    def register(self, name: str, url: str, then: Callable[[Dataset], Awaitable[None]] | None = None,
                 ) -> asyncio.Task:
        """Start serving ``url`` as ``name`` (a task: its ``Dataset``, or the error that stopped
        it), and ``then(dataset)`` as part of it (tell the other nodes). The same name and URL
        again: the registration under way, or a done task. ``NameTaken`` when the name is
        served or being registered with another URL."""
        served = self._datasets.get(name)
        pending = self.registering.get(name)
        taken = served.url if served is not None else pending.url if pending is not None else url
        if taken != url:
            raise NameTaken(f"dataset {name!r} is already {'served' if served else 'being registered'} from {taken}")
        if pending is not None:
            return pending.task
        if served is not None:
            done = asyncio.get_running_loop().create_future()
            done.set_result(served)
            return done
        progress = IndexProgress()
        task = asyncio.create_task(self._register(name, url, progress, then))
        self.registering[name] = Registration(url, task, progress)
        task.add_done_callback(lambda _: self.registering.pop(name, None))
        return task

    async def _register(self, name: str, url: str, progress: IndexProgress,
                        then: Callable[[Dataset], Awaitable[None]] | None) -> Dataset:
        dataset = await self.opener(name, url, progress=progress)
        self._datasets[name] = dataset
        await asyncio.to_thread(self._record, name, url)
        for listener in self.listeners:
            await listener(None, dataset)
        log.info("dataset %s registered: %s (%d samples, %d shards, version %s)", name, url, len(dataset.index),
                 len(dataset.index.shards), dataset.version)
        self.registering[name].opened.set()
        if then is not None:
            await then(dataset)
        return dataset

    async def opened(self, name: str, task: asyncio.Future) -> Dataset:
        """The dataset of registration ``task`` once it is served here, without waiting for what
        the registration does after (its ``then``: relays to the other nodes, which may be
        waiting on this one's); the error that stopped it, if it failed first."""
        pending = self.registering.get(name)
        if pending is None or pending.task is not task:
            return await task
        served = asyncio.ensure_future(pending.opened.wait())
        try:
            await asyncio.wait([task, served], return_when=asyncio.FIRST_COMPLETED)
        finally:
            served.cancel()
        return task.result() if task.done() else self._datasets[name]

    async def remove(self, name: str) -> Dataset:
        """Stop serving ``name`` (``KeyError`` when it is not served). Requests under way finish;
        its cached blocks stay, for a registration of it again, until evicted."""
        dataset = self._datasets.pop(name)
        await asyncio.to_thread(self._record, name, None)
        for listener in self.listeners:
            await listener(dataset, None)
        asyncio.get_running_loop().call_later(STORE_LINGER, lambda: asyncio.ensure_future(dataset.store.close()))
        log.info("dataset %s removed (%s)", name, dataset.url)
        return dataset

    def _record(self, name: str, url: str | None) -> None:
        if self.registry is not None:
            update_registry(self.registry, name, url)

    # -- reopening ---------------------------------------------------------------------
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
        names = list(self._datasets)
        results = await asyncio.gather(*(self.reload(name) for name in names), return_exceptions=True)
        for name, result in zip(names, results):
            if isinstance(result, Exception):
                log.warning("dataset %s not reloaded: %s", name, result)

    def changed(self, dataset: Dataset) -> None:
        """A read found a shard of ``dataset`` replaced: reload it, unless that happened already."""
        if dataset.owned and self._datasets.get(dataset.name) is dataset and dataset.name not in self._reloads:
            asyncio.ensure_future(self.reload(dataset.name)).add_done_callback(_log_failure)

    async def _reload(self, old: Dataset) -> Dataset:
        new = await self.opener(old.name, old.url, store=old.root, before=old)
        if new.version == old.version:
            old.checked = new.checked
            return old
        if self._datasets.get(old.name) is not old:  # removed (or replaced) meanwhile
            return new
        self._datasets[old.name] = new
        await asyncio.to_thread(self.cache.retain, new.id, new.shard_ids)
        for listener in self.listeners:
            await listener(old, new)
        log.info("dataset %s changed in the store: version %s -> %s (%d samples, %d shards)", new.name,
                 old.version, new.version, len(new.index), len(new.index.shards))
        return new


def read_registry(path: Path) -> dict[str, str]:
    """The datasets registered at runtime on this host, ``{name: url}`` ({} before the first)."""
    try:
        return dict(json.loads(path.read_text()))
    except FileNotFoundError:
        return {}


def update_registry(path: Path, name: str, url: str | None) -> None:
    """Record ``name`` as served from ``url`` (None: no longer served), under a lock: every
    worker of the host records the same registration, each when it carries it out."""
    with open(path.with_suffix(".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        datasets = read_registry(path)
        if url is None:
            datasets.pop(name, None)
        else:
            datasets[name] = url
        write_atomically(path, json.dumps(datasets).encode())


def _log_failure(future: asyncio.Future) -> None:
    if not future.cancelled() and future.exception() is not None:
        log.warning("dataset reload failed: %s", future.exception())
