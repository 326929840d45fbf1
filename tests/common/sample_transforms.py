"""Transforms for the tests, each a factory a spec names (``common.sample_transforms:BytesShifted``):
one that works, and ones that misbehave in each way a sample can make a pool process misbehave.

Each reads the field ``x`` and misbehaves only on the samples whose ``x`` asks for it, so that in one
run the other samples show they are untouched. What they do is chosen by the sample and not by the
environment: the pool's processes are forked by a fork server that keeps the environment it started with.

The service's tests (``serve --transform NAME=common.sample_transforms:FACTORY``, ``PYTHONPATH`` at
``tests/``) use ``digest`` and its failing kin, which read a ``make_dataset`` sample's ``bin`` and
``cls``: ``digest``'s prepare output depends on its version (``SAMPLE_TRANSFORM_VERSION`` in the
service's environment, default 1: its fork server starts with the service), so an output prepared
by an old version, or from an old shard, differs from a fresh one. ``digest_raising`` and
``digest_hanging`` fail on samples whose ``cls`` is 3.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np

from shardfeed.transforms import Output, Transform


class BytesShifted(Transform):
    """``x``'s bytes as a uint8 array, each shifted by one random number from the sample's generator."""

    version = "1"
    fields = ("x",)
    outputs = {"y": Output("uint8", (None,)), "shift": Output("int64", ())}

    def prepare(self, sample):
        return {"y": np.frombuffer(sample["x"], np.uint8)}

    def augment(self, arrays, rng):
        shift = rng.integers(0, 256)
        return {"y": arrays["y"] + np.uint8(shift), "shift": np.int64(shift)}


class Raising(BytesShifted):
    """``x == b"bad"``: prepare raises; ``x == b"worse"``: augment raises."""

    def prepare(self, sample):
        if sample["x"] == b"bad":
            raise ValueError("this sample is bad")
        return {**super().prepare(sample), "worse": np.array(sample["x"] == b"worse")}

    def augment(self, arrays, rng):
        if arrays.pop("worse"):
            raise KeyError("worse")
        return super().augment(arrays, rng)


class Hanging(BytesShifted):
    """``x == b"hang"``: prepare sleeps a minute (the pool's deadline is far shorter)."""

    def prepare(self, sample):
        if sample["x"] == b"hang":
            time.sleep(60)
        return super().prepare(sample)


class Exiting(BytesShifted):
    """``x == b"exit"``: the process exits at once, every time (``os._exit``: no cleanup, as a crash)."""

    def prepare(self, sample):
        if sample["x"] == b"exit":
            os._exit(3)
        return super().prepare(sample)


class DyingOnce(BytesShifted):
    """``x == b"once:" + a file's path``: the first process to see it creates the file and exits; the
    next one runs."""

    def prepare(self, sample):
        if sample["x"].startswith(b"once:"):
            flag = Path(sample["x"][5:].decode())
            if not flag.exists():
                flag.touch()
                os._exit(4)
        return super().prepare(sample)


class WrongDtype(BytesShifted):
    """Declares ``y`` uint8, returns it int32."""

    def augment(self, arrays, rng):
        return {**super().augment(arrays, rng), "y": arrays["y"].astype(np.int32)}


def failing_factory() -> Transform:
    raise RuntimeError("no model file here")


FAILING_CLASS = b"3"
"""The ``cls`` of the samples ``raising`` and ``hanging`` fail on."""


class Digest(Transform):
    """The first 64 bytes of ``bin`` plus the version (varying length), its class, and 4 random floats."""

    fields = ("bin", "cls")
    outputs = {"head": Output("uint8", (None,)), "label": Output("int64", ()), "noise": Output("float32", (4,))}

    def __init__(self, version: str = "1"):
        self.version = version

    def prepare(self, sample):
        head = np.frombuffer(sample["bin"], np.uint8)[:64]
        return {"head": (head + np.uint8(int(self.version))).astype(np.uint8),
                "label": np.array(int(sample["cls"]), np.int64)}

    def augment(self, prepared, rng):
        head = prepared["head"][::-1] if rng.random() < 0.5 else prepared["head"]
        return {"head": np.ascontiguousarray(head), "label": prepared["label"],
                "noise": rng.random(4, dtype=np.float32)}


class DigestRaising(Digest):
    def prepare(self, sample):
        if sample["cls"] == FAILING_CLASS:
            raise ValueError("class 3 refused")
        return super().prepare(sample)


class DigestHanging(Digest):
    def prepare(self, sample):
        if sample["cls"] == FAILING_CLASS:
            time.sleep(3600)
        return super().prepare(sample)


class DigestOfEither(Digest):
    """``digest`` of the bytes in ``raw``, or in ``bin`` where a sample has no ``raw``: a transform that
    declares each field its input may be in, as the stock image transforms do, not all in every dataset."""

    fields = ("raw", "bin", "cls")

    def prepare(self, sample):
        return super().prepare({"bin": sample["raw"] if "raw" in sample else sample["bin"], "cls": sample["cls"]})


def digest() -> Digest:
    return Digest(os.environ.get("SAMPLE_TRANSFORM_VERSION", "1"))


def digest_of_either() -> DigestOfEither:
    return DigestOfEither()


def digest_raising() -> DigestRaising:
    return DigestRaising()


def digest_hanging() -> DigestHanging:
    return DigestHanging()


SPECS = {"bytes_shifted": f"{__name__}:BytesShifted", "raising": f"{__name__}:Raising",
         "hanging": f"{__name__}:Hanging", "exiting": f"{__name__}:Exiting", "dying_once": f"{__name__}:DyingOnce",
         "wrong_dtype": f"{__name__}:WrongDtype"}
"""Every transform here that loads, by a served name of its own (a class is its own factory)."""
