"""PyTorch datasets backed by a shardfeed service.

- :class:`ShardfeedDataset`, map-style: ``DataLoader(ds, batch_size=B, num_workers=W)``
  fetches each batch with ONE request (through ``__getitems__``). Works with any
  sampler (``shuffle=True``, ``DistributedSampler``), ``pin_memory`` and
  ``persistent_workers``.
- :class:`ShardfeedSampler`: ``DistributedSampler`` semantics for a ``ShardfeedDataset``
  (rank, world size, ``set_epoch``, ``drop_last`` or padding) whose order the service
  computes too: each epoch it registers a plan, so the service reads ahead of the
  DataLoader and keeps the blocks that are read next (``client/plans.py``).
- :class:`ShardfeedIterableDataset`, iterable: yields whole batches in a deterministic
  global order drawn from ``(seed, epoch)``, split over ranks and workers with equal
  batch counts per rank, prefetched in the background, resumable mid-epoch with
  ``state_dict()`` / ``load_state_dict()`` (see :mod:`.sampling` for the exact rules).
  Iterate it through :class:`ShardfeedLoader`, which records progress as the training
  loop takes batches.

Samples are dicts ``{"__key__", "__index__", "<field>": bytes}``; ``decode=True`` turns
``.npy``/``.cls``/``.txt``/``.json`` fields into values (the fields of MDS and LitData shards
by the encodings their ``index.json`` names: :mod:`.encodings`), and ``transform`` maps each
(decoded) sample dict to whatever the model wants. With ``output="tensors"`` a batch is
one :class:`~.tensors.Batch` instead: every byte in one uint8 tensor, in shared memory in a
DataLoader worker, which the DataLoader passes to the training process without pickling a
byte of it (``batch["jpg"][i]`` is a view; :mod:`.tensors`). With ``output="arrow"`` a batch is a
``pyarrow.Table`` over such a buffer, sent the same way (:mod:`.arrow`, :mod:`.arrowshared`).
"""

from __future__ import annotations

import logging
import queue
import sys
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, IterableDataset, Sampler, default_collate, get_worker_info

from .decode import Decoder, make_decoder
from .node import is_dataset_url, node_dataset
from .plans import PlanHandle
from .sampling import EpochSampler
from .shuffles import LOCAL, cache_window, shard_samples
from .sync import Client
from .tensors import Batch

T = TypeVar("T")
R = TypeVar("R")

log = logging.getLogger("shardfeed.client")


class _Source:
    """Where samples come from and how they are turned into values (shared by both datasets)."""

    def __init__(self, url: str | Sequence[str] | Client, dataset: str | None, fields: Sequence[str] | None,
                 decode: bool | Mapping[str, Decoder], transform: Callable[[dict], Any] | None,
                 continue_on_error: bool, output: str, client_options: dict):
        if output not in OUTPUTS:
            raise ValueError(f"output must be one of {', '.join(map(repr, OUTPUTS))}, not {output!r}")
        if output != "samples" and (decode or transform is not None):
            raise TypeError(f"decode and transform apply to sample dicts, not to output={output!r}: "
                            "decode the batch's views (shardfeed.client.tensors, docs/tensors.md)")
        if isinstance(url, Client):
            if client_options:
                raise TypeError(f"client options {sorted(client_options)} given with a ready Client")
            self.client = url
        elif dataset is None:
            if not is_dataset_url(url):
                raise TypeError(f"{url!r} is a service URL: name the dataset too, or give a dataset URL "
                                "(s3://bucket/prefix, file:///dir or a path) alone")
            self.client, dataset = node_dataset(url, client_options)
        else:
            self.client = Client(url, **client_options)
        self.dataset = dataset
        self.fields = list(fields) if fields is not None else None
        self.transform = transform
        self.continue_on_error = continue_on_error
        self.output = output
        if output == "arrow":
            from . import arrowshared  # noqa: F401  (tables through DataLoader workers, as names of segments)
        self.info = self.client.info(dataset)
        self.decoder = make_decoder(decode, self.info)  # MDS and LitData fields by the encodings the info names
        self.client.load_routing(dataset)

    def fetch(self, indices: Sequence[int]) -> Any:
        """The samples at ``indices`` in one request, in the dataset's ``output``."""
        return OUTPUTS[self.output](self, indices)

    def samples(self, indices: Sequence[int]) -> list:
        """``output="samples"``: sample dicts, decoded and transformed."""
        samples = self.client.get_batch(self.dataset, indices, self.fields,
                                        continue_on_error=self.continue_on_error)
        if self.decoder is None and self.transform is None:
            return samples
        return [self.finish(s) for s in samples]

    def tensors(self, indices: Sequence[int]) -> Batch:
        """``output="tensors"``: one ``Batch``, in shared memory inside a DataLoader worker."""
        return self.client.get_batch_tensors(self.dataset, indices, self.fields,
                                             continue_on_error=self.continue_on_error,
                                             shared=get_worker_info() is not None)

    def arrow(self, indices: Sequence[int]) -> Any:
        """``output="arrow"``: one ``pyarrow.Table``, over a pooled shared-memory segment inside a
        DataLoader worker, which sends it to the training process by the segment's name."""
        return self.client.get_batch_arrow(self.dataset, indices, self.fields, continue_on_error=self.continue_on_error,
                                           shared=get_worker_info() is not None)

    def finish(self, sample: dict) -> Any:
        if self.decoder is not None:
            sample = self.decoder(sample)
        return sample if self.transform is None else self.transform(sample)


OUTPUTS = {"samples": _Source.samples, "tensors": _Source.tensors, "arrow": _Source.arrow}
"""What a batch is, by the datasets' ``output``: a list of sample dicts of ``bytes``, one
:class:`~.tensors.Batch`, or one ``pyarrow.Table`` (:mod:`.arrow`)."""


class ShardfeedDataset(Dataset):
    """Map-style dataset: ``ds[i]`` is sample ``i``; a DataLoader batch is one request.

    ``ShardfeedDataset("s3://bucket/prefix")``: the dataset's URL alone (``file://`` or a
    path too) reads it through the node's service, started if there is none and shared by
    every rank and DataLoader worker of the node (:mod:`.node`).

    Args:
        url: a dataset URL (then no ``dataset``); or service URL(s) (see
            :class:`shardfeed.client.Client`), or a ready ``Client``.
        dataset: the dataset's name on the service (none with a dataset URL).
        fields: fields to fetch, in order (default: all).
        decode: ``False`` for raw bytes, ``True`` for the built-in decoders (for MDS and LitData
            shards, each field's own encoding), or a mapping of field name or extension to a
            decoder (see :mod:`shardfeed.client.decode`).
        transform: applied to each sample dict after decoding; its result is the item.
        continue_on_error: return ``{"__key__": None, "__index__": i, "__missing__": True}``
            (passed through ``transform``) for a sample the service cannot serve, instead of
            failing the batch.
        output: ``"samples"`` (sample dicts of ``bytes``), ``"tensors"`` or ``"arrow"``: a
            DataLoader batch is one :class:`~.tensors.Batch` or one ``pyarrow.Table``
            (:mod:`.arrow`; the default ``collate_fn`` hands it on as it is; a ``collate_fn`` of
            your own gets a list holding it), ``ds[i]`` a sample dict of uint8 views or a table
            of one row. No ``decode`` or ``transform`` with them.
        **client_options: passed to ``Client`` (token, timeout, backoff, ...).
    """

    def __init__(self, url: str | Sequence[str] | Client, dataset: str | None = None, *,
                 fields: Sequence[str] | None = None,
                 decode: bool | Mapping[str, Decoder] = False, transform: Callable[[dict], Any] | None = None,
                 continue_on_error: bool = False, output: str = "samples", **client_options: Any):
        self.source = _Source(url, dataset, fields, decode, transform, continue_on_error, output, client_options)
        self.planned = False
        """Whether a ``ShardfeedSampler`` orders it (and so tells the service its order)."""
        self._warned = False

    def __len__(self) -> int:
        if not self.planned and not self._warned and sys._getframe(1).f_globals.get("__name__", "").startswith(
                "torch.utils.data"):  # sized by another sampler: PyTorch's order, which the service cannot know
            self._warned = True
            _warn_unplanned(self.source.info)
        return int(self.source.info["samples"])

    def __getitem__(self, index: int) -> Any:
        n = len(self)
        if not -n <= index < n:
            raise IndexError(f"sample {index} is out of range: {self.source.dataset!r} has {n} samples")
        batch = self.source.fetch([index % n])
        return batch if self.source.output == "arrow" else batch[0]

    def __getitems__(self, indices: list[int]) -> list:
        """The whole DataLoader batch in one request (PyTorch calls this when it exists); with
        ``output="tensors"`` or ``"arrow"`` a list holding its one batch, which ``default_collate``
        unwraps."""
        batch = self.source.fetch(indices)
        return batch if isinstance(batch, list) else [batch]


class ShardfeedSampler(Sampler[int]):
    """``DistributedSampler`` for a :class:`ShardfeedDataset` that announces its order.

    The same contract as ``torch.utils.data.DistributedSampler``: each epoch (set with
    :meth:`set_epoch`) a permutation drawn from ``(seed, epoch)`` (the identity without
    ``shuffle``), padded by wrapping around to a multiple of ``num_replicas`` (trimmed
    instead with ``drop_last``); rank ``r`` takes every ``num_replicas``-th index from
    ``r``. Every sample is read once per epoch across the ranks. The permutation comes
    from :mod:`.sampling`, not ``torch.randperm``: the service runs that same code on the
    plan this sampler registers at the start of each epoch, so it reads ahead of the
    DataLoader and evicts the blocks read last.

    Args:
        dataset: the map-style dataset (its client and fields are the plan's).
        num_replicas, rank: by default from ``torch.distributed`` if initialised, else 1 and 0.
        shuffle, seed, drop_last: as for ``DistributedSampler``.
        plan: ``False`` to register no plan (the order is the same).
    """

    def __init__(self, dataset: ShardfeedDataset, num_replicas: int | None = None, rank: int | None = None,
                 shuffle: bool = True, seed: int = 0, drop_last: bool = False, plan: bool = True):
        rank, world_size = _rank_and_world_size(rank, num_replicas)
        dataset.planned = plan
        # One sample per "batch": the batches go round-robin to the ranks, which is
        # DistributedSampler's stride.
        self.sampler = EpochSampler(len(dataset), 1, seed=seed, shuffle=shuffle, drop_last=drop_last,
                                    rank=rank, world_size=world_size)
        source = dataset.source
        self.plan = PlanHandle(source.client, source.dataset, source.fields) if plan else None

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    def __len__(self) -> int:
        return len(self.sampler)

    def __iter__(self) -> Iterator[int]:
        order = self.sampler.rank_order().tolist()
        if self.plan is None:
            yield from order
            return
        self.plan.register(self.sampler.plan())
        world_size = self.sampler.world_size
        for k, index in enumerate(order):
            if k % 64 == 63:  # refresh() itself asks the service only every CHECK_EVERY seconds
                self.plan.refresh(lambda: {**self.sampler.plan(), "consumed": k * world_size})
            yield index


class ShardfeedIterableDataset(IterableDataset):
    """Iterable dataset of whole batches in a deterministic, resumable global order.

    Use with ``DataLoader(ds, batch_size=None, ...)`` (the dataset batches), best through
    :class:`ShardfeedLoader`, which records progress for :meth:`state_dict`.

    Args:
        url, dataset, fields, decode, transform, continue_on_error, output, **client_options:
            as for :class:`ShardfeedDataset` (with ``output="tensors"`` each item is a
            :class:`~.tensors.Batch`, with ``"arrow"`` a ``pyarrow.Table``; ``collate_fn`` does not apply).
        batch_size: samples per batch.
        seed: with the epoch, selects the order; the same seed gives the same order.
        shuffle: ``False`` walks the samples in index order, ``True`` draws a uniform
            permutation, or the name of a mode of :mod:`.shuffles` (``"windows"``: a
            window of shards sliding through the epoch, for a cache smaller than the dataset).
            By default the best mixing the service's cache affords: uniform when the cache it
            reports holds the dataset, else ``"windows"`` (a uniform order through a cache of
            a quarter of the dataset reads it 13-18x without a plan, about once with one;
            ``windows`` about once either way, at 8.3 distinct shards per batch of 64, as
            Streaming's py1e: docs/measuring.md).
        drop_last: at the end of an epoch, drop the samples that do not fill a batch on
            every rank. By default they are padded instead, by wrapping around to the start
            of the epoch's order, so every batch is full (a few samples repeat).
        rank, world_size: this process's place in a distributed job; by default taken
            from ``torch.distributed`` if it is initialised, else 0 and 1. Give both or neither.
        shard_window: shards in play at once for the locality modes (``"windows"``,
            ``"blocks"``; with ``shuffle=True`` it selects ``"blocks"``). The service then
            needs only that many shards in its cache at a time, at the price of a less
            random order. By default sized from the cache the service reports
            (:func:`.shuffles.cache_window`).
        plan: register each pass's order with the service, so it reads ahead and keeps
            what is read next: once per rank and pass, from the first DataLoader worker (or
            the training process without workers), unless :meth:`announce` or
            ``ShardfeedLoader`` registered that pass's order before the workers started.
            Call :meth:`set_epoch` before each epoch, as with ``DistributedSampler``.
        collate_fn: turns the list of samples of a batch into the batch (default:
            ``torch.utils.data.default_collate``); ``None`` yields the list.
        prefetch: batches fetched ahead in a background thread while the current one is
            consumed (0: fetch on demand); bounds the memory held. By default 2 in the
            training process itself (``num_workers=0``) and 0 in a DataLoader worker, where
            the DataLoader already keeps ``prefetch_factor`` batches in flight per worker
            and a thread beside it only contends for the GIL (with a batch routed in parts
            to several service workers or replicas, which the client fetches on threads of
            its own, the warm epoch ran at two thirds of the rate).
    """

    def __init__(self, url: str | Sequence[str] | Client, dataset: str | None = None, *, batch_size: int,
                 seed: int = 0,
                 shuffle: bool | str | None = None, drop_last: bool = False, rank: int | None = None,
                 world_size: int | None = None, shard_window: int | None = None, plan: bool = True,
                 fields: Sequence[str] | None = None, decode: bool | Mapping[str, Decoder] = False,
                 transform: Callable[[dict], Any] | None = None,
                 collate_fn: Callable[[list], Any] | None = default_collate, prefetch: int | None = None,
                 continue_on_error: bool = False, output: str = "samples", **client_options: Any):
        if prefetch is not None and prefetch < 0:
            raise ValueError(f"prefetch must not be negative, not {prefetch}")
        if output != "samples" and collate_fn not in (default_collate, None):
            raise TypeError(f"collate_fn applies to lists of sample dicts, not to output={output!r}")
        self.source = _Source(url, dataset, fields, decode, transform, continue_on_error, output, client_options)
        rank, world_size = _rank_and_world_size(rank, world_size)
        samples = int(self.source.info["samples"])
        if shuffle is None:  # the best mixing the service's cache affords
            shuffle = True if cache_window(self.source.info) >= int(self.source.info["shards"]) else "windows"
        locality = None
        if shard_window is None and shuffle in LOCAL:
            shard_window = cache_window(self.source.info)
        if shard_window is not None:
            locality = (shard_samples(self.source.info), shard_window)
        self.sampler = EpochSampler(samples, batch_size, seed=seed, shuffle=shuffle, drop_last=drop_last,
                                    rank=rank, world_size=world_size, locality=locality)
        self.collate_fn = collate_fn if output == "samples" else None
        self.prefetch = prefetch
        self.plan = PlanHandle(self.source.client, self.source.dataset, self.source.fields) if plan else None

    def announce(self) -> None:
        """Register the rest of this rank's epoch as a plan (replacing the previous one)."""
        if self.plan is not None:
            self.plan.register(self.sampler.plan())

    def __iter__(self) -> Iterator[Any]:
        worker = get_worker_info()
        if self.plan is not None and (worker is None or worker.id == 0):
            # The plan comes with a plain DataLoader too: once per rank and pass, from its
            # first worker, unless this pass's was announced before the workers started.
            self.plan.ensure(self.sampler.plan())
        batches = self.sampler.batches(*((worker.id, worker.num_workers) if worker else (0, 1)))
        depth = self.prefetch if self.prefetch is not None else (2 if worker is None else 0)
        return _prefetched(batches, self._fetch, depth)

    def _fetch(self, indices: Any) -> Any:
        samples = self.source.fetch(indices)
        return samples if self.collate_fn is None else self.collate_fn(samples)

    def __len__(self) -> int:
        """Batches this rank still gets in the current epoch."""
        return len(self.sampler)

    @property
    def epoch(self) -> int:
        return self.sampler.epoch

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` (a no-op if already in it, so a resumed run keeps its place)."""
        self.sampler.set_epoch(epoch)

    def advance(self, batches: int = 1) -> None:
        """Record that the training loop took ``batches`` more batches (every rank alike).

        :class:`ShardfeedLoader` calls this; call it yourself when iterating through a
        plain ``DataLoader``, whose worker processes hold copies of this dataset.
        """
        self.sampler.advance(batches)

    def state_dict(self) -> dict[str, Any]:
        """Epoch and global progress; the same on every rank, so save rank 0's."""
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume where ``state`` was taken: the next iteration yields exactly the
        samples not yet seen, whatever the batch size, worker count or world size now."""
        self.sampler.load_state_dict(state)


class ShardfeedLoader:
    """A ``DataLoader`` over a :class:`ShardfeedIterableDataset` that knows how far it got.

    DataLoader workers iterate copies of the dataset, so only the training loop knows
    which batches were consumed. This loader counts each batch as consumed when the loop
    receives it, and moves to the next epoch when an epoch is read to its end, so
    ``loader.state_dict()`` taken anywhere in the loop resumes after the last batch the
    loop received::

        loader = ShardfeedLoader(ds, num_workers=2, pin_memory=True)
        loader.load_state_dict(checkpoint["data"])       # optional: resume
        for epoch in range(loader.epoch, epochs):
            for batch in loader:
                ...
                checkpoint["data"] = loader.state_dict()

    Keyword arguments go to ``DataLoader`` (``batch_size`` is the dataset's). The
    dataset's own ``collate_fn`` makes each batch, so by default the loader hands batches
    on as the dataset made them (a plain ``DataLoader`` would walk each one again with
    ``default_convert``, turning NumPy arrays into tensors at a cost of microseconds per
    sample); pass ``collate_fn=torch.utils.data.default_convert`` for that conversion. A
    new DataLoader is made for each pass, so the workers start from the current state;
    ``persistent_workers`` is therefore refused.
    """

    def __init__(self, dataset: ShardfeedIterableDataset, **dataloader_options: Any):
        if dataloader_options.get("persistent_workers"):
            raise ValueError("ShardfeedLoader starts fresh workers each epoch; persistent_workers is not supported")
        if dataloader_options.get("batch_size") is not None:
            raise ValueError("set batch_size on the ShardfeedIterableDataset, not on the loader")
        dataloader_options.pop("batch_size", None)
        dataloader_options.setdefault("collate_fn", _as_made)
        self.dataset = dataset
        self.options = dataloader_options

    def __iter__(self) -> Iterator[Any]:
        self.dataset.announce()
        plan = self.dataset.plan
        for batch in DataLoader(self.dataset, batch_size=None, **self.options):
            self.dataset.advance(1)
            if plan is not None:
                plan.refresh(self.dataset.sampler.plan)
            yield batch
        if self.dataset.sampler.finished:
            self.dataset.set_epoch(self.dataset.epoch + 1)

    def __len__(self) -> int:
        return len(self.dataset)

    @property
    def epoch(self) -> int:
        return self.dataset.epoch

    def state_dict(self) -> dict[str, Any]:
        return self.dataset.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.dataset.load_state_dict(state)


def _as_made(batch: T) -> T:
    """A batch as the dataset made it (``ShardfeedLoader``'s default ``collate_fn``)."""
    return batch


def _warn_unplanned(info: dict) -> None:
    """Warn (once per dataset) when a map-style dataset larger than the service's cache is read
    in an order the service is not told: with a random order, most blocks are evicted before
    their other samples are read."""
    cache = int(info.get("cache", {}).get("bytes", 0))
    if cache and int(info["bytes"]) > cache:
        log.warning("shardfeed: dataset %r (%.1f GiB) is larger than the service's cache (%.1f GiB) and read in an "
                    "order the service is not told: it may read the data many times over. Use "
                    "DataLoader(ds, sampler=ShardfeedSampler(ds), ...), which registers each epoch's order "
                    "as a plan.", info["name"], int(info["bytes"]) / 2**30, cache / 2**30)


def _rank_and_world_size(rank: int | None, world_size: int | None) -> tuple[int, int]:
    if rank is not None or world_size is not None:
        if rank is None or world_size is None:
            raise ValueError("give both rank and world_size, or neither")
        return rank, world_size
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _prefetched(items: Iterator[T], fn: Callable[[T], R], depth: int) -> Iterator[R]:
    """``fn(item)`` for each item, computed up to ``depth`` items ahead in a thread."""
    if depth == 0:
        yield from map(fn, items)
        return
    results: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def put(entry: tuple) -> bool:
        while not stop.is_set():
            try:
                results.put(entry, timeout=0.1)
                return True
            except queue.Full:
                pass
        return False

    def work() -> None:
        try:
            for item in items:
                if not put(("value", fn(item))):
                    return
            put(("end", None))
        except BaseException as exc:  # handed to the consumer, raised there
            put(("error", exc))

    thread = threading.Thread(target=work, name="shardfeed-prefetch", daemon=True)
    thread.start()
    try:
        while True:
            kind, value = results.get()
            if kind == "end":
                return
            if kind == "error":
                raise value
            yield value
    finally:
        stop.set()  # the thread exits after its current fetch; nothing waits for it
