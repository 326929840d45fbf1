"""The HTTP API v1 (docs/architecture.md): one route module per group, wired here.

    ops        /healthz, /metrics, /v1/cluster
    datasets   /v1/datasets[/{name}[/reload]]: listed, added, removed, reopened
    samples    per-sample GETs, coalesced by ``SampleBatcher``
    batch      POST /v1/batch, the ordered tar stream
    getbatch   GET /v1/ml/moss, AIStore's GetBatch for the AIStore SDK
    internal   replica-to-replica and worker-to-worker member reads
    routing    /v1/datasets/{name}/routing, for client-side routing
    index      /v1/datasets/{name}/index[/{column}]: the index's per-sample columns, for subsets
    status     GET /v1/stats and the status page at / and /ui
    plans      /v1/datasets/{name}/plans[/{id}]: announced orders (``service/plans/``)
    transforms GET /v1/transforms: the served transforms (``service/transform/``)
    auth       the bearer-token middleware in front of them all: which scope each route needs
    tenants    tokens with names, scopes and a bound of their own, from ``--tokens FILE``
    common     what they share: ``State``, admission, bodies, streamed answers

Every route gets the service ``State`` from one dependency (``common.AppState``) and
raises ``ApiError`` (``service/http/errors.py``) for every error answer. SIGHUP reopens
every dataset (``datasets/served.py``), as ``POST /v1/datasets/{name}/reload`` does one, and
reads the token file again.

May import every room below it: ``plans``, ``read``, ``cluster``, ``datasets``, ``cache``,
``stores``, ``observe``, ``http``, ``config``.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse
from starlette.types import ASGIApp

from shardfeed.service.api import batch, getbatch, index, internal, ops, routing, samples, status, transforms
from shardfeed.service.api import datasets as dataset_routes
from shardfeed.service.api import plans as plan_routes
from shardfeed.service.api.auth import TokenAuth, guarded
from shardfeed.service.api.common import ERRORS, Admission, HeldRoutes, State, describe
from shardfeed.service.api.tenants import TenantBatches, TokenFile
from shardfeed.service.cache.disk import BlockCache
from shardfeed.service.cache.memtier import MemoryTier
from shardfeed.service.cluster.peers import Cluster
from shardfeed.service.config import ServiceConfig
from shardfeed.service.datasets.dataset import Dataset
from shardfeed.service.datasets.objects import BucketStores, Catalog
from shardfeed.service.datasets.served import ServedDatasets
from shardfeed.service.http.errors import ApiError, error_response
from shardfeed.service.observe.metrics import Metrics
from shardfeed.service.observe.stats import StatsRecorder
from shardfeed.service.plans.adopt import adopt
from shardfeed.service.plans.prefetch import Prefetcher
from shardfeed.service.plans.registry import Plans
from shardfeed.service.read.coalescer import Coalescer
from shardfeed.service.read.samples import SampleBatcher
from shardfeed.service.stores import Store
from shardfeed.service.transform.pool import TransformPool
from shardfeed.service.transform.prepared import PreparedCache
from shardfeed.service.transform.registry import Transforms, pool_processes

ROUTERS = (ops.router, dataset_routes.router, routing.router, index.router, samples.router, getbatch.router,
           internal.router, status.router, plan_routes.router, transforms.router)


class ShardfeedAPI(FastAPI):
    """FastAPI behind ``front``: ASGI middleware that sees every request before FastAPI's own
    stack (``TokenAuth`` when tokens are set, then ``HeldRoutes``), so that the hottest
    requests skip that stack's error, telemetry and body-limit layers too; an unexpected
    exception there is still a 500, from uvicorn.

    ``instant``: the routes the HTTP protocol may answer without the app at all
    (``protocol.BoundedHeadProtocol``), ``{(method, path): InstantAnswerer}``; ``mounted``: the
    OpenAPI paths of the endpoints mounted in ``front``, which FastAPI's router does not see."""

    def __init__(self, front: Callable[[ASGIApp], ASGIApp], instant: dict, mounted: dict, **kwargs):
        super().__init__(**kwargs)
        self.front = front(super().__call__)
        self.instant = instant
        self.mounted = mounted

    async def __call__(self, scope, receive, send) -> None:
        await self.front(scope, receive, send)

    def openapi(self) -> dict:
        if self.openapi_schema is None:
            schema = super().openapi()
            schema["paths"] = {**self.mounted, **schema["paths"]}
        return self.openapi_schema


def create_app(config: ServiceConfig, datasets: ServedDatasets, cache: BlockCache, memory: MemoryTier | None,
               plans: Plans, metrics: Metrics, cluster: Cluster | None = None,
               buckets: dict[str, Store] | None = None) -> FastAPI:
    """The ASGI app over already opened datasets, the cache's tiers (the disk cache evicting in
    ``plans``' order), and GetBatch bucket stores (see ``server.py``)."""
    coalescer = Coalescer(cache, metrics, config, cluster, memory=memory, fetch_policy=plans,
                          on_changed=datasets.changed)
    prefetcher = Prefetcher(plans, coalescer, config)
    admission = Admission({"batch": config.max_inflight_batches, "sample": config.max_inflight_samples}, metrics)
    bucket_stores = BucketStores(buckets or {})
    catalog = Catalog(bucket_stores, datasets, object_ttl=config.object_ttl)
    served = Transforms.of(config)
    pool = TransformPool(served.specs, pool_processes(config), config.transform_timeout) if served else None
    state = State(config, datasets, metrics, coalescer, SampleBatcher(coalescer, config.sample_window),
                  admission, cluster, StatsRecorder(metrics.registry), catalog, plans, prefetcher,
                  served, pool, PreparedCache(cache, memory))

    async def replaced(old: Dataset | None, new: Dataset | None) -> None:
        if old is not None and new is not None:
            await asyncio.to_thread(plans.rebind, old, new)
        elif old is not None:  # removed: its plans go with it
            for plan in plans.live(old):
                plans.remove(plan)
        catalog.serve(datasets)

    datasets.listeners.append(replaced)
    tokens = TokenFile(config.tenant_file, config.tokens, config.max_inflight_batches)
    batches = TenantBatches(metrics)
    authenticated = bool(config.tokens or config.tenant_file)

    def hangup() -> None:
        asyncio.ensure_future(datasets.reload_all())
        tokens.reload(always=True)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if pool is not None:
            await pool.start()
        state.stats.start()
        if cluster is not None:
            cluster.start()
        prefetcher.start()
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGHUP, hangup)
        watch = asyncio.create_task(tokens.watch()) if config.tenant_file else None
        # A restarted worker takes its siblings' plans; a new host's workers find none.
        adoption = asyncio.create_task(adopt(cluster, plans, datasets, config)) \
            if cluster is not None and len(cluster.workers) > 1 else None
        yield
        loop.remove_signal_handler(signal.SIGHUP)
        for task in filter(None, (watch, adoption)):
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        await prefetcher.close()
        await state.stats.close()
        if cluster is not None:
            await cluster.close()
        await coalescer.close()
        for dataset in datasets.values():
            await dataset.store.close()
        await bucket_stores.close()
        if pool is not None:
            await pool.close()

    batch_endpoint = batch.BatchEndpoint(state)

    def front(routed: ASGIApp) -> ASGIApp:
        held = HeldRoutes(routed, state, direct={("POST", "/v1/batch"): batch_endpoint},
                          handlers=(samples.held_member,))
        return TokenAuth(held, tokens, batches, metrics) if authenticated else held

    instant = {("POST", "/v1/batch"): batch_endpoint.instant}
    if authenticated:
        instant = {route: guarded(answer, tokens, batches, metrics) for route, answer in instant.items()}
    app = ShardfeedAPI(front, instant, batch.OPENAPI, title="shardfeed", version="1", lifespan=lifespan, responses=ERRORS,
                       description="Batched, ordered sample loading from S3-compatible storage.")
    app.state.shardfeed = state
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(RequestValidationError, _invalid)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    for router in ROUTERS:
        app.include_router(router)
    # Where a reader finds the route, and what answers its other methods (405); its requests are
    # taken in front of the router (``HeldRoutes``), by the same endpoint.
    app.router.add_route("/v1/batch", batch_endpoint, methods=["POST"], include_in_schema=False)
    return app


async def _api_error(request: Request, err: ApiError) -> JSONResponse:
    return err.response()


async def _invalid(request: Request, err: RequestValidationError) -> JSONResponse:
    return error_response(400, "invalid_request", describe(err.errors()))


async def _http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
    code = {404: "not_found", 405: "method_not_allowed"}.get(err.status_code, "http_error")
    return error_response(err.status_code, code, str(err.detail), getattr(err, "headers", None))
