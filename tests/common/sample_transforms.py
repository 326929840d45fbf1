"""Transforms for tests, importable by a service started with ``PYTHONPATH`` at ``tests/``
(``serve --transform NAME=common.sample_transforms:FACTORY``).

``digest`` reads a ``make_dataset`` sample's ``bin`` and ``cls``: its prepare output depends on its
version (``SAMPLE_TRANSFORM_VERSION`` in the environment, default 1), so an output prepared by an
old version, or from an old shard, differs from a fresh one. ``raising`` and ``hanging`` fail on
samples whose ``cls`` is 3.
"""

from __future__ import annotations

import os
import time

import numpy as np

from shardfeed.transforms.base import Output, Transform

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


class Raising(Digest):
    def prepare(self, sample):
        if sample["cls"] == FAILING_CLASS:
            raise ValueError("class 3 refused")
        return super().prepare(sample)


class Hanging(Digest):
    def prepare(self, sample):
        if sample["cls"] == FAILING_CLASS:
            time.sleep(3600)
        return super().prepare(sample)


def digest() -> Digest:
    return Digest(os.environ.get("SAMPLE_TRANSFORM_VERSION", "1"))


def raising() -> Raising:
    return Raising()


def hanging() -> Hanging:
    return Hanging()
