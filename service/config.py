"""Every knob of the service, with its default and why."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path

from shardfeed.sizes import format_size

KiB, MiB, GiB = 1024, 1024**2, 1024**3


def usable_cores() -> int:
    """Cores this process may use: its CPU affinity, lowered to a container's CPU quota
    (cgroup v2 ``cpu.max``), which the affinity does not show."""
    cores = len(os.sched_getaffinity(0))
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()
        return max(1, min(cores, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):  # no cgroup v2, or "max": no quota
        return cores


MAX_WORKERS_PER_CORE = 4
"""More workers than this per usable core only add context switches: refused as a mistake."""


def machine_memory() -> int:
    """Bytes of RAM this machine has."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def default_memory_cache() -> int:
    """1 GiB, or an eighth of the RAM on a small machine: hot blocks, not the whole cache."""
    return min(1 * GiB, machine_memory() // 8)


NODE_IDLE_EXIT = 900.0
"""``serve --node``'s default ``--idle-exit``: a quarter of an hour, long enough to outlast the
pause between two jobs (or an evaluation between epochs), short enough that a node's
service does not hold RAM for long after the last job."""


def node_cache_dir() -> Path:
    """The node service's cache: ``$XDG_CACHE_HOME/shardfeed`` (``~/.cache/shardfeed``), kept
    across its restarts, so a job after an idle exit still starts warm from disk."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "shardfeed" / "cache"


@dataclass(frozen=True)
class HedgePolicy:
    """When to send a second read for the same range."""

    quantile: float = 0.95
    """A read still running after this quantile of the recent read times gets a hedge."""

    min_delay: float = 0.02
    """Lower clamp of the deadline, seconds: never hedge sooner (a store answering in
    a few milliseconds gains nothing from a duplicate read)."""

    max_delay: float = 2.0
    """Upper clamp of the deadline, seconds, and the deadline until ``warmup`` reads
    have completed: a read stuck this long is hedged whatever the history says."""

    budget: float = 0.1
    """Hedges allowed per read, on average (a token bucket refilled by each read)."""

    burst: int = 10
    """Hedges allowed back to back when the budget has been saved up."""

    window: int = 256
    """Recent read times the quantile is taken over."""

    warmup: int = 20
    """Reads to complete before the quantile is trusted."""

    def __post_init__(self) -> None:
        if not 0 < self.quantile < 1:
            raise ValueError(f"hedge quantile must be between 0 and 1, not {self.quantile}")
        if not 0 <= self.min_delay <= self.max_delay:
            raise ValueError(f"hedge delays must satisfy 0 <= min <= max (seconds), not {self.min_delay}, "
                             f"{self.max_delay}")
        if self.budget < 0 or self.burst < 1 or self.window < 1 or self.warmup < 1:
            raise ValueError("hedge budget must not be negative; burst, window and warmup must be positive")


@dataclass(frozen=True)
class WorkerPlace:
    """Where one worker of ``serve --workers N`` stands among its siblings (set by ``workers.py``)."""

    index: int
    ports: tuple[int, ...]
    """Per worker, its own TCP port on the service's host: its URL in routing tables."""
    sockets: tuple[str, ...]
    """Per worker, its Unix socket for sub-batches from siblings."""
    cache_dirs: tuple[Path, ...]
    """Per worker, its block cache directory, which its siblings read (``siblings.py``)."""
    counter_dirs: tuple[Path, ...]
    """Per worker, where its counters are kept across its restarts (``keptcounters.py``)."""
    registry: Path
    """The datasets registered at runtime (``POST /v1/datasets``), which a restarted worker
    opens too (``datasets/served.py``)."""


@dataclass
class ServiceConfig:
    datasets: dict[str, str] = field(default_factory=dict)
    """Datasets served, ``{name: url}``; empty means the embedded default (see ``server.py``)."""

    index_objects: bool = False
    """A dataset without ``index.parquet`` is indexed at start as loose objects (one object
    per member, ``layouts.py``) instead of refused."""

    buckets: tuple[str, ...] = ()
    """Buckets GetBatch (``/v1/ml/moss``) may read, on the S3 endpoint of the AWS settings; any
    other bucket is refused, never read with the service's credentials."""

    object_ttl: float = 60.0
    """Seconds a GetBatch object's HEAD (its size and version) is trusted: an object
    overwritten in the store is read at its new version within this time, sooner if a read
    finds it replaced. 0: a HEAD for every object of every request. (A served dataset is
    listed when it opens and on ``POST /v1/datasets/{name}/reload`` or SIGHUP.)"""

    node: bool = False
    """The node service (``serve --node``): the one training scripts find and start by naming a
    dataset URL alone (``shardfeed/node.py``). It starts with no dataset, takes any free port
    unless given one, keeps its cache under the user's cache directory, accepts a token of its
    own (in its address file, which only its user reads) and exits when idle."""

    idle_exit: float = 0.0
    """Seconds without a data request (anything but health, metrics and status) after which the
    service stops as on SIGTERM; 0: never. ``serve --node`` defaults to ``NODE_IDLE_EXIT``."""

    host: str = "127.0.0.1"
    """Interface to bind. Loopback unless told otherwise: exposing a data service is a decision."""

    port: int = 8080

    workers: int = field(default_factory=usable_cores)
    """Processes serving this host (``workers.py``): each owns a rendezvous share of the shards
    and ``cache_size / workers`` of the cache, and all accept on ``port``. Default: one per
    usable core; 1 serves from this process alone."""

    worker: WorkerPlace | None = None
    """This process's place among the workers; ``None`` outside ``--workers`` (N > 1)."""

    restart_pause: float = 0.1
    """Seconds before a dead worker is restarted, doubling while it keeps dying (up to 10 s, or
    this if longer; at least 0.01, so that the pause can grow). Meanwhile its siblings serve its
    shards: from its block files where they are, else from the store."""

    cache_dir: Path = Path(".shardfeed/cache")
    """Block cache directory, ideally on local NVMe. One service process per directory.
    ``serve --node``: ``node_cache_dir()``."""

    cache_size: int = 10 * GiB
    """Most bytes the block cache keeps on disk (least recently used blocks are evicted)."""

    memory_cache: int = field(default_factory=default_memory_cache)
    """Most bytes of verified blocks kept in RAM in front of the disk cache (``memtier.py``): a
    hot block is checked once, then served from memory without a thread hop. 0 disables it.
    Never more than the machine's RAM."""

    direct_writes: bool = True
    """Write block files around the page cache (``O_DIRECT``) where the filesystem allows:
    the RAM tier holds the hot blocks, so the page cache would hold them twice, and filling
    it cost 1.4 ms of kernel CPU per MiB here. Buffered where the filesystem refuses."""

    block_size: int = 1 * MiB
    """Unit of caching and of store reads: shards are fetched in aligned blocks of this size.
    Larger blocks mean fewer store requests on a cold cache, more bytes read when only a
    few samples of a block are wanted."""

    merge_gap: int = 1 * MiB
    """Missing blocks of one shard separated by at most this many bytes are fetched in one
    ranged read (the gap is fetched and cached too): a request saved for a few bytes more."""

    fetch_window: int = 8 * MiB
    """A miss in a dataset the cache can hold whole also fetches the missing blocks around it,
    in the same read: its aligned window of this many bytes of the shard. An epoch will want
    those blocks before anything evicts them, and one larger read costs the store much less
    than several (S3 advises ranges of 8-16 MB; SeaweedFS spent 0.7 ms of CPU per extra 1 MiB
    read here). A dataset larger than the cache, and a GetBatch request's objects, are read
    block by block. ``block_size`` or less: no window."""

    max_fetch: int = 16 * MiB
    """Largest single ranged read; longer runs of blocks are split."""

    ranges_first: bool = False
    """A read that needs an eighth of a block or less, of a block nobody is reading yet, reads
    its members' byte ranges (merged within ``range_gap``) and fetches the block whole behind
    it, into the cache: a batch waits for its own bytes, not for whole blocks or their fetch
    windows. Off by default: on 10,000 x 100 KiB from SeaweedFS it halved the time to the
    first cold batch (0.51-1.60 s, median 0.56-0.66, from 1.13-1.63) but cost 20-27% of the
    cold epoch's samples/s and read 1.03-1.04x the shards (docs/benchmarks.md)."""

    max_store_requests: int = 32
    """Store reads in flight at once, across all requests (the store's connection pool)."""

    sample_window: float = 0.001
    """Seconds a per-sample GET waits for others to arrive so their reads can be coalesced."""

    group_bytes: int = 1 * MiB
    """A batch is resolved and sent in groups of about this many payload bytes; the first
    group goes out while later ones are still being read."""

    prefetch_groups: int = 3
    """Groups of one batch being read ahead of the one being sent. With ``group_bytes``
    this bounds the memory of a request; a slow client holds at most this much."""

    max_batch: int = 16384
    """Most samples in one ``POST /v1/batch`` (413 beyond)."""

    max_body: int = 2 * MiB
    """Largest request body accepted (413 beyond)."""

    max_inflight_batches: int = 128
    """Batch requests served at once; more are refused with 429 and ``Retry-After``."""

    max_inflight_samples: int = 8192
    """Per-sample GETs served at once; more are refused with 429 and ``Retry-After``."""

    tokens: frozenset[str] = frozenset()
    """Bearer tokens with full access (``--token-file``, ``SHARDFEED_TOKENS``); with no
    ``tenant_file`` either, authentication is off."""

    tenant_file: Path | None = None
    """The token file of ``--tokens``: tokens with names, scopes and their own bound on batches
    in flight (``api/tenants.py``), read again when it changes."""

    tls_cert: Path | None = None
    """PEM certificate: serve HTTPS instead of HTTP (with ``tls_key``)."""

    tls_key: Path | None = None

    node_id: str | None = None
    """This replica's id among ``peers`` (its host name, first DNS label, URL, or ``ID=`` name)."""

    peers: str = ""
    """Every replica, this one included: ``URL,URL,...`` or ``ID=URL,...``. Shards are owned by
    rendezvous hashing over the live peers; empty means a single node."""

    peers_from: str = ""
    """Where the replicas are listed while serving, followed as they change (``cluster/sources.py``):
    ``file:PATH`` (lines like ``peers``), ``dns:NAME[:PORT]`` (A/AAAA records) or ``dns+srv:NAME``
    (SRV records); instead of ``peers``."""

    peers_refresh: float = 2.0
    """Seconds between two looks at ``peers_from`` (a file's modification time, a DNS query)."""

    peer_timeout: float = 2.0
    """Seconds an owner has to answer a sub-batch (plus 1 s per 50 MB) before this replica
    reads those samples from the store itself."""

    store_options: dict = field(default_factory=dict)
    """Passed to the store backends (timeouts, pool size, retries)."""

    hedge: HedgePolicy | None = field(default_factory=HedgePolicy)
    """Hedged store reads (``hedge.py``): a range read slower than most recent ones gets a
    second, identical read and the first answer wins. ``None`` disables hedging."""

    # -- Plans (``service/plans/``): clients announce their order; the service reads ahead
    #    along it and evicts the block used farthest in the future.
    max_plans: int = 64
    """Plans held at once, all datasets together (429 beyond); one per rank and epoch."""

    max_plan_samples: int = 1 << 22
    """Most positions in one plan (413 beyond). A plan holds about 26 bytes per position, and
    its dataset's block geometry 12 bytes per sample; registering one of 2^22 positions takes
    about 2 s of a core, one of 10^8 about 85 s (``python -m shardfeed.benchmarks.scale``)."""

    plan_ttl: float = 600.0
    """Seconds a plan lives after its last registration or use; a client whose plan is
    gone registers it again (``GET`` answers 404)."""

    plan_ahead: int = 64 * MiB
    """Payload bytes of samples read ahead of each plan's reader, into the cache (whole
    blocks) or memory (sample ranges); also capped by what the cache can keep."""

    plan_memory: int = 256 * MiB
    """Most bytes of sample ranges read ahead and held in memory, all plans together."""

    range_gap: int = 16 * KiB
    """Sample ranges fetched without their block (a block none of whose other samples the
    plans read before it would be evicted) are merged into one read when this close."""

    @property
    def index_dir(self) -> Path:
        """Where indexes the service made for tar shards are kept when the store is read-only
        (``datasets/autoindex.py``): beside the block cache (every worker's, with ``--workers``)."""
        root = self.worker.cache_dirs[0].parent if self.worker is not None else self.cache_dir
        return root / "indexes"

    def __post_init__(self) -> None:
        most = MAX_WORKERS_PER_CORE * usable_cores()
        if not 1 <= self.workers <= most:
            raise ValueError(f"--workers must be between 1 and {most} ({MAX_WORKERS_PER_CORE} per usable "
                             f"core), not {self.workers}")
        ram = machine_memory()
        if self.memory_cache < 0:
            raise ValueError(f"--memory-cache must not be negative, not {self.memory_cache}")
        if self.memory_cache > ram:
            raise ValueError(f"--memory-cache {format_size(self.memory_cache)} is more than this machine's "
                             f"RAM ({format_size(ram)})")
        limits = [("idle_exit", 0, 86400 * 365), ("max_plans", 0, 1 << 16), ("max_plan_samples", 1, 1 << 31), ("plan_ttl", 1, 86400 * 7),
                  ("object_ttl", 0, 86400 * 7),
                  ("plan_ahead", 0, 1 << 40), ("plan_memory", 0, 1 << 40), ("range_gap", 0, 1 << 30),
                  ("restart_pause", 0.01, 3600), ("peers_refresh", 0.05, 3600)]
        for name, low, high in limits:
            value = getattr(self, name)
            if not low <= value <= high:
                raise ValueError(f"--{name.replace('_', '-')} must be between {low} and {high}, not {value}")
