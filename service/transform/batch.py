"""The transformed batch: ``POST /v1/batch`` with ``"transform"`` (its entry: ``api/batch.py``).

Its steps, once the request is validated and admitted:

1. the prepared cache (``prepared.py``) is asked for every sample's ``prepare`` output;
2. the misses' raw fields (the transform's declared ones) are read through the read path: from
   the RAM tier when it holds them all, else through the coalescer (owners, cache, store);
3. the pool runs every sample (``pool.TransformPool``): a hit as a ``prepared`` job (``augment``
   only), a miss as a ``sample`` job (``prepare`` then ``augment``);
4. the misses' new ``prepare`` outputs are kept in the prepared cache;
5. the answer is framed (``arrow.py``), whole, before its first byte.

A sample whose read failed (its shard unreadable, a field missing) or whose transform failed (it
raised, hung past the deadline, lost its process twice) is a null row with ``continue_on_error``;
without it, a read failure is answered as a plain batch's is (``SampleFailed``), a transform's as
422 ``transform_failed`` naming the sample.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from shardfeed.service.datasets.dataset import Dataset
from shardfeed.service.datasets.index import Members
from shardfeed.service.http.errors import ApiError
from shardfeed.service.observe.metrics import Metrics
from shardfeed.service.read.coalescer import Coalescer
from shardfeed.service.read.fields import located
from shardfeed.service.read.planner import joined, take
from shardfeed.service.read.stream import SampleFailed
from shardfeed.service.read.warm import held_group
from shardfeed.service.stores import StoreError
from shardfeed.service.transform import arrow
from shardfeed.service.transform.pool import Done, Job, TransformPool
from shardfeed.service.transform.prepared import PreparedCache
from shardfeed.service.transform.registry import ServedTransform
from shardfeed.transforms.base import TransformError, unpack


@dataclass
class TransformedBatch:
    """A valid transformed batch: the samples (``members``: their transform's fields, looked up)
    and how to transform them."""

    dataset: Dataset
    indices: np.ndarray
    members: Members
    served: ServedTransform
    seed: int
    epoch: int
    continue_on_error: bool
    stream: str | None


async def transformed_answer(batch: TransformedBatch, coalescer: Coalescer, pool: TransformPool,
                             prepared: PreparedCache, metrics: Metrics) -> list:
    """The answer's parts (see the module's docstring): an ``ApiError`` (422) for a failed
    transform, ``SampleFailed`` for a failed read, without ``continue_on_error``; a ``StoreError``
    or ``IndexFormatError`` for a record whose fields could not be placed."""
    dataset, indices, served, n = batch.dataset, batch.indices, batch.served, len(batch.indices)
    keys = prepared.keys(dataset, served.name, served.version, batch.members, n)
    known = [p for p, key in enumerate(keys) if key is not None]
    found: list[bytes | None] = [None] * n
    for position, payload in zip(known, await prepared.get([keys[p] for p in known])):
        found[position] = payload
    misses = [p for p in range(n) if found[p] is None]
    labels = served.name
    metrics.transform_prepared.labels(labels, "hit").inc(n - len(misses))
    metrics.transform_prepared.labels(labels, "miss").inc(len(misses))
    failed: dict[int, str] = {}  # position -> why it has no outputs
    samples = await _read_samples(coalescer, batch, misses, failed) if misses else {}
    jobs, positions = [], []
    for position in range(n):
        if position in failed:
            continue
        cached = found[position]
        sample = None if cached is not None else samples.get(position, {})  # {}: it has none of the fields
        jobs.append(Job(int(indices[position]), sample, cached, batch.seed, batch.epoch))
        positions.append(position)
    results = await pool.run(served.name, jobs)
    rows: list[dict | None] = [None] * n
    new = []
    for position, result in zip(positions, results):
        if isinstance(result, Done):
            try:
                rows[position] = unpack(result.outputs)
            except TransformError as err:
                failed[position] = str(err)
                continue
            metrics.transform_seconds.labels(labels).inc(result.seconds)
            if result.prepared is not None and keys[position] is not None:
                new.append((keys[position], result.prepared))
        else:
            failed[position] = result.reason
    metrics.transform_samples.labels(labels).inc(len(jobs))
    metrics.transform_failures.labels(labels).inc(sum(1 for r in results if not isinstance(r, Done)))
    metrics.transform_busy.set(pool.stats()["busy_share"])
    if failed and not batch.continue_on_error:
        position = min(failed)
        raise ApiError(422, "transform_failed", f"sample {int(indices[position])} of dataset {dataset.name!r}: "
                                                f"transform {served.name!r} failed: {failed[position]}")
    await prepared.put(new)
    key_offsets, key_text = dataset.index.key_bytes(indices)
    return arrow.frame(served.transform, indices, key_offsets, key_text, rows)


async def _read_samples(coalescer: Coalescer, batch: TransformedBatch, positions: list[int],
                        failed: dict[int, str]) -> dict[int, dict[str, bytes]]:
    """The raw fields of the samples at ``positions``, ``{field: bytes}`` each; a sample that could
    not be read goes to ``failed`` (with ``continue_on_error``), else raises ``SampleFailed``."""
    dataset = batch.dataset
    members = take(batch.members, np.flatnonzero(np.isin(batch.members.position, positions)))
    members = await located(coalescer, dataset, members)
    held = held_group(coalescer, dataset, members)
    if held is not None and members.found.all():
        payloads: list = [b"".join(held.data(row)) for row in range(len(members))]
    else:
        payloads = await coalescer.read_members(dataset, members)
    fields = dataset.index.fields
    samples: dict[int, dict[str, bytes]] = {}
    for row, (position, field) in enumerate(zip(members.position.tolist(), members.field.tolist())):
        payload = payloads[row]
        if payload is None or isinstance(payload, StoreError):
            if not batch.continue_on_error:
                raise SampleFailed(dataset.name, int(batch.indices[position]), payload)
            failed.setdefault(position, f"could not be read: {payload or 'a field is missing'}")
            continue
        # Joined here, as the held path's are: ``prepare`` takes each field as one ``bytes``.
        samples.setdefault(position, {})[fields[field]] = joined(payload)
    return {position: sample for position, sample in samples.items() if position not in failed}
