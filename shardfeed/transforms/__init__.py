"""Preprocessing transforms: what the service runs on a dataset's samples, and a client may run too.

A transform is a :class:`Transform` an operator names (``serve --transform NAME=package.module:factory``);
clients ask for it by name. Two stages, as tf.data, Cachew and FFCV split them:

    prepare(sample) -> arrays            deterministic (decode, resize, tokenise): the service caches it
    augment(arrays, rng) -> arrays       random, drawn from ``rng_for(seed, epoch, index)``

so the same ``(seed, epoch, index)`` gives the same tensors wherever it runs (:func:`apply`). The stock
image transforms are in :mod:`.image`.
"""

from shardfeed.transforms.base import (
    SHAPE, Output, Transform, TransformError, apply, checked, describe, fields_read, load, output_columns, pack, rng_for,
    unpack,
)

__all__ = ["SHAPE", "Output", "Transform", "TransformError", "apply", "checked", "describe", "fields_read", "load",
           "output_columns", "pack", "rng_for", "unpack"]
