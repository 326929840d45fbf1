"""Prometheus metrics of one service process (a private registry, so tests can run several apps)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest

disable_created_metrics()  # the *_created series double the output and nobody reads them

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)

MAX_STREAMS = 64
"""Stream names (``"stream"`` of a batch request) a process counts under their own label. The
names are the clients' to choose: without a bound, every new name would add two series to every
scrape, for good."""
OTHER_STREAM = "(other)"
"""The label the names after the first ``MAX_STREAMS`` count under (no stream name can be it:
parentheses are not allowed in one)."""


class Metrics:
    """Every metric the service exports, named ``shardfeed_*``."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("shardfeed_requests", "HTTP requests by route and status",
                                ["route", "status"], registry=r)
        self.samples = Counter("shardfeed_samples_served", "Samples served", registry=r)
        self.bytes_served = Counter("shardfeed_bytes_served", "Payload bytes served", registry=r)
        self.stream_samples = Counter("shardfeed_stream_samples_served",
                                      "Samples served to batch requests that named a stream, by stream",
                                      ["stream"], registry=r)
        self.stream_bytes = Counter("shardfeed_stream_bytes_served",
                                    "Payload bytes served to batch requests that named a stream, by stream",
                                    ["stream"], registry=r)
        self._streams: set[str] | None = None  # the names counted under their own label
        self.batch_latency = Histogram("shardfeed_batch_seconds", "Batch request latency (to last byte)",
                                       buckets=_LATENCY_BUCKETS, registry=r)
        self.sample_latency = Histogram("shardfeed_sample_seconds", "Per-sample GET latency",
                                        buckets=_LATENCY_BUCKETS, registry=r)
        self.store_requests = Counter("shardfeed_store_requests", "Ranged reads sent to the store",
                                      registry=r)
        self.store_bytes = Counter("shardfeed_store_bytes", "Bytes read from the store", registry=r)
        self.store_errors = Counter("shardfeed_store_errors", "Store reads that failed after retries",
                                    registry=r)
        self.cache_hits = Counter("shardfeed_cache_hits", "Block reads served by the cache", registry=r)
        self.cache_misses = Counter("shardfeed_cache_misses", "Block reads that went to the store",
                                    registry=r)
        self.cache_evictions = Counter("shardfeed_cache_evictions", "Blocks evicted", registry=r)
        self.cache_corrupt = Counter("shardfeed_cache_corrupt", "Cached blocks found corrupt and dropped",
                                     registry=r)
        self.cache_write_errors = Counter("shardfeed_cache_write_errors",
                                          "Blocks not cached because the cache could not be written",
                                          registry=r)
        self.cache_writes_skipped = Counter(
            "shardfeed_cache_writes_skipped", "Fetched blocks not cached because the cache-write queue "
            "was full (the disk was behind)", registry=r)
        self.cache_bytes = Gauge("shardfeed_cache_bytes", "Bytes held in the block cache", registry=r)
        self.cache_blocks = Gauge("shardfeed_cache_blocks", "Blocks held in the block cache", registry=r)
        self.memory_cache_bytes = Gauge("shardfeed_memory_cache_bytes",
                                        "Bytes of verified blocks held in RAM (--memory-cache)", registry=r)
        self.block_buffers = Gauge("shardfeed_block_buffers_bytes",
                                   "Bytes of block buffers the pool keeps (shardfeed/buffers.py)", registry=r)
        self.block_buffers_outside = Gauge(
            "shardfeed_block_buffers_outside",
            "Block buffers made outside the pool since start (past its bound, or larger than a block)", registry=r)
        self.memory_cache_hits = Counter("shardfeed_memory_cache_hits", "Block reads served from RAM",
                                         registry=r)
        self.coalescing_factor = Gauge("shardfeed_coalescing_factor",
                                       "Samples served per store request since start", registry=r)
        self.inflight_requests = Gauge("shardfeed_inflight_requests", "HTTP requests being served",
                                       registry=r)
        self.inflight_store = Gauge("shardfeed_inflight_store_requests", "Store reads in flight",
                                    registry=r)
        self.peer_requests = Counter(
            "shardfeed_peer_requests", "Sub-batches sent to the owning replica or sibling worker (hops)",
            ["peer", "kind", "status"], registry=r)
        self.peer_fallbacks = Counter("shardfeed_peer_fallbacks",
                                      "Members read from the store because their owner failed", registry=r)
        self.sibling_blocks = Counter(
            "shardfeed_sibling_blocks", "Blocks of sibling workers read from their cache directories: "
            "read, absent (the owner is asked) or bad (not served; the owner is asked)", ["result"], registry=r)
        self.replica_blocks = Counter(
            "shardfeed_replica_blocks", "Blocks of members read from their owner replica (that replica "
            "counts its own cache hits and store reads)", registry=r)
        self.peers_up = Gauge("shardfeed_peers_up", "Replicas believed live, this one included", registry=r)
        self.plans = Gauge("shardfeed_plans", "Plans held (service/plans/)", registry=r)
        self.rejected = Counter("shardfeed_rejected", "Requests refused with 429 (overloaded)", registry=r)
        # Labelled by tenant name (``serve --tokens``), never by token: a label is no place for a secret.
        self.tenant_requests = Counter("shardfeed_tenant_requests", "HTTP requests by tenant and status",
                                       ["tenant", "status"], registry=r)
        self.tenant_batches = Gauge("shardfeed_tenant_inflight_batches", "Batch requests in flight by tenant",
                                    ["tenant"], registry=r)
        # Transforms (``service/transform/``), by the served transform's name (the operator's: bounded).
        self.transform_samples = Counter("shardfeed_transform_samples", "Samples transformed, by transform",
                                         ["transform"], registry=r)
        self.transform_seconds = Counter("shardfeed_transform_seconds",
                                         "CPU seconds the pool's processes spent on samples, by transform",
                                         ["transform"], registry=r)
        self.transform_prepared = Counter(
            "shardfeed_transform_prepared", "Samples whose prepare output was found in the prepared cache "
            "(hit) or was not (miss: prepared from the raw sample)", ["transform", "result"], registry=r)
        self.transform_failures = Counter("shardfeed_transform_failures",
                                          "Samples whose transform raised, timed out or lost its process",
                                          ["transform"], registry=r)
        self.transform_busy = Gauge("shardfeed_transform_pool_busy_share",
                                    "Share of the transform pool's processes busy (0..1)", registry=r)

    def stream_counters(self, stream: str) -> tuple[Counter, Counter]:
        """The samples and bytes counters of ``stream``: its own for the first ``MAX_STREAMS``
        names, ``OTHER_STREAM``'s for the later ones."""
        if self._streams is None:  # first use: a restarted worker's predecessor's names (``restore_series``) count
            self._streams = {sample.labels["stream"] for family in self.stream_samples.collect()
                             for sample in family.samples} - {OTHER_STREAM}
        if stream not in self._streams:
            if len(self._streams) >= MAX_STREAMS:
                stream = OTHER_STREAM
            else:
                self._streams.add(stream)
        return self.stream_samples.labels(stream), self.stream_bytes.labels(stream)

    def render(self) -> bytes:
        store_requests = self.store_requests._value.get()
        self.coalescing_factor.set(self.samples._value.get() / store_requests if store_requests else 0)
        return generate_latest(self.registry)
