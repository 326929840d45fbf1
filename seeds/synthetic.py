"""A deterministic synthetic dataset (``shardfeed seed``), verifiable without storing it.

Every member's bytes are a pure function of ``(seed, i, field, sizes)``, so tests and
benchmarks can check any sample they get back with ``member_bytes`` instead of keeping
a copy. Payloads are cheap to make: a 16-byte tag naming ``(seed, i)`` followed by a
slice of a per-seed random pool at a per-sample offset (random-looking, incompressible,
and different for every sample).

Fields: ``bin`` (the payload, ``size`` bytes), ``cls`` (a label 0-9 as ASCII digits),
``json`` (``{"key", "index", "label", "size"}``).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator, Sequence
from functools import lru_cache

import numpy as np

from shardfeed.service.datasets.index import Index
from shardfeed.service.datasets.shards import DEFAULT_SHARD_SIZE, Sample, write_shards
from shardfeed.service.stores import Store
from shardfeed.sizes import parse_size

FIELDS = ("bin", "cls", "json")
DEFAULT_FIELDS = ("bin", "cls")
_POOL = 1 << 20
_M64 = (1 << 64) - 1


def parse_sizes(text: str | int) -> tuple[int, int]:
    """``'10KiB'`` -> ``(10240, 10240)``; ``'1KiB-100KiB'`` -> a range sizes are drawn from uniformly."""
    if isinstance(text, int):
        return parse_size(text), parse_size(text)
    low, dash, high = text.partition("-")
    lo, hi = parse_size(low), parse_size(high) if dash else parse_size(low)
    if lo > hi:
        raise ValueError(f"invalid size range {text!r}: the low end is above the high end")
    return lo, hi


def _mix(seed: int, i: int, stream: int) -> int:
    """splitmix64 of (seed, i, stream): a cheap, well-spread 64-bit hash."""
    x = (seed * 0x9E3779B97F4A7C15 + i * 0xD1B54A32D192ED03 + stream * 0x8CB92BA72F3D8DD7 + 1) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


@lru_cache(maxsize=4)
def _pool(seed: int) -> bytes:
    block = np.random.default_rng(seed).bytes(_POOL)
    return block + block  # doubled, so any slice of up to _POOL bytes needs no wrap-around


def sample_key(i: int) -> str:
    return f"{i:09d}"


def sample_size(seed: int, i: int, sizes: tuple[int, int]) -> int:
    """The ``bin`` size of sample ``i``: fixed, or drawn from ``sizes = (low, high)``."""
    lo, hi = sizes
    return lo + _mix(seed, i, 1) % (hi - lo + 1)


def sample_label(seed: int, i: int) -> int:
    return _mix(seed, i, 2) % 10


def sample_bytes(seed: int, i: int, size: int) -> bytes:
    """The ``bin`` payload of sample ``i``: exactly ``size`` bytes."""
    tag = struct.pack("<QQ", seed & _M64, i)
    start = _mix(seed, i, 0) % _POOL
    n = size - len(tag)
    if n <= _POOL:
        body = _pool(seed)[start:start + max(n, 0)]
    else:
        body = (_pool(seed)[start:start + _POOL] * (n // _POOL + 1))[:n]
    return (tag + body)[:size]


def member_bytes(seed: int, i: int, field: str, sizes: tuple[int, int]) -> bytes:
    """The bytes of member ``field`` of sample ``i`` (what a reader must get back)."""
    if field == "bin":
        return sample_bytes(seed, i, sample_size(seed, i, sizes))
    if field == "cls":
        return str(sample_label(seed, i)).encode()
    if field == "json":
        return json.dumps({"key": sample_key(i), "index": i, "label": sample_label(seed, i),
                           "size": sample_size(seed, i, sizes)}).encode()
    raise ValueError(f"unknown synthetic field {field!r} (choose from {', '.join(FIELDS)})")


def parse_fields(text: str | Sequence[str]) -> tuple[str, ...]:
    """``'bin,cls'`` -> ``('bin', 'cls')``; refuses unknown, repeated or no fields."""
    fields = tuple(f.strip().lower() for f in (text.split(",") if isinstance(text, str) else text))
    for field in fields:
        if field not in FIELDS:
            raise ValueError(f"unknown synthetic field {field!r} (choose from {', '.join(FIELDS)})")
    if not fields or len(set(fields)) != len(fields):
        raise ValueError(f"fields must be distinct and not empty, got {','.join(fields)!r}")
    return fields


def iter_samples(samples: int, sizes: tuple[int, int], fields: Sequence[str], seed: int) -> Iterator[Sample]:
    for i in range(samples):
        yield sample_key(i), [(f, member_bytes(seed, i, f, sizes)) for f in fields]


async def seed_dataset(store: Store, *, samples: int, size: str | int | tuple[int, int],
                       shard_size: int = DEFAULT_SHARD_SIZE, fields: str | Sequence[str] = DEFAULT_FIELDS,
                       seed: int = 0, progress: bool = True) -> Index:
    """Write a synthetic dataset (shards + index) straight into ``store``; returns the index.

    samples: number of samples (keys ``000000000``, ``000000001``, ...).
    size: ``bin`` payload size: ``'10KiB'``, a range ``'1KiB-100KiB'`` or ``(low, high)``.
    shard_size: target shard size in bytes.
    fields: some of ``bin``, ``cls``, ``json``, in member order.
    seed: selects the bytes; the same arguments always give the same dataset.
    """
    if samples < 1:
        raise ValueError(f"--samples must be at least 1, not {samples}")
    if seed < 0:
        raise ValueError(f"--seed must not be negative, not {seed}")
    sizes = size if isinstance(size, tuple) else parse_sizes(size)
    fields = parse_fields(fields)
    expected = samples * (sizes[0] + sizes[1]) // 2 if "bin" in fields else None
    return await write_shards(store, iter_samples(samples, sizes, fields, seed), shard_size=shard_size,
                              total_bytes=expected, desc="seed", progress=progress)
