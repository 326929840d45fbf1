"""Every setting of the service, each described once.

``ServiceConfig`` holds them. A field that a ``shardfeed serve`` flag sets carries a ``Setting``
(its help, group, range, and how its flag is read and its values shown); ``OPTIONS`` describe
the few flags that set no single field. ``serve``'s flags and their parsing back
(``server.add_arguments``, ``server.config_from_args``), the range checks
(``ServiceConfig.__post_init__``) and docs/settings.md (``python -m shardfeed.service.config``)
are all made from them.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
from collections.abc import Callable
from dataclasses import MISSING, dataclass, field, fields, replace
from enum import Enum
from functools import cache
from itertools import groupby
from pathlib import Path
from typing import Any

from shardfeed.retry import Backoff
from shardfeed.sizes import format_size, parse_size

KiB, MiB, GiB, TiB = 1024, 1024**2, 1024**3, 1024**4
DAY = 86400.0


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


DEFAULT_DATA_DIR = Path(".shardfeed/datasets")
"""Where ``serve`` seeds and finds its embedded default dataset (``--data-dir``)."""

_BUCKET = re.compile(r"[a-z0-9][a-z0-9.\-_]{1,253}[a-z0-9]")
TRANSFORM_NAME = re.compile(r"[a-z0-9_]{1,64}\Z")
"""What a served transform's name may be (``--transform NAME=...``)."""


def transform_spec(text: str, *, load: bool = False) -> tuple[str, str]:
    """A ``--transform NAME=MODULE:FACTORY`` as ``(name, spec)``; ``load``: the factory loaded and
    its transform checked too (``transforms.base.load``). ``ValueError`` saying what is wrong."""
    name, sep, spec = text.partition("=")
    if not sep or not spec:
        raise ValueError(f"expected NAME=MODULE:FACTORY, got {text[:200]!r}")
    if not TRANSFORM_NAME.match(name):
        raise ValueError(f"the name {name[:200]!r} is not [a-z0-9_]{{1,64}}")
    if load:
        from shardfeed.transforms.base import load as load_transform  # imports numpy: only when needed

        load_transform(spec)
    return name, spec


def transform_argument(text: str) -> str:
    """argparse's ``type`` of ``--transform``: checked and loaded at once, so that a bad one is a
    usage error (one line, exit status 2)."""
    try:
        transform_spec(text, load=True)
    except ValueError as err:  # TransformError included
        raise argparse.ArgumentTypeError(" ".join(str(err).split())) from None
    return text


def transform_specs(given: tuple[str, ...]) -> dict[str, str]:
    """``--transform`` values as ``{name: spec}``; ``ValueError`` for a name given twice."""
    specs: dict[str, str] = {}
    for text in given:
        name, spec = transform_spec(text)
        if name in specs:
            raise ValueError(f"--transform: the name {name!r} is given twice")
        specs[name] = spec
    return specs


# -- How a setting's flag is read, and its values shown ---------------------------------------

def _seconds(value: float) -> str:
    for unit, size in (("days", DAY), ("hour", 3600.0)):
        if value >= size and value % size == 0:
            return f"{value / size:g} {unit}"
    return f"{value:g} s"


def milliseconds(text: str) -> float:
    """A flag's milliseconds, as the seconds its field holds."""
    return float(text) / 1e3


@dataclass(frozen=True)
class Typed:
    """A value parsed from the flag's text (argparse's ``type``)."""

    parse: Callable[[str], Any]
    show: Callable[[Any], str] = str
    metavar: str | None = None
    """Shown for the value in ``--help``; ``None``: argparse's, the flag's name in capitals."""

    def arguments(self, metavar: str | None) -> dict:
        return {"type": self.parse, "metavar": metavar or self.metavar}

    def value(self, given: Any) -> Any:
        return given


@dataclass(frozen=True)
class Choice:
    """One of a few words, each standing for a value."""

    words: dict[str, Any]

    def arguments(self, metavar: str | None) -> dict:
        return {"choices": list(self.words)}

    def value(self, given: str) -> Any:
        return self.words[given]

    def show(self, value: Any) -> str:
        return next(word for word, meant in self.words.items() if meant == value)


@dataclass(frozen=True)
class Switch:
    """On when given (``--node``); ``negatable``: ``--no-...`` turns off what is on by default."""

    negatable: bool = False

    def arguments(self, metavar: str | None) -> dict:
        return {"action": argparse.BooleanOptionalAction if self.negatable else "store_true"}

    def value(self, given: bool) -> bool:
        return given

    def show(self, value: Any) -> str:
        return "on" if value else "off"


@dataclass(frozen=True)
class Repeated:
    """A flag given once per value (``--bucket A --bucket B``); a repeated value counts once."""

    metavar: str
    parse: Callable[[str], Any] | None = None
    """Checks and reads each value as it is given (argparse's ``type``: its error is a usage error)."""

    def arguments(self, metavar: str | None) -> dict:
        return {"action": "append", "metavar": metavar or self.metavar,
                **({"type": self.parse} if self.parse is not None else {})}

    def value(self, given: list[str]) -> tuple[str, ...]:
        return tuple(dict.fromkeys(given))

    def show(self, value: tuple[str, ...]) -> str:
        return ", ".join(value)


Kind = Typed | Choice | Switch | Repeated
INT = Typed(int)
NUMBER = Typed(float, "{:g}".format)
SECONDS = Typed(float, _seconds, "SECONDS")
MILLISECONDS = Typed(milliseconds, lambda seconds: f"{seconds * 1e3:g} ms", "MS")
SIZE = Typed(parse_size, format_size, "SIZE")
TEXT = Typed(str)
PATH = Typed(Path)
SWITCH = Switch()
ON_OFF = Choice({"on": True, "off": False})


@dataclass(frozen=True)
class MachineBound:
    """A bound that depends on the machine: ``value()`` where it is checked, ``text`` in docs."""

    text: str
    value: Callable[[], float]


class Group(Enum):
    """Where a setting is listed in ``serve --help`` and docs/settings.md, in this order."""

    SERVICE = "the service"
    DATASETS = "datasets"
    CACHE = "the block cache"
    READS = "reads from the store"
    STORE = "store requests: timeouts, retries, hedging"
    REQUESTS = "requests"
    PLANS = "plans: read-ahead and eviction along announced orders"
    TRANSFORMS = "transforms: preprocessing in the service"
    ACCESS = "access: tokens and TLS"
    REPLICAS = "replicas"
    LOG = "the log"


@dataclass(frozen=True)
class Setting:
    """One flag of ``shardfeed serve``, described once: its ``--help``, its row in
    docs/settings.md, how it is parsed and the range it is checked against."""

    group: Group
    help: str
    kind: Kind
    flag: str = ""
    """``--`` and the field's name with dashes, unless given."""
    metavar: str | None = None
    low: float | None = None
    high: float | MachineBound | None = None
    """With ``low``: the range is ``low`` to ``high``, both allowed."""
    positive: bool = False
    """The range is above 0 (0 itself refused)."""
    default: Any = None
    """An option's default; a field's is the field's own (``settings`` fills it in)."""
    shown: str = ""
    """The default in words, where its value depends on the machine."""
    node: Any = None
    """The default under ``--node``, or a function that finds it."""
    name: str = ""
    """The field this flag sets (``settings`` fills it in), or an option's ``argparse`` name."""
    owner: type | None = None
    """The dataclass whose field this flag sets; ``None``: an option, read by ``config_from_args``."""

    @property
    def dest(self) -> str:
        """The flag's name in ``argparse``'s namespace."""
        return self.flag.removeprefix("--").replace("-", "_")

    def usage(self) -> str:
        """The flag as typed: ``--port PORT``."""
        if isinstance(self.kind, Switch):
            return f"{self.flag}, --no-{self.flag[2:]}" if self.kind.negatable else self.flag
        if isinstance(self.kind, Choice):
            return f"{self.flag} {'|'.join(self.kind.words)}"
        return f"{self.flag} {self.metavar or self.kind.metavar or self.dest.upper()}"

    def show(self, value: Any) -> str:
        return "none" if value is None or value in ("", ()) else self.kind.show(value)

    def default_text(self) -> str:
        if self.shown:
            return self.shown
        text = self.show(self.default)
        return f"{text}; --node: {self.show(self.node)}" if self.node is not None else text

    def bounds(self, here: bool = False) -> str:
        """The range in words ("between 1 and 65535"); ``here``: a machine's bound as found on this one."""
        if self.positive:
            return "positive"
        if self.low is None:
            return ""
        high = self.high
        if high is None:
            return f"at least {self.show(self.low)}"
        if isinstance(high, MachineBound):
            return f"between {self.show(self.low)} and " + (f"{self.show(high.value())} ({high.text})" if here
                                                           else high.text)
        return f"between {self.show(self.low)} and {self.show(high)}"

    def check(self, value: Any) -> None:
        """``ValueError`` naming the flag if ``value`` is out of range."""
        if value is None or (self.low is None and not self.positive):
            return
        high = self.high.value() if isinstance(self.high, MachineBound) else self.high
        if value <= 0 if self.positive else value < self.low or (high is not None and value > high):
            raise ValueError(f"{self.flag} must be {self.bounds(here=True)}, not {self.show(value)}")

    def arguments(self) -> dict:
        """``add_argument``'s keywords. A field's flag defaults to ``None``: not given, the field
        keeps its own default (or takes its ``--node`` one)."""
        limits = self.bounds()
        note = f"default: {self.default_text()}" + (f"; {limits}" if limits else "")
        return {"default": None if self.owner else self.default, "help": f"{self.help} ({note})".replace("%", "%%"),
                **self.kind.arguments(self.metavar)}


def setting(default: Any = MISSING, *, factory: Any = MISSING, **described: Any) -> Any:
    """A field that a ``serve`` flag sets, described by ``Setting(**described)``."""
    return field(default=default, default_factory=factory, metadata={"setting": Setting(**described)})


@cache
def settings(cls: type) -> tuple[Setting, ...]:
    """The ``Setting`` of each field of dataclass ``cls`` that has one, in field order."""
    out = []
    for f in fields(cls):
        if (described := f.metadata.get("setting")) is not None:
            out.append(replace(described, name=f.name, owner=cls, flag=described.flag or "--" + f.name.replace("_", "-"),
                               default=f.default if f.default is not MISSING else f.default_factory()))
    return tuple(out)


# -- The settings ---------------------------------------------------------------------------

@dataclass(frozen=True)
class HedgePolicy:
    """When to send a second read for the same range."""

    quantile: float = setting(0.95, group=Group.STORE, kind=NUMBER, flag="--hedge-quantile",
                              help="hedge a read still running after this quantile of the recent read times")

    min_delay: float = setting(0.02, group=Group.STORE, kind=MILLISECONDS, flag="--hedge-min-ms", help=(
        "lower clamp of the deadline: never hedge sooner (a store answering in a few milliseconds gains "
        "nothing from a duplicate read)"))

    max_delay: float = setting(2.0, group=Group.STORE, kind=MILLISECONDS, flag="--hedge-max-ms", help=(
        "upper clamp of the deadline, and the deadline until enough reads have completed: a read stuck this "
        "long is hedged whatever the history says"))

    budget: float = setting(0.1, group=Group.STORE, kind=NUMBER, flag="--hedge-budget",
                            help="hedges allowed per store read, on average (a token bucket refilled by each read)")

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
    """Every setting of one service; a field with a ``Setting`` is set by the flag it names."""

    datasets: dict[str, str] = field(default_factory=dict)
    """Datasets served, ``{name: url}`` (``--dataset``); empty means the embedded default (see ``server.py``)."""

    index_objects: bool = setting(False, group=Group.DATASETS, kind=SWITCH, help=(
        "a --dataset without index.parquet is indexed at start as loose objects, one object per member "
        "(a/0001.jpg + a/0001.cls = one sample), from a listing of its prefix (datasets/layouts.py); without "
        "it, tar shards are indexed from their headers"))

    buckets: tuple[str, ...] = setting((), group=Group.DATASETS, kind=Repeated("NAME"), flag="--bucket", help=(
        "let GetBatch (/v1/ml/moss, the AIStore SDK's batch API) read this S3 bucket, on the S3 endpoint of "
        "the AWS settings; repeatable. Any other bucket is refused (403), never read with the service's "
        "credentials"))

    object_ttl: float = setting(60.0, group=Group.DATASETS, kind=SECONDS, low=0, high=7 * DAY, help=(
        "how long a GetBatch object's HEAD (its size and version) is trusted: an object overwritten in the "
        "store is read at its new version within this time, sooner if a read finds it replaced; 0: a HEAD for "
        "every object of every request. (A served dataset is listed when it opens, and on "
        "POST /v1/datasets/{name}/reload or SIGHUP.)"))

    host: str = setting("127.0.0.1", group=Group.SERVICE, kind=TEXT,
                        help="interface to bind: loopback unless told otherwise, for exposing a data service "
                             "is a decision")

    port: int = setting(8080, group=Group.SERVICE, kind=INT, low=0, high=65535, node=0,
                        help="port to listen on; 0: any free one")

    node: bool = setting(False, group=Group.SERVICE, kind=SWITCH, help=(
        "be the node service, the one training scripts that name only a dataset URL find, and start when there "
        "is none (shardfeed/node.py): no dataset at start, any free port, the cache under ~/.cache/shardfeed, "
        "a token of its own (in its address file, which only its user reads), "
        f"--idle-exit {NODE_IDLE_EXIT:g}; listed by `shardfeed ps`"))

    idle_exit: float = setting(0.0, group=Group.SERVICE, kind=SECONDS, low=0, high=365 * DAY, node=NODE_IDLE_EXIT,
                               help="stop as on SIGTERM after this long without a data request (health checks, "
                                    "metrics and the status page do not count); 0: never")

    workers: int = setting(factory=usable_cores, group=Group.SERVICE, kind=INT, metavar="N", low=1, high=MachineBound(
        f"{MAX_WORKERS_PER_CORE} per usable core", lambda: MAX_WORKERS_PER_CORE * usable_cores()),
        shown="one per usable core", help=(
            "processes serving this host (cluster/workers.py), all accepting on --port, each owning a rendezvous "
            "share of the shards and --cache-size / N of the cache; 1 serves from this process alone"))

    worker: WorkerPlace | None = None
    """This process's place among the workers; ``None`` outside ``--workers`` (N > 1)."""

    restart_pause: float = setting(0.1, group=Group.SERVICE, kind=SECONDS, low=0.01, high=3600, help=(
        "pause before a dead worker is restarted, doubling while it keeps dying (up to 10 s, or this if "
        "longer; at least 0.01 s, so that the pause can grow); meanwhile its siblings serve its shards, from "
        "its slabs where they are, else from the store"))

    cache_dir: Path = setting(Path(".shardfeed/cache"), group=Group.CACHE, kind=PATH, node=node_cache_dir,
                              shown=".shardfeed/cache; --node: $XDG_CACHE_HOME/shardfeed/cache "
                                    "(~/.cache/shardfeed/cache), kept across its restarts",
                              help="block cache directory, ideally on local NVMe; one service process per "
                                   "directory")

    cache_size: int = setting(10 * GiB, group=Group.CACHE, kind=SIZE, help=(
        "most bytes the block cache keeps on disk, e.g. 500GiB; the least recently used blocks are evicted"))

    memory_cache: int = setting(factory=default_memory_cache, group=Group.CACHE, kind=SIZE, low=0,
                                high=MachineBound("the machine's RAM", machine_memory),
                                shown="1GiB, or 1/8 of the RAM on a small machine", help=(
        "most bytes of verified blocks kept in RAM in front of the disk cache (cache/memtier.py): a hot block "
        "is checked once, then served from memory without a thread hop; 0 disables it"))

    direct_writes: bool = setting(True, group=Group.CACHE, flag="--cache-writes",
                                  kind=Choice({"direct": True, "buffered": False}), help=(
        "direct: blocks are written, and read 64 KiB or more at a time, around the page cache (O_DIRECT) "
        "where the filesystem allows, through it where it refuses: the RAM tier holds the hot blocks, so the "
        "page cache would hold them twice, and filling it costs kernel CPU (docs/benchmarks.md); buffered: "
        "always through the page cache"))

    block_size: int = setting(1 * MiB, group=Group.CACHE, kind=SIZE, low=4 * KiB, high=GiB, help=(
        "unit of caching and of store reads: shards are fetched in aligned blocks of this size. Larger blocks "
        "mean fewer store requests on a cold cache, more bytes read when only a few samples of a block are "
        "wanted"))

    merge_gap: int = setting(1 * MiB, group=Group.READS, kind=SIZE, low=0, high=TiB, help=(
        "missing blocks of one shard at most this many bytes apart are fetched in one ranged read (the gap is "
        "fetched and cached too): a request saved for a few bytes more"))

    fetch_window: int = setting(8 * MiB, group=Group.READS, kind=SIZE, low=0, high=GiB, help=(
        "a miss in a dataset the cache can hold whole also fetches the missing blocks of its aligned window "
        "of this many bytes of the shard, in the same read: an epoch will want them before anything evicts "
        "them, and one larger read costs the store much less than several (S3 advises ranges of 8-16 MB). "
        "A dataset larger than the cache, and GetBatch's objects, are read block by block; --block-size or "
        "less (0): only the blocks asked for"))

    max_fetch: int = 16 * MiB
    """Largest single ranged read; longer runs of blocks are split."""

    ranges_first: bool = setting(False, group=Group.READS, kind=ON_OFF, help=(
        "on: a read that needs an eighth of a block or less, of a block neither cached nor being read, reads "
        "just its members' byte ranges (merged within --range-gap) and fetches the block whole behind it, "
        "into the cache: a batch waits for its own bytes, not for whole blocks or their fetch windows. Off by "
        "default: a faster first cold batch, but a slower cold epoch that reads a little more of the shards "
        "(docs/benchmarks.md, \"Ranges first\")"))

    max_store_requests: int = setting(32, group=Group.READS, kind=INT, low=1, high=1 << 16,
                                      help="store reads in flight at once, across all requests (the store's "
                                           "connection pool)")

    sample_window: float = setting(0.001, group=Group.REQUESTS, kind=MILLISECONDS, flag="--sample-window-ms",
                                   low=0, high=1, help="how long a per-sample GET waits for others to arrive, "
                                                       "so that their reads are coalesced")

    group_bytes: int = 4 * MiB
    """A batch is resolved and sent in groups of about this many payload bytes; the first
    group goes out while later ones are still being read. Each group costs a thread hop to
    the disk and a pass through the read path: at 1 MiB, a group of one 1 MiB sample spent
    0.9-1.3 ms of service CPU per MiB served warm from disk, at 4 MiB 0.73-0.77
    (``python -m shardfeed.benchmarks.servecost --configurations disk``)."""

    prefetch_groups: int = 3
    """Groups of one batch being read ahead of the one being sent. With ``group_bytes``
    this bounds the memory of a request; a slow client holds at most this much."""

    max_batch: int = setting(16384, group=Group.REQUESTS, kind=INT, low=1, high=1 << 24,
                             help="most samples in one POST /v1/batch; 413 beyond")

    max_body: int = 2 * MiB
    """Largest request body accepted (413 beyond)."""

    max_inflight_batches: int = setting(128, group=Group.REQUESTS, kind=INT, low=1, high=1 << 20,
                                        help="batch requests served at once; more are refused with 429 and "
                                             "Retry-After")

    max_inflight_samples: int = setting(8192, group=Group.REQUESTS, kind=INT, low=1, high=1 << 24,
                                        help="per-sample GETs served at once; more are refused with 429 and "
                                             "Retry-After")

    tokens: frozenset[str] = frozenset()
    """Bearer tokens with full access (``--token-file``, ``SHARDFEED_TOKENS``); with no
    ``tenant_file`` either, authentication is off."""

    tenant_file: Path | None = setting(None, group=Group.ACCESS, kind=PATH, flag="--tokens", metavar="FILE", help=(
        "tenants: named tokens with scopes and their own bound on batches in flight, in a TOML file read "
        "again when it changes (api/tenants.py)"))

    tls_cert: Path | None = setting(None, group=Group.ACCESS, kind=PATH,
                                    help="serve HTTPS with this PEM certificate; needs --tls-key")

    tls_key: Path | None = setting(None, group=Group.ACCESS, kind=PATH, help="private key (PEM) for --tls-cert")

    node_id: str | None = setting(None, group=Group.REPLICAS, kind=TEXT, help=(
        "this replica's id among --peers: its host name, first DNS label, URL, or ID= name"))

    peers: str = setting("", group=Group.REPLICAS, kind=TEXT, help=(
        "every replica, this one included: URL,URL,... or ID=URL,...; shards are owned by rendezvous hashing "
        "over the live peers, each cached on one replica; none: a single node"))

    peers_from: str = setting("", group=Group.REPLICAS, kind=TEXT, metavar="SOURCE", help=(
        "where the replicas are listed, followed as they change (cluster/sources.py), instead of --peers: "
        "file:PATH (one --peers entry a line), dns:NAME[:PORT] (A/AAAA records) or dns+srv:NAME (SRV "
        "records), either DNS one with @SERVER[:PORT] to pick the nameserver"))

    peers_refresh: float = setting(2.0, group=Group.REPLICAS, kind=SECONDS, low=0.05, high=3600, help=(
        "how long between two looks at --peers-from (a file's modification time, a DNS query)"))

    peer_timeout: float = setting(2.0, group=Group.REPLICAS, kind=SECONDS, positive=True, help=(
        "how long an owner has to answer a sub-batch (plus 1 s per 50 MB) before this replica reads those "
        "samples from the store itself"))

    store_options: dict = field(default_factory=dict)
    """Passed to the store backends (timeouts, pool size, retries: ``--store-timeout``,
    ``--store-first-byte-timeout``, ``--store-progress-timeout``, ``--store-retries``)."""

    hedge: HedgePolicy | None = setting(factory=HedgePolicy, group=Group.STORE, kind=Switch(negatable=True), help=(
        "hedged store reads (stores/hedge.py): a range read slower than most recent ones gets a second, "
        "identical read, and the first answer wins"))

    # -- Plans (``service/plans/``): clients announce their order; the service reads ahead
    #    along it and evicts the block used farthest in the future.
    max_plans: int = setting(64, group=Group.PLANS, kind=INT, low=0, high=1 << 16, help=(
        "plans (announced read orders) held at once, all datasets together, one per rank and epoch; 429 "
        "beyond"))

    max_plan_samples: int = setting(1 << 22, group=Group.PLANS, kind=INT, low=1, high=1 << 31, help=(
        "most positions in one plan; 413 beyond. A plan holds about 26 bytes per position, its dataset's "
        "block geometry 12 bytes per sample, and registering one takes time in n log n (docs/benchmarks.md, "
        "\"Scale\")"))

    plan_ttl: float = setting(600.0, group=Group.PLANS, kind=SECONDS, low=1, high=7 * DAY, help=(
        "how long a plan lives after its last registration or use; a client whose plan is gone registers it "
        "again (GET answers 404)"))

    plan_ahead: int = setting(64 * MiB, group=Group.PLANS, kind=SIZE, low=0, high=TiB, help=(
        "payload bytes of samples read ahead of each plan's reader, into the cache (whole blocks) or memory "
        "(sample ranges); also capped by what the cache can keep"))

    plan_memory: int = setting(256 * MiB, group=Group.PLANS, kind=SIZE, low=0, high=TiB,
                               help="most bytes of sample ranges read ahead and held in memory, all plans together")

    range_gap: int = setting(16 * KiB, group=Group.PLANS, kind=SIZE, low=0, high=GiB, help=(
        "sample ranges read without their block (a block none of whose other samples the plans read before "
        "it would be evicted) are merged into one read when this close"))

    # -- Transforms (``service/transform/``): the operator's preprocessing, run in a process pool.
    transforms: tuple[str, ...] = setting((), group=Group.TRANSFORMS, kind=Repeated("NAME=MODULE:FACTORY",
                                          parse=transform_argument), flag="--transform", help=(
        "serve the transform the factory makes (a shardfeed.transforms.Transform, the module importable by the "
        "service) as NAME ([a-z0-9_]{1,64}), for POST /v1/batch's \"transform\"; repeatable. Its prepare "
        "output is cached in the block cache (docs/transforms.md)"))

    transform_processes: int = setting(factory=usable_cores, group=Group.TRANSFORMS, kind=INT, metavar="N", low=1,
                                       high=1 << 12, shown="one per usable core", help=(
        "processes running transforms, all workers together (each of --workers N runs N-th of them, at least "
        "one); started only when a --transform is served"))

    transform_timeout: float = setting(30.0, group=Group.TRANSFORMS, kind=SECONDS, positive=True, help=(
        "longest a sample's transform may run: past it, its process is killed and replaced and the sample "
        "fails (a null row with continue_on_error, else 422 transform_failed)"))

    @property
    def index_dir(self) -> Path:
        """Where indexes the service made for tar shards are kept when the store is read-only
        (``datasets/autoindex.py``): beside the block cache (every worker's, with ``--workers``)."""
        root = self.worker.cache_dirs[0].parent if self.worker is not None else self.cache_dir
        return root / "indexes"

    def __post_init__(self) -> None:
        for described in settings(ServiceConfig):
            described.check(getattr(self, described.name))
        transform_specs(self.transforms)  # a name given twice
        for bucket in self.buckets:
            if not _BUCKET.fullmatch(bucket):
                raise ValueError(f"--bucket {bucket!r} is not an S3 bucket name")


OPTIONS = (
    Setting(Group.DATASETS, "serve the dataset at URL (file:// or s3://) as NAME; repeatable", Repeated("NAME=URL"),
            flag="--dataset", shown="the embedded digits dataset under --data-dir"),
    Setting(Group.DATASETS, "where the embedded default dataset (scikit-learn's digits) is seeded and found",
            PATH, flag="--data-dir", default=DEFAULT_DATA_DIR),
    Setting(Group.STORE, "longest silence while reading from S3, per try", SECONDS, flag="--store-timeout",
            positive=True, shown="30 s"),
    Setting(Group.STORE, "longest wait for the first byte of a ranged read's answer from S3, per try (at most "
            "--store-timeout): a read gone silent is asked again, on another connection", SECONDS,
            flag="--store-first-byte-timeout", positive=True, shown="3 s"),
    Setting(Group.STORE, "longest silence in a ranged read's answer from S3 once it began, per try (at most "
            "--store-timeout); then it is asked again, on another connection", SECONDS,
            flag="--store-progress-timeout", positive=True, shown="2 s"),
    Setting(Group.STORE, "retries of an S3 request that failed with 5xx, SlowDown, a reset, a timeout or a "
            "short body", INT, flag="--store-retries", metavar="N", low=0, shown=str(Backoff().attempts - 1)),
    Setting(Group.ACCESS, "require 'Authorization: Bearer TOKEN': tokens with full access, one a line in this "
            "file (or SHARDFEED_TOKENS, comma-separated); with no --tokens either, authentication is off", PATH,
            flag="--token-file"),
    Setting(Group.LOG, "what the service logs", Choice({level: level for level in ("debug", "info", "warning",
            "error")}), flag="--log-level", default="info"),
    Setting(Group.LOG, "append the log to this file instead of stderr (`shardfeed ps` shows it)", TEXT,
            flag="--log-file"),
)
"""The flags of ``serve`` that set no single field: ``server.config_from_args`` reads them."""


def serve_settings() -> list[Setting]:
    """Every flag of ``shardfeed serve``, group by group."""
    order = list(Group)
    return sorted([*OPTIONS, *settings(ServiceConfig), *settings(HedgePolicy)], key=lambda s: order.index(s.group))


SETTINGS_PAGE = """\
# Settings of `shardfeed serve`

Every flag of `shardfeed serve`, in the groups of `shardfeed serve --help`. This page is made
from the settings of `ServiceConfig` (`service/config.py`), where each is described once:
after changing one, run `python -m shardfeed.service.config > docs/settings.md` (a test fails
while the two differ).

Sizes accept `10KiB`, `64MiB`, `20GiB` (powers of 1024) or `1.5GB` (powers of 1000). The S3
endpoint and credentials come from the standard AWS settings (`AWS_ENDPOINT_URL`,
`AWS_ACCESS_KEY_ID`, `AWS_PROFILE`, ...). A value out of range is refused at start, naming
its flag.
"""


def render_settings_table() -> str:
    """docs/settings.md: ``SETTINGS_PAGE``, then a table of flags per group."""
    lines = [SETTINGS_PAGE]
    for group, members in groupby(serve_settings(), key=lambda s: s.group):
        lines += [f"## {group.value[0].upper()}{group.value[1:]}", "", "| flag | default | range | what it does |",
                  "|---|---|---|---|"]
        for s in members:
            limits = s.bounds()
            cells = [f"`{s.usage()}`", s.default_text(), limits, s.help]
            lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.stdout.write(render_settings_table())
