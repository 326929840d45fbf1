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
With ``transform=`` a transform's name (the service runs it) or a ``shardfeed.transforms.Transform``
(the DataLoader workers run it, :mod:`.transformed`), a batch is such a ``Batch`` of its outputs,
``batch.outputs`` them typed, augmented for the seed and epoch each sample was drawn with.
"""

from __future__ import annotations

import copy
import hashlib
import logging
import queue
import re
import sys
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

import numpy as np
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, IterableDataset, Sampler, default_collate, get_worker_info

from shardfeed.transforms import Transform, fields_read

from .base import Pick
from .decode import Decoder, make_decoder
from .errors import ShardfeedError
from .mixing import IndexColumns, MixtureSampler, Stream, locate, offsets_of, pool_of
from .node import absolute_url, dataset_name, is_dataset_url, node_dataset
from .plans import DatasetPlan, StreamPlans
from .sampling import Drawn, EpochSampler
from .shuffles import LOCAL, cache_window, shard_samples
from .sync import Client
from .tensors import Batch
from .transformed import transformed

T = TypeVar("T")
R = TypeVar("R")

log = logging.getLogger("shardfeed.client")


Preprocess = str | Transform
"""A transform that makes a batch of its outputs: the name of one the service runs, or one run here."""


def _preprocessing(transform: Any, output: str | None, decode: Any, fields: Sequence[str] | None) -> str:
    """The output of a dataset given ``transform``: a :data:`Preprocess` makes tensor batches of its
    outputs, refusing the options that would say otherwise; else ``output`` (default ``"samples"``)."""
    if not isinstance(transform, Preprocess):
        output = "samples" if output is None else output
        if output not in OUTPUTS:
            raise ValueError(f"output must be one of {', '.join(map(repr, OUTPUTS))}, not {output!r}")
        if output != "samples" and (decode or transform is not None):
            raise TypeError(f"decode and transform apply to sample dicts, not to output={output!r}: "
                            "decode the batch's views (shardfeed.client.tensors, docs/tensors.md)")
        return output
    named = repr(transform if isinstance(transform, str) else type(transform).__name__)
    if output not in (None, "tensors"):
        raise TypeError(f"transform {named} makes each batch a tensor Batch of its outputs: "
                        f"output={output!r} does not apply (leave it out)")
    if decode:
        raise TypeError(f"decode does not apply with transform {named}: it reads the samples' bytes")
    if fields is not None:
        raise TypeError(f"fields do not apply with transform {named}: it reads the fields it declares")
    return "tensors"


class _Source:
    """Where samples come from and how they are turned into values (shared by both datasets)."""

    def __init__(self, url: str | Sequence[str] | Client, dataset: str | None, fields: Sequence[str] | None,
                 decode: bool | Mapping[str, Decoder], transform: Callable[[dict], Any] | Preprocess | None,
                 continue_on_error: bool, output: str | None, client_options: dict):
        output = _preprocessing(transform, output, decode, fields)
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
        self.preprocess = transform if isinstance(transform, Preprocess) else None
        """The transform whose outputs a batch is (:data:`Preprocess`), or ``None``."""
        self.fields = list(fields) if fields is not None else None
        self.transform = None if self.preprocess is not None else transform
        """What each sample dict is mapped by (``output="samples"``), or ``None``."""
        self.continue_on_error = continue_on_error
        self.output = output
        if output == "arrow":
            from . import arrowshared  # noqa: F401  (tables through DataLoader workers, as names of segments)
        self.info = self.client.info(dataset)
        self.decoder = make_decoder(decode, self.info)  # MDS and LitData fields by the encodings the info names
        self.client.load_routing(dataset)
        if isinstance(transform, Transform):
            self.fields = fields_read(transform.fields, self.info["fields"])  # what it reads (the plan's)
        if isinstance(transform, str):
            served = {t["name"]: t for t in self.client.transforms()}
            if transform not in served:
                raise ValueError(f"the service runs no transform {transform!r} "
                                 f"(it runs: {', '.join(served) or 'none'})")
            self.fields = fields_read(served[transform]["fields"], self.info["fields"])  # what it reads (the plan's)

    @property
    def size(self) -> int:
        """Its samples (``len`` of a map-style dataset)."""
        return int(self.info["samples"])

    @property
    def label(self) -> str:
        """How errors name what it reads."""
        return repr(self.dataset)

    def sampler(self, batch_size: int, *, seed: int, shuffle: bool | str | None, drop_last: bool, rank: int,
                world_size: int, shard_window: int | None) -> EpochSampler:
        """The sampler of a reader of this dataset; ``shuffle=None``: the best mixing its cache affords."""
        if shuffle is None:  # the best mixing the service's cache affords
            shuffle = True if cache_window(self.info) >= int(self.info["shards"]) else "windows"
        locality = None
        if shard_window is None and shuffle in LOCAL:
            shard_window = cache_window(self.info)
        if shard_window is not None:
            locality = (shard_samples(self.info), shard_window)
        return EpochSampler(self.size, batch_size, seed=seed, shuffle=shuffle, drop_last=drop_last, rank=rank,
                            world_size=world_size, locality=locality)

    def plans(self) -> DatasetPlan:
        return DatasetPlan(self.client, self.dataset, self.fields)

    def check_collatable(self) -> None:
        """One dataset's samples always collate alike."""

    def warn_unplanned(self) -> None:
        _warn_unplanned(self.info)

    def fetch(self, indices: Sequence[int], drawn: tuple[int, int] = (0, 0)) -> Any:
        """The samples at ``indices`` in one request, in the dataset's ``output``; with a transform,
        its outputs, augmented as the ``(seed, epoch)`` the indices were ``drawn`` with say."""
        if self.preprocess is not None:
            return self.transformed(indices, *drawn)
        return OUTPUTS[self.output](self, indices)

    def transformed(self, indices: Sequence[int], seed: int, epoch: int) -> Batch:
        """A transform's outputs as one ``Batch``: the service runs the transform it names, or
        this process runs the one it was given, on the fields it reads (:mod:`.transformed`)."""
        shared = get_worker_info() is not None
        if isinstance(self.preprocess, str):
            return self.client.get_batch_tensors(self.dataset, indices, continue_on_error=self.continue_on_error,
                                                 shared=shared, transform=self.preprocess, seed=seed, epoch=epoch)
        samples = self.client.get_batch(self.dataset, indices, self.fields, continue_on_error=self.continue_on_error)
        return transformed(self.preprocess, samples, seed, epoch, continue_on_error=self.continue_on_error,
                           shared=shared)

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


class _Streams:
    """A mixture's streams as one source (:mod:`.mixing`): each stream's dataset (a ``_Source``),
    its pool, and a batch of global sample numbers fetched as one batch of each stream's parts.

    Every stream is read through one service: with ``url`` (a service), each stream names a
    dataset served there; without, each is a dataset URL read through the node's service."""

    preprocess = None
    """A mixture runs no transform (:attr:`_Source.preprocess`)."""

    def __init__(self, url: str | Sequence[str] | Client | None, streams: Sequence[Stream], epoch_size: int | None,
                 fields: Sequence[str] | None, decode: bool | Mapping[str, Decoder],
                 transform: Callable[[dict], Any] | None, continue_on_error: bool, output: str | None,
                 client_options: dict):
        if output == "arrow":
            raise TypeError("output='arrow' is not offered for a mixture: use 'samples' or 'tensors'")
        if isinstance(transform, Preprocess):
            raise TypeError("a transform's outputs (transform=a name or a Transform) are offered for one dataset, "
                            "not for a mixture")
        if not streams or not all(isinstance(s, Stream) for s in streams):
            raise TypeError("streams must be a non-empty list of shardfeed.client.mixing.Stream")
        self.streams = list(streams)
        self.sources = [self._source(url, stream, fields, decode, transform, continue_on_error, output, client_options)
                        for stream in streams]
        self.client = self.sources[0].client
        for stream, source in zip(streams, self.sources[1:]):
            if source.client.urls != self.client.urls:
                raise ValueError(f"stream {stream.label!r} is served by {source.client.urls}, the others by "
                                 f"{self.client.urls}: a mixture is read through one service")
        # By default a stream is called as its dataset is on the service, or by its URL's last segment.
        self.names = [stream.name or (stream.url if url is not None else _url_name(stream.url)) for stream in streams]
        for name in self.names:
            if not _STREAM_NAME.fullmatch(name):
                raise ValueError(f"stream name {name!r}: 1-64 of A-Z a-z 0-9 . _ : / - (give name=)")
        if len(set(self.names)) < len(self.names):
            twice = next(n for n in self.names if self.names.count(n) > 1)
            raise ValueError(f"two streams are named {twice!r}: give each its own name=")
        self.pools = [pool_of(stream.subset, int(source.info["samples"]), lambda source=source: _columns(source),
                              name) for stream, source, name in zip(streams, self.sources, self.names)]
        self.sizes = [len(p) if p is not None else int(src.info["samples"]) for p, src in zip(self.pools, self.sources)]
        self.offsets = offsets_of(self.sizes)
        self.epoch_size = epoch_size
        self.output = self.sources[0].output
        self.continue_on_error = continue_on_error

    @staticmethod
    def _source(url: Any, stream: Stream, fields: Sequence[str] | None, decode: Any, transform: Any,
                continue_on_error: bool, output: str | None, client_options: dict) -> _Source:
        fields = stream.fields if stream.fields is not None else fields
        try:
            if url is None:  # dataset URLs, through the node's service
                return _Source(stream.url, None, fields, decode, transform, continue_on_error, output, client_options)
            return _Source(url, stream.url, fields, decode, transform, continue_on_error, output, client_options)
        except (ShardfeedError, ValueError, TypeError) as err:  # an unknown dataset among them: say which
            raise (ValueError if isinstance(err, ShardfeedError) else type(err))(
                f"stream {stream.label!r}: {err}") from err

    def check_collatable(self) -> None:
        """``ValueError`` unless every stream has the same fields (``default_collate`` needs them)."""
        first = self._fields(0)
        for s in range(1, len(self.sources)):
            if self._fields(s) != first:
                raise ValueError(f"streams {self.names[0]!r} and {self.names[s]!r} have different fields "
                                 f"({sorted(first)} and {sorted(self._fields(s))}): default_collate needs the same; "
                                 "give fields=, a collate_fn of your own, or output='tensors'")

    def _fields(self, s: int) -> set[str]:
        source = self.sources[s]
        return set(source.fields if source.fields is not None else source.info.get("fields", []))

    def sampler(self, batch_size: int, *, seed: int, shuffle: bool | str | None, drop_last: bool, rank: int,
                world_size: int, shard_window: int | None) -> MixtureSampler:
        """The mixture's sampler, each stream sized as it says and localised to its share of the cache."""
        weighted = [s.weight is not None for s in self.streams]
        if any(weighted) and not all(weighted):
            bare = self.names[weighted.index(False)]
            raise ValueError(f"stream {bare!r} has no weight: give weights to every stream or to none")
        weights = [s.weight for s in self.streams] if all(weighted) else None
        counts = None if weights else [s.choose if s.choose is not None else round((1 if s.repeat is None else
                                                                                   s.repeat) * size)
                                       for s, size in zip(self.streams, self.sizes)]
        sizes = np.asarray(weights if weights else counts, dtype=np.float64)
        shares = sizes / max(sizes.sum(), 1e-300)
        byte_shares = self._byte_shares(shares)
        windows = [shard_window or cache_window(_share_of_cache(src.info, share))
                   for src, share in zip(self.sources, byte_shares)]
        if shuffle is None:  # the best mixing the service's cache affords, as for one dataset
            whole = all(w >= int(src.info["shards"]) for w, src in zip(windows, self.sources))
            shuffle = True if whole and shard_window is None else "windows"
        localities = [(max(1, round(shard_samples(src.info) * size / int(src.info["samples"]))), w)
                      if shuffle in LOCAL or (shuffle is True and shard_window is not None) else None
                      for src, size, w in zip(self.sources, self.sizes, windows)]
        signature = [[name, size, _digest(pool), s.weight, s.repeat, s.choose]
                     for name, size, pool, s in zip(self.names, self.sizes, self.pools, self.streams)]
        return MixtureSampler(self.sizes, batch_size, names=self.names, weights=weights, counts=counts,
                              epoch_size=self.epoch_size, seed=seed, shuffle=shuffle, drop_last=drop_last, rank=rank,
                              world_size=world_size, localities=localities, signature=signature)

    @property
    def size(self) -> int:
        """The global index space's size: every stream's pool (``ds[i]`` of a map-style mixture)."""
        return int(self.offsets[-1])

    @property
    def label(self) -> str:
        return f"the mixture of {', '.join(map(repr, self.names))}"

    def plans(self) -> StreamPlans:
        return StreamPlans(self.client, [s.dataset for s in self.sources], [s.fields for s in self.sources],
                           self.pools)

    def warn_unplanned(self) -> None:
        for source in self.sources:
            source.warn_unplanned()

    def _byte_shares(self, shares: np.ndarray) -> np.ndarray:
        """Each stream's share of the epoch's bytes, from its share of the samples."""
        mean = np.array([int(src.info["bytes"]) / max(1, int(src.info["samples"])) for src in self.sources])
        weight = shares * mean
        return weight / weight.sum() if weight.sum() else shares

    def fetch(self, numbers: Sequence[int], drawn: tuple[int, int] = (0, 0)) -> Any:
        """The samples at global ``numbers``, in that order, in the dataset's ``output`` (``drawn``
        does not apply: a mixture runs no transform)."""
        streams, positions = locate(self.offsets, np.asarray(numbers, dtype=np.int64))
        picks = []
        for s in np.unique(streams).tolist():
            where = np.flatnonzero(streams == s)
            pool = self.pools[s]
            indices = positions[where] if pool is None else pool[positions[where]]
            source = self.sources[s]
            picks.append(Pick(source.dataset, indices.tolist(), where.tolist(), source.fields, self.names[s]))
        if self.output == "tensors":
            return self.client.get_mixed_batch(picks, output="tensors", continue_on_error=self.continue_on_error,
                                               shared=get_worker_info() is not None).with_streams(streams)
        samples = self.client.get_mixed_batch(picks, continue_on_error=self.continue_on_error)
        for sample, s in zip(samples, streams.tolist()):
            sample["__stream__"] = self.names[s]
        return [self.sources[s].finish(x) for x, s in zip(samples, streams.tolist())]


_STREAM_NAME = re.compile(r"[A-Za-z0-9._:/-]{1,64}")


def _url_name(url: str) -> str:
    """A dataset URL's last segment, made a valid name (as the node's service names it, less its digest)."""
    return dataset_name(absolute_url(url)).rsplit("-", 1)[0]


def _columns(source: _Source) -> IndexColumns:
    client, dataset = source.client, source.dataset
    return IndexColumns(lambda column: client.index_column(dataset, column), client.index_columns(dataset))


def _share_of_cache(info: dict, share: float) -> dict:
    """A dataset's description as if its cache were ``share`` of the one reported."""
    cache = info.get("cache", {})
    return {**info, "cache": {**cache, "bytes": int(cache.get("bytes", 0) * share)}}


def _digest(pool: np.ndarray | None) -> str | None:
    """What names a stream's subset in a saved state (``None``: every sample)."""
    return None if pool is None else hashlib.sha1(pool.tobytes()).hexdigest()[:16]


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
        transform: one of three things (docs/transforms.md):

            - a ``str``: the name of a transform the service runs (``Client.transforms()``
              lists them); a DataLoader batch is one :class:`~.tensors.Batch` of its outputs,
              ``batch.outputs["image"]`` a ``(n, 3, 224, 224)`` tensor;
            - a :class:`shardfeed.transforms.Transform` (``shardfeed.transforms.load(spec)``):
              the same, run here, in the DataLoader workers, on the fields it declares, with
              outputs byte for byte the service's for the same ``(seed, epoch, index)``;
            - any other callable: applied to each sample dict after decoding; its result is the item.

            A transform's augmentation is seeded by ``(seed, epoch, index)``: with
            :class:`ShardfeedSampler` the seed and epoch of the order that drew each index
            (it yields :class:`~.sampling.Drawn` indices), else this dataset's ``seed`` and the
            epoch of :meth:`set_epoch`. With the first two, no ``fields``, ``decode`` or
            ``output`` other than ``"tensors"``.
        seed: a transform's seed where the indices do not carry one (any sampler but ``ShardfeedSampler``).
        continue_on_error: return ``{"__key__": None, "__index__": i, "__missing__": True}``
            (passed through ``transform``) for a sample the service cannot serve, instead of
            failing the batch; with a transform, a sample it fails on is missing too.
        output: ``"samples"`` (sample dicts of ``bytes``; the default), ``"tensors"`` or ``"arrow"``:
            a DataLoader batch is one :class:`~.tensors.Batch` or one ``pyarrow.Table``
            (:mod:`.arrow`; the default ``collate_fn`` hands it on as it is; a ``collate_fn`` of
            your own gets a list holding it), ``ds[i]`` a sample dict of uint8 views or a table
            of one row. No ``decode`` or per-sample ``transform`` with them.
        **client_options: passed to ``Client`` (token, timeout, backoff, ...).
    """

    def __init__(self, url: str | Sequence[str] | Client | None = None, dataset: str | None = None, *,
                 streams: Sequence[Stream] | None = None, epoch_size: int | None = None,
                 fields: Sequence[str] | None = None,
                 decode: bool | Mapping[str, Decoder] = False,
                 transform: Callable[[dict], Any] | Preprocess | None = None, seed: int = 0,
                 continue_on_error: bool = False, output: str | None = None, **client_options: Any):
        self.source = _source(url, dataset, streams, epoch_size, fields, decode, transform, continue_on_error,
                              output, client_options)
        self.planned = False
        """Whether a ``ShardfeedSampler`` orders it (and so tells the service its order)."""
        self._warned = False
        self.seed = seed
        self.epoch = 0
        """A transform's epoch where the indices do not carry one (:meth:`set_epoch`)."""

    def set_epoch(self, epoch: int) -> None:
        """The epoch a transform augments for, where the indices do not carry one (any sampler but
        ``ShardfeedSampler``; call it before the DataLoader's workers start, as they copy the dataset)."""
        self.epoch = epoch

    def __len__(self) -> int:
        if not self.planned and not self._warned and sys._getframe(1).f_globals.get("__name__", "").startswith(
                "torch.utils.data"):  # sized by another sampler: PyTorch's order, which the service cannot know
            self._warned = True
            self.source.warn_unplanned()
        return self.source.size

    def __getitem__(self, index: int) -> Any:
        n = len(self)
        if not -n <= index < n:
            raise IndexError(f"sample {index} is out of range: {self.source.label} has {n} samples")
        batch = self.source.fetch([index % n], self._drawn([index]))
        return batch if self.source.output == "arrow" else batch[0]

    def __getitems__(self, indices: list[int]) -> list:
        """The whole DataLoader batch in one request (PyTorch calls this when it exists); with
        ``output="tensors"`` or ``"arrow"`` (or a transform) a list holding its one batch, which
        ``default_collate`` unwraps."""
        batch = self.source.fetch(indices, self._drawn(indices))
        return batch if isinstance(batch, list) else [batch]

    def _drawn(self, indices: Sequence[int]) -> tuple[int, int]:
        """The ``(seed, epoch)`` a transform augments ``indices`` for: the one they carry
        (:class:`~.sampling.Drawn`, one for the batch), else the dataset's own."""
        if self.source.preprocess is None:
            return self.seed, self.epoch
        drawn = {(i.seed, i.epoch) if isinstance(i, Drawn) else (self.seed, self.epoch) for i in indices}
        if len(drawn) > 1:
            raise ValueError(f"one batch of indices drawn with several (seed, epoch): {sorted(drawn)[:4]}")
        return drawn.pop() if drawn else (self.seed, self.epoch)


class ShardfeedSampler(Sampler[int]):
    """``DistributedSampler`` for a :class:`ShardfeedDataset` that announces its order.

    The same contract as ``torch.utils.data.DistributedSampler``: each epoch (set with
    :meth:`set_epoch`) a permutation drawn from ``(seed, epoch)`` (the identity without
    ``shuffle``), padded by wrapping around to a multiple of ``num_replicas`` (trimmed
    instead with ``drop_last``); rank ``r`` takes every ``num_replicas``-th index from
    ``r``. Every sample is read once per epoch across the ranks. The permutation comes
    from :mod:`.sampling`, not ``torch.randperm``: the service runs that same code on the
    plan this sampler registers at the start of each epoch, so it reads ahead of the
    DataLoader and evicts the blocks read last. Its indices are :class:`~.sampling.Drawn`
    ints carrying ``seed`` and ``epoch``, which seed a dataset's transform.

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
        # DistributedSampler's stride. A mixture's epoch is its order, each stream by its weight.
        self.sampler = dataset.source.sampler(1, seed=seed, shuffle=bool(shuffle), drop_last=drop_last, rank=rank,
                                              world_size=world_size, shard_window=None)
        self.plan = dataset.source.plans() if plan else None

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    def __len__(self) -> int:
        return len(self.sampler)

    def __iter__(self) -> Iterator[int]:
        seed, epoch = self.sampler.seed, self.sampler.epoch
        order = [Drawn(i, seed, epoch) for i in self.sampler.rank_order().tolist()]
        if self.plan is None:
            yield from order
            return
        self.plan.register(self.sampler)
        reached = copy.copy(self.sampler)  # the sampler as far as the DataLoader got, for a plan lost meanwhile
        for k, index in enumerate(order):
            if k % 64 == 63:  # refresh() itself asks the service only every CHECK_EVERY seconds
                reached.consumed = k * self.sampler.world_size
                self.plan.refresh(reached)
            yield index


class ShardfeedIterableDataset(IterableDataset):
    """Iterable dataset of whole batches in a deterministic, resumable global order.

    Use with ``DataLoader(ds, batch_size=None, ...)`` (the dataset batches), best through
    :class:`ShardfeedLoader`, which records progress for :meth:`state_dict`.

    Args:
        url, dataset, fields, decode, transform, continue_on_error, output, **client_options:
            as for :class:`ShardfeedDataset` (with ``output="tensors"`` or a transform's name or
            ``Transform`` each item is a :class:`~.tensors.Batch`, with ``"arrow"`` a
            ``pyarrow.Table``; ``collate_fn`` does not apply). A transform augments each sample
            for ``seed`` and the epoch the sample is drawn in.
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

    def __init__(self, url: str | Sequence[str] | Client | None = None, dataset: str | None = None, *,
                 batch_size: int, streams: Sequence[Stream] | None = None, epoch_size: int | None = None,
                 seed: int = 0,
                 shuffle: bool | str | None = None, drop_last: bool = False, rank: int | None = None,
                 world_size: int | None = None, shard_window: int | None = None, plan: bool = True,
                 fields: Sequence[str] | None = None, decode: bool | Mapping[str, Decoder] = False,
                 transform: Callable[[dict], Any] | Preprocess | None = None,
                 collate_fn: Callable[[list], Any] | None = default_collate, prefetch: int | None = None,
                 continue_on_error: bool = False, output: str | None = None, **client_options: Any):
        if prefetch is not None and prefetch < 0:
            raise ValueError(f"prefetch must not be negative, not {prefetch}")
        self.source = _source(url, dataset, streams, epoch_size, fields, decode, transform, continue_on_error,
                              output, client_options)
        output = self.source.output
        if output != "samples" and collate_fn not in (default_collate, None):
            raise TypeError(f"collate_fn applies to lists of sample dicts, not to output={output!r}")
        if output == "samples" and collate_fn is default_collate:
            self.source.check_collatable()
        rank, world_size = _rank_and_world_size(rank, world_size)
        self.sampler = self.source.sampler(batch_size, seed=seed, shuffle=shuffle, drop_last=drop_last, rank=rank,
                                           world_size=world_size, shard_window=shard_window)
        self.collate_fn = collate_fn if output == "samples" else None
        self.prefetch = prefetch
        self.plan = self.source.plans() if plan else None

    def announce(self) -> None:
        """Register the rest of this rank's epoch as a plan (replacing the previous one)."""
        if self.plan is not None:
            self.plan.register(self.sampler)

    def __iter__(self) -> Iterator[Any]:
        worker = get_worker_info()
        if self.plan is not None and (worker is None or worker.id == 0):
            # The plan comes with a plain DataLoader too: once per rank and pass, from its
            # first worker, unless this pass's was announced before the workers started.
            self.plan.ensure(self.sampler)
        batches = self.sampler.batches(*((worker.id, worker.num_workers) if worker else (0, 1)))
        depth = self.prefetch if self.prefetch is not None else (2 if worker is None else 0)
        drawn = (self.sampler.seed, self.sampler.epoch)  # this pass's, whatever set_epoch does meanwhile
        return _prefetched(batches, lambda indices: self._fetch(indices, drawn), depth)

    def _fetch(self, indices: Any, drawn: tuple[int, int]) -> Any:
        samples = self.source.fetch(indices, drawn)
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

    def set_weights(self, weights: Sequence[float]) -> None:
        """A mixture's new weights, one per stream, from the step the run has reached to the end of
        the epoch and for the epochs after (a curriculum; :mod:`.mixing`), kept in :meth:`state_dict`.
        :class:`ShardfeedLoader` restarts its workers on the new order after the batch in hand
        (through a plain DataLoader, call it between epochs, before iterating)."""
        if not isinstance(self.sampler, MixtureSampler):
            raise TypeError("set_weights weighs the streams of a mixture (streams=): this dataset has one")
        self.sampler.set_weights(weights)

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
        sampler, plan = self.dataset.sampler, self.dataset.plan
        changed = True
        while changed:  # a mixture's new weights: workers started afresh on the new order
            self.dataset.announce()
            revision = sampler.revision
            changed = False
            for batch in DataLoader(self.dataset, batch_size=None, **self.options):
                self.dataset.advance(1)
                if plan is not None:
                    plan.refresh(sampler)
                yield batch
                if sampler.revision != revision:
                    changed = True
                    break
        if sampler.finished:
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


def _source(url: str | Sequence[str] | Client | None, dataset: str | None, streams: Sequence[Stream] | None,
            epoch_size: int | None, *options: Any) -> _Source | _Streams:
    """What a dataset reads: one dataset, or a mixture of ``streams``."""
    if streams is None:
        if url is None:
            raise TypeError("give a dataset URL, a service URL and a dataset name, or streams=")
        if epoch_size is not None:
            raise TypeError("epoch_size sizes a mixture's epoch (streams=), not one dataset's")
        return _Source(url, dataset, *options)
    if dataset is not None:
        raise TypeError("give a dataset or streams, not both (a stream names its own dataset)")
    return _Streams(url, streams, epoch_size, *options)


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
