"""Bearer tokens and what each may do, in front of every route: the token must be known (401
otherwise), its tenant (``tenants.py``) must hold the scope the route needs (403, naming it),
and a tenant's batch requests in flight are bounded (429 past its ``max_inflight_batches``).
An admitted request's store reads take turns with other tenants' (``read/slots.py``): the
middleware sets ``slots.TENANT`` to its tenant's name, which the tasks it starts inherit.

What each route needs (``RULES``; any other route or method needs ``admin``):

    no token   /healthz, and the status page's HTML at / and /ui (it holds no data)
    any token  /v1/stats, /metrics, /v1/cluster, /v1/transforms, the OpenAPI document; /v1/datasets (it lists
               the datasets the token may read); POST /v1/batch and GET /v1/ml/moss[/{bucket}],
               whose dataset and buckets the routes check once they have read the body
    dataset    GET /v1/datasets/{name}, its routing table, index columns and samples; its plans
               (deleting or extending another tenant's plan needs admin: ``plans.py`` checks the owner)
    admin      POST /v1/datasets, DELETE /v1/datasets/{name}, POST /v1/datasets/{name}/reload,
               /v1/internal/..., and any request relayed from another node (``peers.COPY_HEADER``)

Without any token configured there is no middleware, and every request has full access.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

from shardfeed.service.api.tenants import EVERYTHING, Tenant, TenantBatches, TokenFile
from shardfeed.service.cluster.peers import COPY_HEADER
from shardfeed.service.http.errors import Forbidden, Overloaded, error_response
from shardfeed.service.observe.metrics import Metrics
from shardfeed.service.read import slots

log = logging.getLogger("shardfeed.api")

OPEN_PATHS = frozenset({"/healthz", "/", "/ui"})
"""Answered without a token: liveness, and the status page's HTML, which holds no data (its
script asks for a token and sends it with every call to ``/v1/stats``)."""

TENANT = "shardfeed.tenant"
"""The scope key under which the middleware leaves the request's ``Tenant``."""

_COPY = COPY_HEADER.lower().encode()


@dataclass(frozen=True)
class Rule:
    methods: frozenset[str]
    path: re.Pattern
    need: str
    """``any`` (a known token), ``dataset`` (the path's ``name`` readable) or ``admin``."""
    batch: bool = False
    """Counted among the tenant's batches in flight."""


def _rule(methods: str, path: str, need: str, batch: bool = False) -> Rule:
    return Rule(frozenset(methods.split()), re.compile(path), need, batch)


_READ = "GET HEAD"
RULES = (  # the hottest first
    _rule("POST", r"/v1/batch", "any", batch=True),
    _rule(_READ, r"/v1/datasets/(?P<name>[^/]+)/samples/[^/]+(/[^/]+)?", "dataset"),
    _rule(_READ, r"/v1/ml/moss(/[^/]+)?", "any", batch=True),
    _rule(_READ, r"/v1/stats|/metrics|/v1/cluster|/v1/datasets|/v1/transforms|/openapi\.json|/docs(/oauth2-redirect)?|/redoc",
          "any"),
    _rule(_READ, r"/v1/datasets/(?P<name>[^/]+)(/routing|/index(/[^/]+)?)?", "dataset"),
    _rule(f"{_READ} POST", r"/v1/datasets/(?P<name>[^/]+)/plans(/[^/]+)?", "dataset"),
    _rule("DELETE", r"/v1/datasets/(?P<name>[^/]+)/plans/[^/]+", "dataset"),
)


def rule_of(method: str, path: str) -> tuple[Rule | None, re.Match | None]:
    """The rule for a request, and how its path matched; ``None`` for an admin route."""
    for rule in RULES:
        if method in rule.methods and (match := rule.path.fullmatch(path)) is not None:
            return rule, match
    return None, None


def refusal(tenant: Tenant, scope, rule: Rule | None, match: re.Match | None) -> Forbidden | None:
    """Why ``tenant`` may not make the request of ``scope`` (``None``: it may); ``rule`` and
    ``match``: what ``rule_of`` says of it."""
    if tenant.admin:
        return None
    try:
        if rule is None:
            tenant.check_admin(f"{scope['method']} {scope['path'][:200]}")
        elif rule.need == "dataset":
            tenant.check_dataset(match["name"])
        if any(name == _COPY for name, _ in scope["headers"]):
            tenant.check_admin("relay requests between nodes")
    except Forbidden as err:
        return err
    return None


def bearer(scope) -> bytes:
    """The request's ``Authorization: Bearer`` token (empty if none)."""
    given = b""
    for name, value in scope["headers"]:
        if name == b"authorization" and value[:7].lower() == b"bearer ":
            given = value[7:].strip()
    return given


def tenant_of(scope) -> Tenant:
    """The tenant making the request; without tokens configured (no middleware) every request has full access."""
    return scope.get(TENANT, EVERYTHING)


class TokenAuth:
    """ASGI middleware: 401, 403 or a tenant's 429 before the app; counts each tenant's answers."""

    def __init__(self, app, tokens: TokenFile, batches: TenantBatches, metrics: Metrics):
        self.app = app
        self.tokens = tokens
        self.batches = batches
        self.metrics = metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        tenant = self.tokens.tenants.bearer(bearer(scope))
        if tenant is None:
            response = error_response(401, "unauthorized", "missing or wrong bearer token",
                                      {"WWW-Authenticate": "Bearer"})
            return await response(scope, receive, send)
        scope[TENANT] = tenant
        counted = self._counted(tenant, send)
        rule, match = rule_of(scope["method"], scope["path"])
        refused = refusal(tenant, scope, rule, match)
        if refused is not None:
            log.debug("%s %s refused: %s", scope["method"], scope["path"][:200], refused.message)
            return await refused.response()(scope, receive, counted)
        slots.TENANT.set(tenant.name)  # this request's task only: uvicorn starts one per request
        if rule is None or not rule.batch:
            return await self.app(scope, receive, counted)
        try:
            self.batches.acquire(tenant)
        except Overloaded as err:
            return await err.response()(scope, receive, counted)
        try:
            await self.app(scope, receive, counted)
        finally:
            self.batches.release(tenant)

    def _counted(self, tenant: Tenant, send):
        """``send``, counting the answer's status under the tenant's name."""
        async def counted(message) -> None:
            if message["type"] == "http.response.start":
                self.metrics.tenant_requests.labels(tenant.name, str(message["status"])).inc()
            await send(message)

        return counted


def guarded(answerer, tokens: TokenFile, batches: TenantBatches, metrics: Metrics):
    """``answerer`` (``protocol.InstantAnswerer``) for requests whose tenant may make them now;
    the app answers the others (401, 403, 429), and any the answerer declines."""
    def answer(scope, body: bytes):
        tenant = tokens.tenants.bearer(bearer(scope))
        if tenant is None or batches.full(tenant) or refusal(tenant, scope, *rule_of(scope["method"], scope["path"])):
            return None
        scope[TENANT] = tenant
        answered = answerer(scope, body)
        if answered is not None:
            metrics.tenant_requests.labels(tenant.name, "200").inc()
        return answered

    return answer
