"""The transform interface, its seeding, its output check and the prepared arrays' encoding.

A factory (``package.module:factory``, called with no arguments) returns a :class:`Transform`:

    class Resized(Transform):
        version = "2"                                   # change it when prepare's output changes
        fields = ("jpg", "cls")                         # what prepare reads (None: every field)
        outputs = {"image": Output("uint8", (3, 224, 224)), "label": Output("int64", ())}

        def prepare(self, sample): ...                  # {field: bytes} -> {name: array}, deterministic
        def augment(self, arrays, rng): ...             # -> the outputs, random from rng only

Everything here is pure: the service's pool, its prepared cache and the client's DataLoader workers
call the same functions, so their tensors are byte for byte the same.
"""

from __future__ import annotations

import importlib
import json
import re
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

NAME = re.compile(r"^[a-z0-9_]{1,64}$")
"""What an output's name may be (a field of the answer, beside ``__key__`` and ``__index__``)."""
_M64 = (1 << 64) - 1


class TransformError(ValueError):
    """A transform that cannot be loaded, or whose output is not what it declares."""


@dataclass(frozen=True)
class Output:
    """One output array of a transform: its dtype (a numpy name: ``uint8``, ``float32``...) and shape,
    ``None`` for a dimension that varies from sample to sample."""

    dtype: str
    shape: tuple[int | None, ...] = ()

    def __post_init__(self) -> None:
        try:
            dtype = np.dtype(self.dtype)
        except TypeError as err:
            raise TransformError(f"output dtype {self.dtype!r} is not a numpy dtype") from err
        if dtype.hasobject or dtype.fields is not None or dtype.subdtype is not None:
            raise TransformError(f"output dtype {self.dtype!r} is not a plain numeric dtype")
        if any(d is not None and (not isinstance(d, int) or d < 0) for d in self.shape):
            raise TransformError(f"output shape {self.shape!r}: dimensions are sizes or None")
        object.__setattr__(self, "dtype", dtype.name)
        object.__setattr__(self, "shape", tuple(self.shape))

    @property
    def fixed(self) -> bool:
        """Whether every sample's array has this one shape."""
        return None not in self.shape

    def describe(self) -> dict:
        return {"dtype": self.dtype, "shape": list(self.shape)}


class Transform:
    """A dataset's preprocessing: ``prepare`` (deterministic, cached by the service) then ``augment``
    (random, from the ``rng`` it is given). Subclass it; see the module's docstring."""

    version: str = "1"
    """Part of the prepared cache's key: change it whenever ``prepare``'s output would change."""
    fields: tuple[str, ...] | None = None
    """The sample's fields ``prepare`` reads; ``None``: every field."""
    outputs: Mapping[str, Output] = {}
    """What ``augment`` returns, by name."""

    def prepare(self, sample: Mapping[str, bytes]) -> dict[str, np.ndarray]:
        """A sample's fields (name -> bytes) as arrays; deterministic. Raise to fail the sample."""
        raise NotImplementedError

    def augment(self, prepared: dict[str, np.ndarray], rng: np.random.Generator) -> dict[str, np.ndarray]:
        """The outputs from ``prepare``'s arrays, drawing only from ``rng``. Default: them unchanged."""
        return prepared


SHAPE = ".shape"
"""The suffix of the wire's column of a varying output's shape (its dims, int64 little-endian)."""


def output_columns(outputs: Mapping[str, Output]) -> list[str]:
    """The columns of a transformed answer after ``__key__`` and ``__index__``, in order: each declared
    output, and right after one whose shape varies, its ``<name>.shape``."""
    return [c for name, output in outputs.items() for c in ([name] if output.fixed else [name, name + SHAPE])]


def rng_for(seed: int, epoch: int, index: int) -> np.random.Generator:
    """The generator ``augment`` draws from for sample ``index`` in ``epoch`` of a run seeded ``seed``:
    the same wherever and whenever it is made (PCG64, seeded by all three)."""
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence(
        [int(seed) & _M64, int(epoch) & _M64, int(index) & _M64])))


def load(spec: str) -> Transform:
    """The transform ``package.module:factory`` makes (the factory called with no arguments), checked."""
    module_name, colon, attribute = spec.partition(":")
    if not colon or not module_name or not attribute:
        raise TransformError(f"transform {spec!r}: expected package.module:factory")
    try:
        factory = getattr(importlib.import_module(module_name), attribute)
    except ImportError as err:
        raise TransformError(f"transform {spec!r}: cannot import {module_name!r} ({err})") from err
    except AttributeError:
        raise TransformError(f"transform {spec!r}: {module_name!r} has no {attribute!r}") from None
    transform = factory() if not isinstance(factory, Transform) else factory
    if not isinstance(transform, Transform):
        raise TransformError(f"transform {spec!r}: the factory returned {type(transform).__name__}, "
                             "not a shardfeed.transforms.Transform")
    if not transform.outputs:
        raise TransformError(f"transform {spec!r} declares no outputs")
    for name, output in transform.outputs.items():
        if not NAME.match(name):
            raise TransformError(f"transform {spec!r}: output name {name!r} is not [a-z0-9_]{{1,64}}")
        if not isinstance(output, Output):
            raise TransformError(f"transform {spec!r}: output {name!r} is not an Output")
    return transform


def describe(transform: Transform) -> dict:
    """What ``GET /v1/transforms`` says of it (and a client checks an answer against)."""
    return {"version": str(transform.version), "fields": None if transform.fields is None else list(transform.fields),
            "outputs": {name: output.describe() for name, output in transform.outputs.items()}}


def fields_read(declared: Sequence[str] | None, held: Sequence[str]) -> list[str] | None:
    """The fields a transform that declares ``declared`` reads of a dataset whose samples hold
    ``held``: the declared ones the dataset has, in declared order (a transform may declare every
    field its input may come in, as the stock image transforms declare ``jpg``, ``jpeg``, ``png``
    and ``webp``); all of them where it has none, so that the read names what is missing. ``None``
    (every field) stays ``None``."""
    if declared is None:
        return None
    return [field for field in declared if field in held] or list(declared)


def checked(transform: Transform, arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``augment``'s ``arrays`` as the declared outputs: in their order, C-contiguous and little-endian,
    each of its dtype and shape; a ``TransformError`` naming what differs."""
    missing = [name for name in transform.outputs if name not in arrays]
    if missing:
        raise TransformError(f"the transform returned no {', '.join(map(repr, missing))}")
    out = {}
    for name, output in transform.outputs.items():
        array = np.asarray(arrays[name])
        # Either byte order passes: the array is made little-endian below.
        if array.dtype.newbyteorder("<") != np.dtype(output.dtype).newbyteorder("<"):
            raise TransformError(f"output {name!r} is {array.dtype.name}, declared {output.dtype}")
        if array.ndim != len(output.shape) or any(d is not None and d != n for d, n in zip(output.shape, array.shape)):
            raise TransformError(f"output {name!r} has shape {tuple(array.shape)}, declared {output.shape}")
        out[name] = _little(array)
    return out


def apply(transform: Transform, prepared: dict[str, np.ndarray], seed: int, epoch: int, index: int) -> dict[str, np.ndarray]:
    """The outputs of sample ``index`` in ``epoch`` from its prepared arrays: ``augment``ed with its
    own generator, checked. The service and a client both call this."""
    own = {name: array.copy() for name, array in prepared.items()}  # augment may write in place
    return checked(transform, transform.augment(own, rng_for(seed, epoch, index)))


def _little(array: np.ndarray) -> np.ndarray:
    """``array`` C-contiguous and little-endian (itself when it is: no copy), 0-d kept 0-d."""
    return array.astype(array.dtype.newbyteorder("<"), order="C", copy=False)


_HEAD = struct.Struct("<4sI")
_MAGIC = b"SFP1"


def pack(arrays: Mapping[str, np.ndarray]) -> bytes:
    """Arrays as one self-describing payload (what the prepared cache keeps): a JSON head naming each
    array's dtype and shape, then each array's bytes (C order, little-endian)."""
    ordered = {name: _little(np.asarray(a)) for name, a in arrays.items()}
    for name, array in ordered.items():
        if array.dtype.hasobject:
            raise TransformError(f"prepared array {name!r} holds Python objects: not packable")
    head = json.dumps([[name, a.dtype.str, list(a.shape)] for name, a in ordered.items()]).encode()
    return b"".join([_HEAD.pack(_MAGIC, len(head)), head, *(a.tobytes() for a in ordered.values())])


def unpack(payload: bytes | memoryview) -> dict[str, np.ndarray]:
    """The arrays :func:`pack` made (read-only views of ``payload``); ``TransformError`` if it is not one."""
    view = memoryview(payload)
    try:
        magic, size = _HEAD.unpack_from(view, 0)
        if magic != _MAGIC:
            raise ValueError("bad magic")
        at = _HEAD.size + size
        arrays = {}
        for name, dtype, shape in json.loads(bytes(view[_HEAD.size:at])):
            dtype = np.dtype(dtype)
            count = int(np.prod(shape, dtype=np.int64))
            arrays[name] = np.frombuffer(view, dtype, count, at).reshape(tuple(shape))
            at += count * dtype.itemsize
        if at != len(view):
            raise ValueError(f"{len(view) - at} bytes after the arrays")
    except (ValueError, TypeError, struct.error, json.JSONDecodeError) as err:
        raise TransformError(f"not a prepared payload: {err}") from None
    return arrays
