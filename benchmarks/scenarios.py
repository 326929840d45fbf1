"""The ways of fetching samples that one benchmark run compares.

Every scenario reads the same samples in the same (shuffled) order, split into the same
batches, under the same concurrency budget of ``W`` requests in flight:

- ``individual_gets``: one boto3 GET per sample (one object per sample); a batch is
  fetched by ``W`` threads in parallel, batches one after another.
- ``direct_ranged``: what a client-side library can do with the index and no service:
  per batch, one ranged GET into the shards per run of nearby samples, ``W`` in parallel.
- ``batch_requests``: ``POST /v1/batch`` through the shardfeed client, ``W`` batches in flight
  (as ``W`` DataLoader workers would have). Also used against the minimal HTTP server.
- ``per_sample``: per-sample GETs from many concurrent requesters in ``W`` processes (the
  service coalesces their store reads).
- ``dataloader_epoch``: a PyTorch ``DataLoader`` with ``W`` persistent worker processes
  over ``ShardfeedDataset`` (one request per batch through ``__getitems__``).

Each returns a :class:`Measurement`: raw timings, no statistics (see ``report.py``).
Per-sample latency is the latency of the request that carried the sample: a GET's own
duration, or for a batch the time from sending the request to the sample's arrival in
the stream. Every sample is checked against the index asked for at its position: its
length, and its bytes with ``verify`` (an xxh3 per sample, ``common.Digests``).
"""

from __future__ import annotations

import asyncio
import itertools
import multiprocessing
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from time import perf_counter

import numpy as np

from shardfeed.benchmarks.common import WrongBytes
from shardfeed.client import AsyncClient, Client
from shardfeed.service.datasets.index import Index

Verify = Callable[[int, bytes], None]
"""``verify(i, payload)`` raises if ``payload`` is not sample ``i``'s ``bin`` member."""


@dataclass
class Measurement:
    """What one scenario did: samples and payload bytes delivered, wall time, latencies (seconds)."""

    samples: int = 0
    nbytes: int = 0
    seconds: float = 0.0
    batch_latencies: list[float] = field(default_factory=list)
    sample_latencies: list[float] = field(default_factory=list)
    s3_requests: int | None = None
    """Requests sent to S3 for these samples (None: not applicable)."""
    s3_bytes: int | None = None


def _check(i: int, payload: bytes, size: int, verify: Verify | None) -> None:
    if len(payload) != size:
        raise WrongBytes(f"sample {i}: got {len(payload)} bytes, expected {size}")
    if verify is not None:
        verify(i, payload)


def _asked(indices: Sequence[int], n: int) -> int:
    """The index asked for at position ``n`` of an answer (never its ``__index__``, which
    the client copies from the request)."""
    if n >= len(indices):
        raise WrongBytes(f"asked for {len(indices)} samples, got more")
    return int(indices[n])


def individual_gets(s3, bucket: str, key_of: Callable[[int], str], batches: Sequence[Sequence[int]],
                    size: int, pool: ThreadPoolExecutor, verify: Verify | None = None) -> Measurement:
    """One GET per sample; each batch fetched by the pool's threads in parallel."""
    m = Measurement()

    def get(i: int) -> float:
        began = perf_counter()
        body = s3.get_object(Bucket=bucket, Key=key_of(i))["Body"].read()
        took = perf_counter() - began
        _check(i, body, size, verify)
        return took

    start = perf_counter()
    for batch in batches:
        began = perf_counter()
        m.sample_latencies += pool.map(get, batch)
        m.batch_latencies.append(perf_counter() - began)
    m.seconds = perf_counter() - start
    m.samples = sum(len(b) for b in batches)
    m.nbytes = m.s3_bytes = m.samples * size
    m.s3_requests = m.samples
    return m


def plan_ranges(index: Index, batch: Sequence[int], gap: int) -> list[tuple[int, int, int, list[tuple[int, int, int]]]]:
    """The ranged reads for one batch: ``(shard code, start, end, [(sample, offset in range, size)])``.

    Members of one shard less than ``gap`` bytes apart share a read (the bytes between
    are read too), as a careful client-side library would do.
    """
    members = index.lookup(np.asarray(batch, dtype=np.int64))
    order = np.lexsort((members.offset, members.shard))
    reads: list[tuple[int, int, int, list[tuple[int, int, int]]]] = []
    for row in order.tolist():
        shard, offset, size = int(members.shard[row]), int(members.offset[row]), int(members.size[row])
        sample = int(members.sample[row])
        if reads and reads[-1][0] == shard and offset - reads[-1][2] <= gap:
            code, start, end, parts = reads[-1]
            reads[-1] = (code, start, max(end, offset + size), parts)
        else:
            reads.append((shard, offset, offset + size, []))
        reads[-1][3].append((sample, offset - reads[-1][1], size))
    return reads


def direct_ranged(s3, bucket: str, prefix: str, index: Index, batches: Sequence[Sequence[int]], size: int,
                  pool: ThreadPoolExecutor, gap: int, verify: Verify | None = None) -> Measurement:
    """Ranged GETs into the shards, located with the index; no service, no cache."""
    m = Measurement(s3_requests=0, s3_bytes=0)

    def get(read: tuple[int, int, int, list[tuple[int, int, int]]]) -> list[float]:
        shard, start, end, parts = read
        began = perf_counter()
        body = s3.get_object(Bucket=bucket, Key=f"{prefix}/{index.shards[shard]}",
                             Range=f"bytes={start}-{end - 1}")["Body"].read()
        took = perf_counter() - began
        for sample, offset, length in parts:
            _check(sample, body[offset:offset + length], size, verify)
        return [took] * len(parts)

    start = perf_counter()
    for batch in batches:
        began = perf_counter()
        reads = plan_ranges(index, batch, gap)
        for took in pool.map(get, reads):
            m.sample_latencies += took
        m.batch_latencies.append(perf_counter() - began)
        m.s3_requests += len(reads)
        m.s3_bytes += sum(end - begin for _, begin, end, _ in reads)
    m.seconds = perf_counter() - start
    m.samples = sum(len(b) for b in batches)
    m.nbytes = m.samples * size
    return m


def batch_requests(client: Client, dataset: str, batches: Sequence[Sequence[int]], size: int,
                   pool: ThreadPoolExecutor, verify: Verify | None = None) -> Measurement:
    """``POST /v1/batch`` per batch through ``client``, as many in flight as the pool has threads."""
    m = Measurement()

    def fetch(batch: Sequence[int]) -> tuple[float, list[float]]:
        began = perf_counter()
        arrivals = []
        for n, sample in enumerate(client.iter_batch(dataset, batch)):
            arrivals.append(perf_counter() - began)
            _check(_asked(batch, n), sample["bin"], size, verify)
        if len(arrivals) != len(batch):
            raise WrongBytes(f"batch of {len(batch)} samples returned {len(arrivals)}")
        return perf_counter() - began, arrivals

    start = perf_counter()
    for took, arrivals in pool.map(fetch, batches):
        m.batch_latencies.append(took)
        m.sample_latencies += arrivals
    m.seconds = perf_counter() - start
    m.samples = sum(len(b) for b in batches)
    m.nbytes = m.samples * size
    return m


def per_sample(url: str, dataset: str, order: Sequence[int], size: int, requesters: int, processes: int,
               verify: Verify | None = None) -> Measurement:
    """``GET /v1/datasets/{dataset}/samples/{i}/bin`` for every sample from ``requesters``
    concurrent asyncio requesters spread over ``processes`` processes (forked, as DataLoader
    workers would be; one process with one large connection pool would measure httpx's
    pool, whose cost per request grows with its size). One process: this one."""
    m = Measurement(samples=len(order), nbytes=len(order) * size)
    if processes == 1:
        start = perf_counter()
        m.sample_latencies = _request_all(url, dataset, list(order), size, requesters, verify, lambda: None)
        m.seconds = perf_counter() - start
        return m
    ctx = multiprocessing.get_context("fork")
    ready = ctx.Barrier(processes + 1)
    children = []
    for k in range(processes):
        receive, send = ctx.Pipe(duplex=False)
        child = ctx.Process(target=_requester_process, daemon=True, args=(
            send, ready, url, dataset, list(order[k::processes]), size, max(1, requesters // processes), verify))
        child.start()
        send.close()
        children.append((child, receive))
    try:
        ready.wait(60)
        start = perf_counter()
        for child, receive in children:
            if not receive.poll(600):
                raise TimeoutError("a per-sample requester process sent nothing for 10 minutes")
            error, latencies = receive.recv()
            if error:
                raise WrongBytes(error)
            m.sample_latencies += latencies
        m.seconds = perf_counter() - start
    finally:
        for child, receive in children:
            receive.close()
            child.join(10)
            if child.is_alive():
                child.kill()
    return m


def _request_all(url: str, dataset: str, order: list[int], size: int, requesters: int, verify: Verify | None,
                 ready: Callable[[], object]) -> list[float]:
    """Fetch ``order`` with ``requesters`` concurrent per-sample GETs; ``ready()`` is called
    once connected, just before the first sample is asked for."""
    latencies: list[float] = []

    async def main() -> None:
        async with AsyncClient(url, max_connections=requesters) as client:
            await client.info(dataset)  # connect before the clock starts
            todo = iter(order)

            async def requester() -> None:
                for i in todo:  # one shared iterator: each sample is taken once
                    began = perf_counter()
                    payload = await client.get_field(dataset, i, "bin")
                    latencies.append(perf_counter() - began)
                    _check(i, payload, size, verify)

            ready()
            await asyncio.gather(*(requester() for _ in range(requesters)))

    asyncio.run(main())
    return latencies


def _requester_process(send, ready, url: str, dataset: str, order: list[int], size: int, requesters: int,
                       verify: Verify | None) -> None:
    try:
        send.send((None, _request_all(url, dataset, order, size, requesters, verify, lambda: ready.wait(60))))
    except Exception as err:  # noqa: BLE001 - reported to the parent, which raises it
        send.send((f"{type(err).__name__}: {err}", []))
    finally:
        send.close()


def dataloader_epoch(url: str, dataset: str, order: Sequence[int], batch_size: int, workers: int, size: int,
                     verify: Verify | None = None) -> Measurement:
    """One epoch of ``DataLoader(ShardfeedDataset)`` with ``workers`` persistent processes.

    The workers are started and connected by a few untimed batches first: with our short
    epochs, forking them would otherwise weigh far more than in a real training epoch.
    Batch latency here is the time the training loop waited for each batch.
    """
    from torch.utils.data import DataLoader

    from shardfeed.client.torch import ShardfeedDataset

    m = Measurement()
    positions = itertools.count()
    asked = list(order)
    with warnings.catch_warnings():  # "suggested max number of worker": we oversubscribe on purpose
        warnings.filterwarnings("ignore", message="This DataLoader will create")
        loader = DataLoader(ShardfeedDataset(url, dataset), batch_size=batch_size, sampler=list(order),
                            num_workers=workers, persistent_workers=True, timeout=120)
        try:
            for _ in zip(range(workers), loader):
                pass
            start = last = perf_counter()
            for batch in loader:
                now = perf_counter()
                m.batch_latencies.append(now - last)
                last = now
                for payload in batch["bin"]:  # the sampler's order: the n-th sample is order[n]
                    _check(_asked(asked, next(positions)), payload, size, verify)
            m.seconds = last - start
        finally:
            del loader  # the persistent workers exit with it
    m.samples = next(positions)
    if m.samples != len(order):
        raise WrongBytes(f"the DataLoader epoch yielded {m.samples} of {len(order)} samples")
    m.nbytes = m.samples * size
    return m
