"""``shardfeed serve``: open the datasets and the cache, then run the API under uvicorn.

With no ``--dataset`` it serves the embedded default: scikit-learn's bundled digits,
seeded into a local directory on first run, so ``shardfeed serve`` works on a fresh
machine with no S3 at all.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import re
import secrets
import socket
import sys
from dataclasses import replace
from functools import partial
from pathlib import Path

from shardfeed.node import announce, node_service, remove_record
from shardfeed.retry import Backoff
from shardfeed.service.api.tenants import full_access_tokens, load_tenants
from shardfeed.service.cluster.membership import build_cluster
from shardfeed.service.cluster.sources import open_source
from shardfeed.service.cluster.workers import run_serving, supervise, worker_sockets
from shardfeed.service.config import NODE_IDLE_EXIT, HedgePolicy, ServiceConfig, node_cache_dir
from shardfeed.service.observe.activity import Activity
from shardfeed.service.stores.hedge import Hedger
from shardfeed.sizes import format_size, parse_size

log = logging.getLogger("shardfeed.server")

DEFAULT_DATASET = "digits"
DEFAULT_DATA_DIR = Path(".shardfeed/datasets")
_BUCKET = re.compile(r"[a-z0-9][a-z0-9.\-_]{1,253}[a-z0-9]")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = ServiceConfig()
    parser.add_argument("--host", default=defaults.host, help="interface to bind (default: %(default)s)")
    parser.add_argument("--port", type=int, help=f"port; 0: any free one (default: {defaults.port}, "
                                                  "with --node 0)")
    parser.add_argument("--node", action="store_true",
                        help="be the node service, which training scripts that name only a dataset URL "
                             "find (and start when there is none): no dataset at start, any free port, "
                             "the cache under ~/.cache/shardfeed, a token of its own, --idle-exit "
                             f"{NODE_IDLE_EXIT:g}; listed by `shardfeed ps`")
    parser.add_argument("--idle-exit", type=float, metavar="SECONDS",
                        help="stop after this long without a data request (health checks, metrics "
                             f"and the status page do not count); 0: never (default: 0, with --node "
                             f"{NODE_IDLE_EXIT:g})")
    parser.add_argument("--workers", type=int, default=defaults.workers, metavar="N",
                        help="processes serving this host, all on --port, each owning a share of the "
                             "shards and of --cache-size; 1 serves from one process (default: the "
                             "usable cores, %(default)s)")
    parser.add_argument("--restart-pause", type=float, default=defaults.restart_pause, metavar="SECONDS",
                        help="pause before a dead worker is restarted, doubling while it keeps dying, "
                             "up to 10 s or this (default: %(default)s)")
    parser.add_argument("--dataset", action="append", default=[], metavar="NAME=URL",
                        help="serve the dataset at URL (file:// or s3://) as NAME; repeatable. "
                             "Default: the embedded digits dataset under --data-dir")
    parser.add_argument("--index-objects", action="store_true",
                        help="index a --dataset that has no index.parquet at start, as loose objects "
                             "(a/0001.jpg + a/0001.cls = one sample), listing its prefix")
    parser.add_argument("--bucket", action="append", default=[], metavar="NAME",
                        help="let GetBatch (/v1/ml/moss, the AIStore SDK's batch API) read this S3 bucket; "
                             "repeatable. Other buckets are refused")
    parser.add_argument("--object-ttl", type=float, default=defaults.object_ttl, metavar="SECONDS",
                        help="trust a GetBatch object's size and version (its HEAD) this long: an "
                             "overwritten object is read anew within it; 0: a HEAD per request "
                             "(default: %(default)s)")
    parser.add_argument("--data-dir", type=Path, default=DEFAULT_DATA_DIR,
                        help="where the embedded default dataset lives (default: %(default)s)")
    parser.add_argument("--cache-dir", type=Path,
                        help=f"block cache directory, ideally local NVMe (default: {defaults.cache_dir}, "
                             f"with --node {node_cache_dir()})")
    parser.add_argument("--cache-size", type=parse_size, default=defaults.cache_size,
                        help="most bytes the block cache keeps, e.g. 20GiB (default: 10GiB)")
    parser.add_argument("--memory-cache", type=parse_size, default=defaults.memory_cache,
                        help="most bytes of verified blocks kept in RAM in front of the disk cache; "
                             "0 disables it (default: 1GiB, at most 1/8 of the RAM)")
    parser.add_argument("--cache-writes", choices=["direct", "buffered"], default="direct",
                        help="write cache blocks around the page cache (O_DIRECT, where the "
                             "filesystem allows) or through it (default: direct)")
    parser.add_argument("--block-size", type=parse_size, default=defaults.block_size,
                        help="cache block and store read unit (default: 1MiB)")
    parser.add_argument("--merge-gap", type=parse_size, default=defaults.merge_gap,
                        help="fetch missing blocks this close together in one read (default: 1MiB)")
    parser.add_argument("--fetch-window", type=parse_size, default=defaults.fetch_window,
                        help="a miss in a dataset the cache holds whole fetches its aligned window "
                             "of this many shard bytes in one read (default: 8MiB)")
    parser.add_argument("--ranges-first", choices=["on", "off"], default="off",
                        help="on: a read needing an eighth of an uncached block or less reads its members' ranges, "
                             "the block fetched behind (a faster first cold batch, a slower cold epoch; default: off)")
    parser.add_argument("--max-store-requests", type=int, default=defaults.max_store_requests,
                        help="store reads in flight at once (default: %(default)s)")
    parser.add_argument("--store-timeout", type=float, metavar="SECONDS",
                        help="longest silence while reading from S3, per try (default: 30)")
    parser.add_argument("--store-retries", type=int, metavar="N", help="retries of an S3 request that failed "
                        "with 5xx, SlowDown, a reset, a timeout or a short body (default: 4)")
    hedge = HedgePolicy()
    parser.add_argument("--hedge", action=argparse.BooleanOptionalAction, default=True,
                        help="send a second read for a store read slower than most recent ones (default: on)")
    parser.add_argument("--hedge-quantile", type=float, default=hedge.quantile, help="hedge a read still "
                        "running after this quantile of recent read times (default: %(default)s)")
    parser.add_argument("--hedge-min-ms", type=float, default=hedge.min_delay * 1e3,
                        help="never hedge sooner than this (default: %(default)s)")
    parser.add_argument("--hedge-max-ms", type=float, default=hedge.max_delay * 1e3,
                        help="always hedge a read this slow (default: %(default)s)")
    parser.add_argument("--hedge-budget", type=float, default=hedge.budget,
                        help="hedges per store read at most, on average (default: %(default)s)")
    parser.add_argument("--sample-window-ms", type=float, default=defaults.sample_window * 1e3,
                        help="how long a per-sample GET waits to be coalesced with others (default: 1)")
    parser.add_argument("--max-batch", type=int, default=defaults.max_batch,
                        help="most samples per batch request (default: %(default)s)")
    parser.add_argument("--max-inflight-batches", type=int, default=defaults.max_inflight_batches,
                        help="batch requests served at once before answering 429 (default: %(default)s)")
    parser.add_argument("--max-inflight-samples", type=int, default=defaults.max_inflight_samples,
                        help="per-sample GETs served at once before answering 429 (default: %(default)s)")
    parser.add_argument("--max-plans", type=int, default=defaults.max_plans,
                        help="plans (announced read orders) held at once; 429 beyond (default: %(default)s)")
    parser.add_argument("--max-plan-samples", type=int, default=defaults.max_plan_samples,
                        help="most positions in one plan; 413 beyond (default: %(default)s)")
    parser.add_argument("--plan-ttl", type=float, default=defaults.plan_ttl, metavar="SECONDS",
                        help="a plan unused this long is dropped (default: %(default)s)")
    parser.add_argument("--plan-ahead", type=parse_size, default=defaults.plan_ahead,
                        help="payload bytes read ahead of each plan's reader (default: "
                             f"{format_size(defaults.plan_ahead)})")
    parser.add_argument("--plan-memory", type=parse_size, default=defaults.plan_memory,
                        help="most bytes of sample ranges read ahead and held in memory (default: "
                             f"{format_size(defaults.plan_memory)})")
    parser.add_argument("--range-gap", type=parse_size, default=defaults.range_gap,
                        help="sample ranges read without their block are merged when this close "
                             f"(default: {format_size(defaults.range_gap)})")
    parser.add_argument("--token-file", type=Path,
                        help="require 'Authorization: Bearer <token>', tokens with full access one per line "
                             "in this file (or set SHARDFEED_TOKENS, comma-separated)")
    parser.add_argument("--tokens", type=Path, metavar="FILE", help="tenants: named tokens with scopes and their "
                        "own bound on batches in flight, in a TOML file read again when it changes (see README)")
    parser.add_argument("--node-id", help="this replica's id among its peers (e.g. its host name)")
    parser.add_argument("--peers", default="", help="all replicas, this one included: URL,URL,... or ID=URL,...; "
                        "shards are owned by rendezvous hashing and each is cached on one replica")
    parser.add_argument("--peers-from", default="", metavar="SOURCE", help="the replicas, followed as they "
                        "change: file:PATH (one --peers entry a line), dns:NAME[:PORT] (A/AAAA records) or "
                        "dns+srv:NAME (SRV records), either DNS one with @SERVER[:PORT] to pick the nameserver")
    parser.add_argument("--peers-refresh", type=float, default=defaults.peers_refresh, metavar="SECONDS",
                        help="seconds between looks at --peers-from (default: %(default)s)")
    parser.add_argument("--peer-timeout", type=float, default=defaults.peer_timeout, help="seconds an owner "
                        "has to answer before the store is read directly (default: %(default)s)")
    parser.add_argument("--tls-cert", type=Path, help="serve HTTPS with this certificate (PEM); needs --tls-key")
    parser.add_argument("--tls-key", type=Path, help="private key (PEM) for --tls-cert")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    parser.add_argument("--log-file", help="append the log to this file instead of stderr (`shardfeed ps` "
                                           "shows it)")


def _check_ranges(args: argparse.Namespace) -> None:
    """Refuse knob values that would make the service misbehave, naming the flag."""
    limits = [
        ("--port", args.port or 0, 0, 65535),
        ("--block-size", args.block_size, 4096, 1 << 30),
        ("--merge-gap", args.merge_gap, 0, 1 << 40),
        ("--fetch-window", args.fetch_window, 0, 1 << 30),
        ("--max-store-requests", args.max_store_requests, 1, 1 << 16),
        ("--sample-window-ms", args.sample_window_ms, 0, 1000),
        ("--max-batch", args.max_batch, 1, 1 << 24),
        ("--max-inflight-batches", args.max_inflight_batches, 1, 1 << 20),
        ("--max-inflight-samples", args.max_inflight_samples, 1, 1 << 24),
    ]
    for flag, value, low, high in limits:
        if not low <= value <= high:
            raise ValueError(f"{flag} must be between {low} and {high}, not {value}")
    if args.peer_timeout <= 0:
        raise ValueError(f"--peer-timeout must be positive, not {args.peer_timeout}")


def config_from_args(args: argparse.Namespace) -> ServiceConfig:
    _check_ranges(args)
    datasets = {}
    for spec in args.dataset:
        name, sep, url = spec.partition("=")
        if not sep or not name or not url:
            raise ValueError(f"--dataset expects NAME=URL, got {spec!r}")
        if name in datasets:
            raise ValueError(f"dataset name {name!r} given twice")
        datasets[name] = url
    for bucket in args.bucket:
        if not _BUCKET.fullmatch(bucket):
            raise ValueError(f"--bucket {bucket!r} is not an S3 bucket name")
    tokens = set(full_access_tokens(args.token_file, os.environ.get("SHARDFEED_TOKENS", "")))
    load_tenants(args.tokens, tokens, args.max_inflight_batches)  # a bad file fails now, with its message
    if args.tokens and (args.peers or args.peers_from) and not tokens:
        raise ValueError(f"--tokens with {'--peers' if args.peers else '--peers-from'} needs a full-access token "
                         "that the replicas share for their requests to each other (--token-file or SHARDFEED_TOKENS)")
    if bool(args.tls_cert) != bool(args.tls_key):
        raise ValueError("--tls-cert and --tls-key go together")
    for path in (args.tls_cert, args.tls_key):
        if path is not None and not path.is_file():
            raise ValueError(f"TLS file {path} does not exist")
    store_options: dict = {}
    if args.store_timeout is not None:
        if args.store_timeout <= 0:
            raise ValueError(f"--store-timeout must be positive, not {args.store_timeout}")
        store_options["read_timeout"] = args.store_timeout
    if args.store_retries is not None:
        if args.store_retries < 0:
            raise ValueError(f"--store-retries must not be negative, not {args.store_retries}")
        store_options["backoff"] = Backoff(attempts=args.store_retries + 1)
    hedge = HedgePolicy(quantile=args.hedge_quantile, min_delay=args.hedge_min_ms / 1e3,
                        max_delay=args.hedge_max_ms / 1e3, budget=args.hedge_budget) if args.hedge else None
    if (args.node or args.tokens) and not tokens:  # --node: only ours may read; --tokens: the workers' own
        tokens = {secrets.token_urlsafe(24)}
    defaults = ServiceConfig()
    config = ServiceConfig(
        node=args.node, idle_exit=(args.idle_exit if args.idle_exit is not None
                                   else NODE_IDLE_EXIT if args.node else defaults.idle_exit),
        store_options=store_options, hedge=hedge,
        datasets=datasets, index_objects=args.index_objects, buckets=tuple(dict.fromkeys(args.bucket)),
        object_ttl=args.object_ttl,
        host=args.host, port=args.port if args.port is not None else 0 if args.node else defaults.port,
        cache_dir=args.cache_dir or (node_cache_dir() if args.node else defaults.cache_dir),
        cache_size=args.cache_size,
        memory_cache=args.memory_cache, direct_writes=args.cache_writes == "direct",
        block_size=args.block_size, merge_gap=args.merge_gap,
        fetch_window=args.fetch_window, ranges_first=args.ranges_first == "on",
        max_store_requests=args.max_store_requests, sample_window=args.sample_window_ms / 1e3,
        max_batch=args.max_batch, max_inflight_batches=args.max_inflight_batches,
        max_inflight_samples=args.max_inflight_samples, tokens=frozenset(tokens), tenant_file=args.tokens,
        tls_cert=args.tls_cert, tls_key=args.tls_key, node_id=args.node_id, peers=args.peers,
        peers_from=args.peers_from, peers_refresh=args.peers_refresh,
        peer_timeout=args.peer_timeout, workers=args.workers, restart_pause=args.restart_pause,
        max_plans=args.max_plans, max_plan_samples=args.max_plan_samples, plan_ttl=args.plan_ttl,
        plan_ahead=args.plan_ahead, plan_memory=args.plan_memory, range_gap=args.range_gap,
    )
    open_source(config)  # fail now on a bad --peers or --peers-from, with its message
    return config


async def ensure_default_dataset(data_dir: Path) -> str:
    """The embedded default dataset's URL, seeding it first if it is not there yet."""
    from shardfeed.seeds.digits import seed_digits
    from shardfeed.service.datasets.indexfile import INDEX_FILE
    from shardfeed.service.stores import open_store

    root = (data_dir / DEFAULT_DATASET).resolve()
    url = root.as_uri()
    if not (root / INDEX_FILE).exists():
        log.info("seeding the embedded default dataset into %s", root)
        root.mkdir(parents=True, exist_ok=True)
        async with open_store(url) as store:
            await seed_digits(store)
    return url


async def serve(config: ServiceConfig, data_dir: Path = DEFAULT_DATA_DIR, log_level: str = "info", *,
                activity: Activity | None = None, sockets: list[socket.socket] | None = None) -> None:
    """Serve until SIGTERM (or ``config.idle_exit``, for a lone service: a supervisor watches
    its workers' ``activity`` itself); ``sockets``: a lone service's, bound already."""
    import uvicorn

    from shardfeed.service.api import create_app
    from shardfeed.service.cache.disk import BlockCache
    from shardfeed.service.cache.memtier import MemoryTier
    from shardfeed.service.cluster.keptcounters import restore_series
    from shardfeed.service.datasets.indexfile import IndexFormatError
    from shardfeed.service.datasets.served import Opener, ServedDatasets, read_registry
    from shardfeed.service.http.protocol import BoundedHeadProtocol
    from shardfeed.service.observe.metrics import Metrics
    from shardfeed.service.plans.registry import Plans
    from shardfeed.service.stores import StoreError, open_store

    if not config.datasets and not config.buckets and not config.node:
        config = replace(config, datasets={DEFAULT_DATASET: await ensure_default_dataset(data_dir)})
    place = config.worker
    registry = place.registry if place is not None else None
    registered = read_registry(registry) if registry is not None else {}  # a restarted worker's
    metrics = Metrics()
    if place is not None:  # a restarted worker: its predecessor's counters count on (workers.py)
        await asyncio.to_thread(restore_series, metrics, place.counter_dirs[place.index])
    cluster = await build_cluster(config, metrics)
    # Routed clients send each node its own part of a batch.
    plans = Plans(config, metrics, parts=(lambda: 1) if cluster is None
                  else (lambda: len(cluster.workers) * len(cluster.hosts)))
    memory = MemoryTier(config.memory_cache, metrics, config.block_size) if config.memory_cache else None
    cache = BlockCache(config.cache_dir, config.cache_size, config.block_size, metrics,
                       direct_writes=config.direct_writes, victims=plans,
                       on_forget=memory.discard if memory is not None else None)
    await asyncio.to_thread(cache.open)
    opened: dict = {}
    hedger = Hedger(config.hedge, metrics.registry) if config.hedge else None
    opener = Opener.of(config, wrap=hedger.wrap if hedger is not None else None)
    buckets = {}
    try:
        for bucket in config.buckets:
            buckets[bucket] = opener.wrap(open_store(f"s3://{bucket}", **config.store_options))
        for name, url in {**config.datasets, **registered}.items():
            try:
                opened[name] = await opener(name, url)
            except (StoreError, IndexFormatError) as err:
                if name not in registered:
                    raise
                # Its siblings serve it; stopping this worker (and so the service) for it would not help.
                log.warning("dataset %s (registered at runtime) not opened: %s", name, err)
                continue
            log.info("dataset %s: %s (%d samples, %d shards, version %s)", name, url, len(opened[name].index),
                     len(opened[name].index.shards), opened[name].version)
        datasets = ServedDatasets(opened, cache, opener, registry)
        await asyncio.to_thread(datasets.retain_cached)  # blocks of versions the store no longer holds
        app = create_app(config, datasets, cache, memory, plans, metrics, cluster, buckets)
        activity = activity or Activity()
        slot = place.index if place is not None else 0
        server = uvicorn.Server(uvicorn.Config(
            app, host=config.host, port=config.port, log_level=log_level, access_log=False,
            timeout_graceful_shutdown=30, timeout_keep_alive=30, limit_concurrency=None,
            h11_max_incomplete_event_size=64 * 1024,
            http=partial(BoundedHeadProtocol, instant=app.instant, on_request=partial(activity.touch, slot)),
            ssl_certfile=config.tls_cert, ssl_keyfile=config.tls_key,
        ))
        activity.touch(slot, "")  # idle from now: a slow start is not idleness
        watch = asyncio.create_task(_exit_when_idle(server, config, activity)) \
            if config.idle_exit and place is None else None
        try:
            await server.serve(sockets=await worker_sockets(config) if place is not None else sockets)
        finally:
            if watch is not None:
                watch.cancel()
    finally:
        for store in [*(d.store for d in opened.values()), *buckets.values()]:
            await store.close()
        cache.close()


async def _exit_when_idle(server, config: ServiceConfig, activity: Activity) -> None:
    while (idle := activity.idle()) < config.idle_exit:
        await asyncio.sleep(min(1.0, config.idle_exit - idle))
    log.info("no data request for %.0f s (--idle-exit %g): exiting", idle, config.idle_exit)
    server.should_exit = True


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s %(message)s",
                        **({"filename": args.log_file} if args.log_file else {"stream": sys.stderr}))
    # botocore's debug output holds each request's signature and canonical request (with
    # any session token): never let it reach the log, whatever the level.
    logging.getLogger("botocore").setLevel(max(logging.getLogger().level, logging.INFO))
    config = config_from_args(args)
    if config.node and (other := node_service()) is not None:
        raise ValueError(f"this node already has a node service: pid {other.pid} at {other.url} "
                         "(`shardfeed stop` stops it)")
    activity = Activity(config.workers)
    try:
        if config.workers > 1:
            if not config.datasets and not config.node:  # seed it once, before the workers race to
                config = replace(config, datasets={DEFAULT_DATASET: asyncio.run(ensure_default_dataset(args.data_dir))})
            return supervise(config, lambda worker: serve_one(worker, args.data_dir, args.log_level, activity),
                             activity, announce=partial(_announce, config, args.log_file))
        sock = _listening(config)
        config = replace(config, port=sock.getsockname()[1])
        _announce(config, args.log_file, config.port)
        serve_one(config, args.data_dir, args.log_level, activity, [sock])
        return 0
    finally:
        remove_record(os.getpid())


def _listening(config: ServiceConfig) -> socket.socket:
    """A lone service's socket, bound and listening now: its port is known (``--port 0``), and a
    client that connects before the app is up waits instead of being refused."""
    family = socket.AF_INET6 if ":" in config.host else socket.AF_INET
    try:
        return socket.create_server((config.host, config.port), family=family, backlog=2048)
    except OSError as err:
        raise ValueError(f"cannot bind {config.host}:{config.port}: {err.strerror}") from None


def _announce(config: ServiceConfig, log_file: str | None, port: int) -> None:
    """Leave this service's address in the node's run directory (``shardfeed ps``)."""
    host = "127.0.0.1" if config.host in ("0.0.0.0", "::", "") else config.host
    host = f"[{host}]" if ":" in host else host
    announce(f"{'https' if config.tls_cert else 'http'}://{host}:{port}", node=config.node,
             cache_dir=str(config.cache_dir.resolve()), log=log_file, idle_exit=config.idle_exit,
             token=next(iter(config.tokens)) if config.node and config.tokens else None)


def serve_one(config: ServiceConfig, data_dir: Path, log_level: str, activity: Activity,
              sockets: list[socket.socket] | None = None) -> None:
    """Serve from this process until SIGTERM or SIGINT (a worker, or the whole service)."""
    run_serving(serve(config, data_dir, log_level, activity=activity, sockets=sockets))
