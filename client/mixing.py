"""Mixtures: several streams (datasets, or subsets of them) read as one, by weight (pure numpy).

A mixture is a way to make an epoch's order, nothing more (STYLE: "mixtures are a plan, not a
loader"). Each stream's *pool* (its dataset's samples, or the subset it keeps) takes a range of
one global index space, stream ``s`` at ``offsets[s]`` up to ``offsets[s + 1]``, and an epoch is
an array of global numbers. :class:`MixtureSampler` is an :class:`~.sampling.EpochSampler` over
that array, so ``consumed``, equal batches per rank, resuming at any world size or worker count
and the split over ranks and workers are the single dataset's, unchanged.

One epoch of ``N`` samples:

1. **Each stream's count, exact.** With weights (on every stream or none; they need not sum
   to 1), ``epoch_size`` samples (by default every pool's size, summed) are split in proportion
   to them, the remainders rounded by largest remainder (ties to the earlier stream). Without,
   each stream gives ``choose`` samples, or ``round(repeat * pool)`` (``repeat`` 1 by default),
   as Streaming defines them.
2. **Which samples.** A stream's samples in an epoch are passes over its pool, pass ``j`` in the
   order the shuffle mode draws from ``(seed, epoch, stream, j)`` (with the stream's own locality
   for ``windows`` and ``blocks``), the first ``count`` of them taken: ``repeat=2`` reads every
   sample twice, ``choose`` below the pool a random part of it.
3. **Where they go.** Stream ``s``'s ``k``-th sample is placed at ``(k + u) / count_s`` of the
   epoch, ``u`` uniform in ``[0, 1)`` drawn from ``(seed, epoch)``, and the epoch is the samples in
   the order of those places: every run of ``L`` consecutive samples (a batch) holds ``L * share_s``
   of stream ``s`` to within ``streams + 1`` samples (:func:`mix_bound`), far inside the binomial
   band of independent draws, while which stream comes next stays random.

**Weights that change mid-run** (a curriculum, :meth:`MixtureSampler.set_weights`) take effect at
the step boundary the run has reached: the rest of the epoch (its length unchanged) is placed
again, with counts from the new weights, each stream going on with its own samples where it was.
The changes are part of ``state_dict()``, so a resume after one reads what an uninterrupted run
would have; a new epoch starts with the weights last set.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .sampling import STATE_VERSION, EpochSampler, shuffle_mode
from .shuffles import SHUFFLES

MIX_SEED = 0x6D6978
"""Seeds the placement of streams in the epoch apart from the streams' own orders."""


Subset = Sequence[int] | np.ndarray | Sequence[str] | Callable[["IndexColumns"], Any]


@dataclass(frozen=True)
class Stream:
    """One dataset of a mixture, and its part of every epoch.

    Args:
        url: the name of a dataset served by the mixture's service (the dataset's ``url``
            argument); without one, the dataset's URL (``s3://``, ``file://`` or a path), read
            through the node's service as ``ShardfeedDataset("s3://...")`` is.
        weight: its proportion of the epoch's samples. Weights go on every stream or on none.
        repeat: epochs' worth of its samples per epoch (``0.5``: a random half of them each
            epoch; ``2``: each twice). Without weights or ``choose``, 1.
        choose: exactly this many of its samples per epoch.
        fields: its fields (default: the mixture's ``fields``, else all of its dataset's).
        subset: which samples of its dataset it holds: sample numbers (an array), keys (strings),
            or a predicate called once with the dataset's :class:`IndexColumns` that returns a
            boolean mask or sample numbers (``lambda index: index["bytes"] < 2**20``). A stream's
            progress counts what it keeps, so a filtered stream resumes exactly.
        name: what batches (``__stream__``, ``Batch.streams``), ``/v1/stats`` and the status page
            call it (default: its dataset's name).
    """

    url: str
    weight: float | None = None
    repeat: float | None = None
    choose: int | None = None
    fields: Sequence[str] | None = None
    subset: Subset | None = None
    name: str | None = None

    def __post_init__(self) -> None:
        given = [k for k in ("weight", "repeat", "choose") if getattr(self, k) is not None]
        if len(given) > 1:
            raise ValueError(f"stream {self.label!r}: give one of weight, repeat and choose, not {' and '.join(given)}")
        for key in ("weight", "repeat"):
            value = getattr(self, key)
            if value is not None and not (isinstance(value, numbers.Real) and math.isfinite(value) and value >= 0):
                raise ValueError(f"stream {self.label!r}: {key} must be a finite number >= 0, not {value!r}")
        if self.choose is not None and not (isinstance(self.choose, numbers.Integral) and self.choose >= 0):
            raise ValueError(f"stream {self.label!r}: choose must be an integer >= 0, not {self.choose!r}")

    @property
    def label(self) -> str:
        """How errors name it before its dataset is known."""
        return self.name or str(self.url)


class IndexColumns(Mapping):
    """A dataset's index columns, each fetched on first use (``GET /v1/datasets/{name}/index/{column}``):
    ``key`` (fixed-width bytes), ``shard``, ``bytes`` (all fields), ``bytes.<field>``; one value per sample."""

    def __init__(self, fetch: Callable[[str], np.ndarray], names: Sequence[str]):
        self._fetch = fetch
        self._names = list(names)
        self._held: dict[str, np.ndarray] = {}

    def __getitem__(self, column: str) -> np.ndarray:
        if column not in self._held:
            if column not in self._names:
                raise KeyError(f"no index column {column!r} (columns: {', '.join(self._names)})")
            self._held[column] = self._fetch(column)
        return self._held[column]

    def __iter__(self):
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


def pool_of(subset: Subset | None, samples: int, columns: Callable[[], IndexColumns], label: str) -> np.ndarray | None:
    """The sample numbers a stream keeps, ascending and distinct (``None``: all ``samples``).

    ``subset`` as :class:`Stream` takes it; ``ValueError`` naming the stream for numbers out of
    range, keys the dataset lacks, or a predicate's answer of the wrong shape."""
    if subset is None:
        return None
    if callable(subset):
        kept = np.asarray(subset(columns()))
        if kept.dtype == bool:
            if kept.shape != (samples,):
                raise ValueError(f"stream {label!r}: its predicate gave a mask of shape {kept.shape}, "
                                 f"not ({samples},)")
            return np.flatnonzero(kept)
        subset = kept
    array = np.asarray(subset)
    if array.size and array.dtype.kind in "USO":
        wanted = np.char.encode(array.astype(str), "utf-8") if array.dtype.kind != "S" else array
        keys = columns()["key"]
        order = np.argsort(keys)
        at = np.searchsorted(keys, wanted, sorter=order)
        found = (at < len(keys)) & (keys[order[np.minimum(at, len(keys) - 1)]] == wanted)
        if not found.all():
            missing = wanted[~found][0].decode("utf-8", "replace")
            raise ValueError(f"stream {label!r}: no sample with key {missing!r} ({int((~found).sum())} keys not found)")
        array = order[at]
    if array.size and array.dtype.kind not in "iu":
        raise ValueError(f"stream {label!r}: subset must be sample numbers, keys or a predicate, not {array.dtype}")
    array = np.unique(array.astype(np.int64, copy=False))
    if array.size and (array[0] < 0 or array[-1] >= samples):
        bad = int(array[0] if array[0] < 0 else array[-1])
        raise ValueError(f"stream {label!r}: subset has sample {bad}, outside its dataset's {samples}")
    return array


def offsets_of(pools: Sequence[int]) -> np.ndarray:
    """Where each stream's pool starts in the global index space, and where the last ends."""
    return np.concatenate([[0], np.cumsum(np.asarray(pools, dtype=np.int64))]).astype(np.int64)


def locate(offsets: np.ndarray, numbers: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per global number, its stream and its position in that stream's pool."""
    streams = np.searchsorted(offsets, numbers, side="right") - 1
    return streams, numbers - offsets[streams]


def split_counts(weights: Sequence[float], total: int) -> np.ndarray:
    """``total`` split in proportion to ``weights``, by largest remainder (ties: the earlier first)."""
    w = np.asarray(weights, dtype=np.float64)
    exact = w / w.sum() * total
    counts = np.floor(exact).astype(np.int64)
    short = total - int(counts.sum())
    counts[np.argsort(-(exact - counts), kind="stable")[:short]] += 1
    return counts


def check_weights(weights: Sequence[float], names: Sequence[str]) -> tuple[float, ...]:
    """``weights`` as a tuple, or ``ValueError`` naming the stream at fault."""
    if len(weights) != len(names):
        raise ValueError(f"{len(weights)} weights for {len(names)} streams ({', '.join(names)})")
    for name, weight in zip(names, weights):
        if not (isinstance(weight, numbers.Real) and math.isfinite(weight) and weight >= 0):
            raise ValueError(f"stream {name!r}: weight must be a finite number >= 0, not {weight!r}")
    if not sum(weights) > 0:
        raise ValueError(f"the weights of streams {', '.join(names)} are all zero: no stream would be read")
    return tuple(float(w) for w in weights)


def mix_bound(streams: int) -> int:
    """Samples by which any run of a mixture's epoch may hold more or fewer of a stream than its
    share: each other stream's jitter moves a place by under one sample (``tests/client/test_mixing.py``
    holds it over hundreds of random mixtures)."""
    return streams + 1


def placed(counts: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Which stream each position of ``counts.sum()`` takes: stream ``s``'s ``k``-th sample at
    ``(k + u) / counts[s]`` (see the module's step 3)."""
    places = [(np.arange(c) + rng.random(c)) / c for c in counts.tolist()]
    streams = np.repeat(np.arange(len(counts)), counts)
    # Each stream's places ascend already: a stable sort merges runs, near-linear time.
    return streams[np.argsort(np.concatenate(places), kind="stable")] if len(streams) else streams


class MixtureSampler(EpochSampler):
    """The epoch order of a mixture, as global numbers (see the module), and progress through it.

    ``pools``: each stream's pool size; ``weights`` or ``counts`` (per epoch, from ``repeat`` and
    ``choose``); ``localities``: each stream's ``(block, window)`` for the locality modes.
    """

    def __init__(self, pools: Sequence[int], batch_size: int, *, names: Sequence[str],
                 weights: Sequence[float] | None = None, counts: Sequence[int] | None = None,
                 epoch_size: int | None = None, seed: int = 0, shuffle: bool | str = True, drop_last: bool = False,
                 rank: int = 0, world_size: int = 1, localities: Sequence[tuple[int, int] | None] | None = None,
                 signature: Sequence[Any] = ()):
        self.names = list(names)
        self.pools = np.asarray(pools, dtype=np.int64)
        for name, pool in zip(self.names, self.pools.tolist()):
            if pool < 1:
                raise ValueError(f"stream {name!r} holds no samples")
        self.offsets = offsets_of(self.pools)
        self.localities = list(localities) if localities is not None else [None] * len(self.names)
        self.modes = [shuffle_mode(shuffle, loc) for loc in self.localities]
        if weights is not None:
            self.weights: tuple[float, ...] | None = check_weights(weights, self.names)
            if epoch_size is not None and epoch_size < 1:
                raise ValueError(f"epoch_size must be at least 1, not {epoch_size}")
            total = int(epoch_size) if epoch_size is not None else int(self.pools.sum())
            self.fixed = None
        else:
            if epoch_size is not None:
                raise ValueError("epoch_size splits the epoch by weight: give the streams weights, "
                                 "or size each with repeat or choose")
            self.weights = None
            self.fixed = np.asarray(counts, dtype=np.int64)
            total = int(self.fixed.sum())
            if total < 1:
                raise ValueError(f"streams {', '.join(self.names)} give no samples per epoch")
        super().__init__(total, batch_size, seed=seed, shuffle=False, drop_last=drop_last, rank=rank,
                         world_size=world_size)
        self.shuffle = shuffle
        self.changes: list[tuple[int, tuple[float, ...]]] = []
        """This epoch's weight changes: (position, weights) from that position on."""
        self.signature = list(signature)
        """What must match for a saved state to mean the same order (the streams, their pools)."""
        self._mix: tuple[Any, np.ndarray] | None = None

    # -- the order ------------------------------------------------------------------------------
    def segments(self) -> list[tuple[int, np.ndarray]]:
        """This epoch's (start, counts over the rest of the epoch) from each weight change on."""
        if self.weights is None:
            return [(0, self.fixed)]
        return [(start, split_counts(weights, self.samples - start))
                for start, weights in [(0, self.weights), *self.changes]]

    def order(self) -> np.ndarray:
        if self._mix is None or self._mix[0] != self.revision:
            self._mix = (self.revision, self._placed_order())
        return self._mix[1]

    def _placed_order(self) -> np.ndarray:
        streams = np.empty(self.samples, dtype=np.int64)
        segments = self.segments()
        for k, (start, counts) in enumerate(segments):
            end = segments[k + 1][0] if k + 1 < len(segments) else self.samples
            rng = np.random.default_rng([self.seed, self.epoch, MIX_SEED, start])
            streams[start:end] = placed(counts, rng)[:end - start]
        order = np.empty(self.samples, dtype=np.int64)
        by_stream = np.argsort(streams, kind="stable")
        ends = np.cumsum(np.bincount(streams, minlength=len(self.names)))
        for s, (begin, end) in enumerate(zip([0, *ends[:-1].tolist()], ends.tolist())):
            order[by_stream[begin:end]] = self.offsets[s] + self.stream_order(s, end - begin)
        return order

    def stream_order(self, stream: int, length: int) -> np.ndarray:
        """The first ``length`` pool positions stream ``stream`` gives this epoch (see step 2)."""
        pool = int(self.pools[stream])
        passes = [SHUFFLES[self.modes[stream]](pool, np.random.default_rng([self.seed, self.epoch, stream, j]),
                                               self.localities[stream])
                  for j in range(-(-length // pool))]
        return np.concatenate(passes)[:length] if passes else np.zeros(0, np.int64)

    def shares(self) -> np.ndarray:
        """Each stream's share of the epoch's samples (under the weights in effect now)."""
        counts = self.segments()[-1][1]
        return counts / max(1, counts.sum())

    # -- the weights ----------------------------------------------------------------------------
    def set_weights(self, weights: Sequence[float]) -> None:
        """New weights from the step the run has reached (``consumed``) to the end of the epoch,
        and for the epochs after it."""
        if self.weights is None:
            raise ValueError("set_weights needs a mixture by weight: these streams are sized by repeat or choose")
        weights = check_weights(weights, self.names)
        if self.consumed == 0:
            self.weights, self.changes = weights, []
            return
        self.changes = [c for c in self.changes if c[0] < self.consumed] + [(self.consumed, weights)]

    @property
    def revision(self) -> tuple:
        """What the rest of the epoch's order depends on beyond ``consumed``: a reader whose copy of
        the sampler was made before it changed (a DataLoader worker's) reads the old order."""
        return self.epoch, self.weights, tuple(self.changes)

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch and self.changes:
            self.weights, self.changes = self.changes[-1][1], []
        super().set_epoch(epoch)

    # -- progress -------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"version": STATE_VERSION, "kind": "mixture", "epoch": self.epoch, "consumed": self.consumed,
                "weights": list(self.weights) if self.weights is not None else None,
                "changes": [[start, list(w)] for start, w in self.changes], "seed": self.seed,
                "samples": self.samples, "shuffle": self.shuffle, "streams": self.signature}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not isinstance(state, dict) or state.get("kind") != "mixture":
            raise ValueError("not a shardfeed mixture state (a single dataset's, or none)")
        epoch, consumed = self.progress(state, ("seed", "samples", "shuffle", "streams"), "mixture")
        try:
            weights = state["weights"]
            changes = [(int(start), tuple(float(x) for x in w)) for start, w in state["changes"]]
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"not a shardfeed mixture state (bad or missing {exc})") from None
        if (weights is None) != (self.weights is None):
            raise ValueError("mixture state and this mixture disagree on whether the streams have weights")
        weights = self.weights if weights is None else check_weights(weights, self.names)
        self.epoch, self.consumed, self.changes, self.weights = epoch, consumed, changes, weights
