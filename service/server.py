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
import secrets
import socket
import sys
from dataclasses import replace
from functools import partial
from pathlib import Path

from shardfeed.buffers import BufferPool
from shardfeed.node import announce, node_service, remove_record
from shardfeed.retry import Backoff
from shardfeed.service.api.tenants import full_access_tokens, load_tenants
from shardfeed.service.cluster.membership import build_cluster
from shardfeed.service.cluster.sources import open_source
from shardfeed.service.cluster.workers import run_serving, supervise, worker_sockets
from shardfeed.service.config import (DEFAULT_DATA_DIR, OPTIONS, Group, HedgePolicy, ServiceConfig, serve_settings,
                                      settings)
from shardfeed.service.observe.activity import Activity
from shardfeed.service.stores.hedge import Hedger

log = logging.getLogger("shardfeed.server")

DEFAULT_DATASET = "digits"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``serve``'s flags, made from their settings (``config.serve_settings``), one group per ``Group``."""
    groups = {group: parser.add_argument_group(group.value) for group in Group}
    for described in serve_settings():
        groups[described.group].add_argument(described.flag, **described.arguments())


def _given(args: argparse.Namespace, owner: type) -> dict:
    """The fields of ``owner`` set by a flag; a flag not given leaves its field's default."""
    return {s.name: s.kind.value(value) for s in settings(owner) if (value := getattr(args, s.dest)) is not None}


def _datasets(specs: list[str]) -> dict[str, str]:
    datasets: dict[str, str] = {}
    for spec in specs:
        name, sep, url = spec.partition("=")
        if not sep or not name or not url:
            raise ValueError(f"--dataset expects NAME=URL, got {spec!r}")
        if name in datasets:
            raise ValueError(f"dataset name {name!r} given twice")
        datasets[name] = url
    return datasets


def config_from_args(args: argparse.Namespace) -> ServiceConfig:
    """The config ``serve``'s flags describe; ``ValueError`` naming the flag for a value it cannot take."""
    for option in OPTIONS:
        option.check(getattr(args, option.dest))
    given = _given(args, ServiceConfig)
    if given.get("node"):  # the node service's own defaults, where no flag overrides them
        given = {s.name: s.node() if callable(s.node) else s.node
                 for s in settings(ServiceConfig) if s.node is not None} | given
    hedge = HedgePolicy(**_given(args, HedgePolicy)) if given.pop("hedge", True) else None
    store_options: dict = {}
    for option, name in (("store_timeout", "read_timeout"), ("store_first_byte_timeout", "first_byte_timeout"),
                         ("store_progress_timeout", "progress_timeout")):
        if getattr(args, option) is not None:
            store_options[name] = getattr(args, option)
    if args.store_retries is not None:
        store_options["backoff"] = Backoff(attempts=args.store_retries + 1)
    full_access = full_access_tokens(args.token_file, os.environ.get("SHARDFEED_TOKENS", ""))
    # --node: only ours may read; --tokens: the workers' own
    own = not full_access and (given.get("node") or given.get("tenant_file"))
    config = ServiceConfig(**given, datasets=_datasets(args.dataset or []), hedge=hedge, store_options=store_options,
                           tokens=frozenset({secrets.token_urlsafe(24)}) if own else full_access)
    load_tenants(config.tenant_file, full_access, config.max_inflight_batches)  # a bad file fails now, with its message
    if config.tenant_file and (config.peers or config.peers_from) and not full_access:
        raise ValueError(f"--tokens with {'--peers' if config.peers else '--peers-from'} needs a full-access token "
                         "that the replicas share for their requests to each other (--token-file or SHARDFEED_TOKENS)")
    if bool(config.tls_cert) != bool(config.tls_key):
        raise ValueError("--tls-cert and --tls-key go together")
    for path in (config.tls_cert, config.tls_key):
        if path is not None and not path.is_file():
            raise ValueError(f"TLS file {path} does not exist")
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
    # Block buffers for the RAM tier and the store reads in flight (four blocks a slot), reused.
    buffers = BufferPool(config.block_size, config.memory_cache + 4 * config.max_store_requests * config.block_size)
    metrics.block_buffers.set_function(lambda: buffers.bytes)
    metrics.block_buffers_outside.set_function(lambda: buffers.outside)
    memory = MemoryTier(config.memory_cache, metrics, config.block_size, buffers) if config.memory_cache else None
    cache = BlockCache(config.cache_dir, config.cache_size, config.block_size, metrics, buffers=buffers,
                       hints=place is not None,
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
