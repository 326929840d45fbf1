"""Deterministic, resumable sampling for the iterable dataset (pure numpy, no torch).

One epoch is defined globally, the same in every process:

1. the epoch order: a permutation of all samples drawn from ``(seed, epoch)``;
2. the remaining stream: the order from ``consumed`` on, padded by wrapping around to
   the start of the order (or trimmed, with ``drop_last``) to a whole number of
   *steps* of ``batch_size * world_size`` samples, so every rank gets the same number
   of full batches and no rank waits at the end of an epoch for a batch that never comes;
3. global batch ``j`` is ``stream[j*B:(j+1)*B]``; it goes to rank ``j % world_size``, and
   within a rank the rank's ``k``-th batch goes to DataLoader worker ``k % num_workers``
   (the order in which a DataLoader collects batches from its workers).

After ``s`` training steps, every rank has consumed its first ``s`` batches, which are
exactly the first ``s * batch_size * world_size`` samples of the stream. Progress is
therefore one number, ``consumed``, that does not depend on ranks or workers: resuming
from it with any world size or worker count yields exactly the samples not yet seen.
(Samples repeated as padding at the end of an epoch are the one exception: padding is
recomputed for the new step size.)

Shard locality (``locality=(block, window)``, shuffle modes ``blocks`` and ``windows`` in
:mod:`.shuffles`): instead of a uniform permutation, keep the samples of about ``window``
shards in play at a time, so a service whose cache is smaller than the dataset reads each
shard once; the price is a less random order (see each mode's trade-off).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from .shuffles import LOCAL, SHUFFLES

STATE_VERSION = 1


def epoch_order(samples: int, *, seed: int, epoch: int, shuffle: bool | str = True,
                locality: tuple[int, int] | None = None) -> np.ndarray:
    """The global order of one epoch: ``samples`` indices, a pure function of the arguments.

    ``shuffle`` is a mode of :mod:`.shuffles`, or ``True`` (``blocks`` with ``locality``,
    else ``uniform``) or ``False`` (``none``).
    """
    mode = shuffle_mode(shuffle, locality)
    return SHUFFLES[mode](samples, np.random.default_rng([seed, epoch]), locality)


def shuffle_mode(shuffle: bool | str, locality: tuple[int, int] | None) -> str:
    """The shuffle mode's name (``ValueError`` for an unknown one or missing locality)."""
    if isinstance(shuffle, bool):
        return ("blocks" if locality else "uniform") if shuffle else "none"
    if shuffle not in SHUFFLES:
        raise ValueError(f"unknown shuffle mode {shuffle!r} (modes: {', '.join(SHUFFLES)})")
    if shuffle in LOCAL and not locality:
        raise ValueError(f"shuffle mode {shuffle!r} needs locality=(block, window)")
    return shuffle


class Drawn(int):
    """A sample's index as an epoch's order drew it, carrying the order's ``seed`` and ``epoch``
    (what seeds its augmentation: :func:`shardfeed.transforms.rng_for`). ``ShardfeedSampler``
    yields these, so a map-style dataset in a DataLoader worker knows them; anywhere else it is
    the ``int`` it equals. Pickles with them (a DataLoader sends its workers lists of indices)."""

    seed: int
    epoch: int

    def __new__(cls, index: int, seed: int, epoch: int) -> Drawn:
        drawn = super().__new__(cls, index)
        drawn.seed, drawn.epoch = seed, epoch
        return drawn

    def __reduce__(self) -> tuple:
        return Drawn, (int(self), self.seed, self.epoch)


class EpochSampler:
    """The batches of one rank for the current epoch, and the global progress through it.

    ``batches(worker, num_workers)`` is what one DataLoader worker of this rank yields;
    ``advance(n)`` records that the training loop consumed ``n`` more batches of this rank
    (all ranks are assumed to take the same number of steps). ``state_dict()`` and
    ``load_state_dict()`` save and restore ``(epoch, consumed)``.
    """

    def __init__(self, samples: int, batch_size: int, *, seed: int = 0, shuffle: bool | str = True,
                 drop_last: bool = False, rank: int = 0, world_size: int = 1,
                 locality: tuple[int, int] | None = None):
        if samples < 1:
            raise ValueError(f"the dataset has no samples ({samples})")
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, not {batch_size}")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size), got rank={rank}, world_size={world_size}")
        if locality is not None and (len(locality) != 2 or locality[0] < 1 or locality[1] < 1):
            raise ValueError(f"locality block and window must be at least 1, got {locality}")
        shuffle_mode(shuffle, locality)
        self.samples = samples
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.rank = rank
        self.world_size = world_size
        self.locality = tuple(locality) if locality is not None and shuffle else None
        self.epoch = 0
        self.consumed = 0
        self._order: tuple[int, np.ndarray] | None = None  # (epoch, order) cache

    def set_epoch(self, epoch: int) -> None:
        """Move to ``epoch`` from its start; a no-op if already in it (so a resumed run
        that calls ``set_epoch`` at the top of each epoch keeps its place)."""
        if epoch != self.epoch:
            self.epoch = epoch
            self.consumed = 0

    @property
    def revision(self) -> tuple:
        """What the rest of the epoch's order depends on beyond ``consumed`` (a mixture's weights
        may change mid-epoch: ``mixing.MixtureSampler``)."""
        return (self.epoch,)

    def order(self) -> np.ndarray:
        """The global order of the current epoch."""
        if self._order is None or self._order[0] != self.epoch:
            self._order = (self.epoch, epoch_order(self.samples, seed=self.seed, epoch=self.epoch,
                                                   shuffle=self.shuffle, locality=self.locality))
        return self._order[1]

    @property
    def step(self) -> int:
        """Samples consumed by one training step of all ranks."""
        return self.batch_size * self.world_size

    def _stream_length(self) -> int:
        left = self.samples - self.consumed
        steps = left // self.step if self.drop_last else -(-left // self.step)
        return steps * self.step

    def __len__(self) -> int:
        """Batches this rank still gets in the current epoch."""
        return self._stream_length() // self.step

    def stream(self) -> np.ndarray:
        """The rest of the epoch for all ranks, padded or trimmed to whole steps."""
        order = self.order()
        length = self._stream_length()
        rest = order[self.consumed:self.consumed + length]
        if len(rest) < length:  # wrap around: repeat samples from the start of the order
            rest = np.concatenate([rest, np.resize(order, length - len(rest))])
        return rest

    def batches(self, worker: int = 0, num_workers: int = 1) -> Iterator[np.ndarray]:
        """The index batches of this rank that DataLoader worker ``worker`` yields, in order."""
        if not 0 <= worker < num_workers:
            raise ValueError(f"worker must be in [0, num_workers), got {worker}, {num_workers}")
        stream = self.stream()
        bs = self.batch_size
        for j in range(self.rank + self.world_size * worker, len(stream) // bs,
                       self.world_size * num_workers):
            yield stream[j * bs:(j + 1) * bs]

    def rank_order(self) -> np.ndarray:
        """Every sample this rank still reads this epoch, in the order its batches come
        (what a plan announces to the service, see ``ShardfeedSampler``)."""
        batches = list(self.batches())
        return np.concatenate(batches) if batches else np.zeros(0, np.int64)

    def plan(self) -> dict[str, Any]:
        """The plan (``POST /v1/datasets/{name}/plans``) of this rank's rest of the epoch:
        the service computes ``rank_order()`` from it with this same code."""
        return {"kind": "sampler", "seed": self.seed, "epoch": self.epoch, "rank": self.rank,
                "world_size": self.world_size, "batch_size": self.batch_size, "shuffle": self.shuffle,
                "locality": list(self.locality) if self.locality else None, "drop_last": self.drop_last,
                "consumed": self.consumed}

    def advance(self, batches: int = 1) -> None:
        """Record that every rank's training loop took ``batches`` more batches."""
        self.consumed = min(self.samples, self.consumed + batches * self.step)

    @property
    def finished(self) -> bool:
        """Whether the current epoch has no batches left."""
        return len(self) == 0

    def state_dict(self) -> dict[str, Any]:
        """Progress through the epoch, plus what must match for it to mean the same thing."""
        return {"version": STATE_VERSION, "epoch": self.epoch, "consumed": self.consumed,
                "seed": self.seed, "samples": self.samples, "shuffle": self.shuffle,
                "locality": list(self.locality) if self.locality else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from ``state_dict()`` output (batch size, ranks and workers may differ)."""
        self.epoch, self.consumed = self.progress(state, ("seed", "samples", "shuffle", "locality"), "sampler")

    def progress(self, state: dict[str, Any], matching: tuple[str, ...], kind: str) -> tuple[int, int]:
        """``state``'s ``(epoch, consumed)``, once its version and ``matching`` keys say it describes
        this order (``ValueError`` naming what differs); ``kind`` names the state in errors."""
        try:
            version, epoch, consumed = state["version"], int(state["epoch"]), int(state["consumed"])
            expected = {k: state[k] for k in matching}
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"not a shardfeed {kind} state (bad or missing {exc})") from None
        if version != STATE_VERSION:
            raise ValueError(f"{kind} state version {version} is not supported (expected {STATE_VERSION})")
        mine = self.state_dict()
        for key, value in expected.items():
            if value != mine[key]:
                raise ValueError(f"{kind} state was saved with {key}={value!r}, but this one "
                                 f"has {key}={mine[key]!r}: the order would differ")
        if not 0 <= consumed <= self.samples:
            raise ValueError(f"{kind} state has consumed={consumed}, outside [0, {self.samples}]")
        return epoch, consumed
