"""Tenants: bearer tokens with scopes, from the token file of ``serve --tokens FILE``, which
is read again whenever it changes.

The file is TOML, one table per tenant. The table's name is the tenant's name: logs, metric
labels, plan owners and error messages say it, never the secret. ::

    # teamA reads two datasets and one GetBatch bucket, with 16 batches in flight at most
    [teamA]
    secret = "7f3e9c0d2b41aa96e0c5"
    scopes = ["dataset:train", "dataset:val", "bucket:images"]
    max_inflight_batches = 16
    transforms = ["imagenet_train"]

    [ops]  # the file holds the secret's SHA-256 (hex), not the secret
    sha256 = "fd331c39a593572da902d6eead46b1951453139d237cd312f207e5f4079f2d85"
    scopes = ["admin"]

Keys of a tenant:

    secret                the bearer token itself (printable ASCII, no spaces) ...
    sha256                ... or its SHA-256 in hex: one of the two
    scopes                what it may do (default: none, which still reads /v1/stats and /metrics)
    max_inflight_batches  its own bound on batch requests in flight (POST /v1/batch, GetBatch),
                          past which it gets 429; default: an equal share of --max-inflight-batches
                          among the file's tenants, so that none can take the others' share
    transforms            the served transforms (``serve --transform``) its batches may name; default:
                          every one (an admin: every one, whatever this says)

Scopes:

    dataset:NAME   read the served dataset NAME: its info, routing table, samples, batches and
                   plans; ``dataset:*`` every dataset
    bucket:NAME    read the GetBatch bucket NAME (``/v1/ml/moss``); ``bucket:*`` every ``--bucket``
    admin          everything: the admin routes (adding, removing and reloading datasets, deleting
                   or extending other tenants' plans, the replicas' and workers' internal routes)
                   and every dataset and bucket

The tokens of ``--token-file`` and ``SHARDFEED_TOKENS`` keep full access (as ``admin``, with
no bound of their own), under the name ``full-access``. A file that cannot be read or parsed,
or names an unknown key or scope, stops ``serve`` at start with the reason; while serving,
the file is checked every ``POLL`` seconds and on SIGHUP, and one that no longer parses
keeps the previous tenants and logs the reason (which never quotes a secret).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the same parser as a package (pyproject.toml)
    import tomli as tomllib

from shardfeed.service.http.errors import Forbidden, Overloaded
from shardfeed.service.observe.metrics import Metrics

log = logging.getLogger("shardfeed.tenants")

POLL = 2.0
"""Seconds between two looks at the token file's modification time."""

FULL_ACCESS = "full-access"
"""The name of the ``--token-file`` and ``SHARDFEED_TOKENS`` tokens (and of every request when
no token is configured): reserved, a file's tenant cannot take it."""

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_SECRET = re.compile(r"[!-~]{1,4096}")  # what an Authorization: Bearer header carries unchanged
_DIGEST = re.compile(r"[0-9a-fA-F]{64}")
_SCOPE = re.compile(r"(dataset|bucket):(\*|[A-Za-z0-9][A-Za-z0-9._-]{0,254})")
KEYS = ("secret", "sha256", "scopes", "max_inflight_batches", "transforms")
SCOPES = "admin, dataset:NAME, bucket:NAME (NAME * for every one)"


class TokenFileError(ValueError):
    """The token file cannot be used; the message names the file, tenant and key, never a secret."""


@dataclass(frozen=True)
class Tenant:
    """A token's name and what it may do."""

    name: str
    datasets: frozenset[str] = frozenset()
    """Dataset names it may read; ``*``: every one."""
    buckets: frozenset[str] = frozenset()
    """GetBatch buckets it may read; ``*``: every one."""
    admin: bool = False
    max_inflight_batches: int | None = None
    """Its own bound on batches in flight; ``None``: only the service's (``Admission``)."""
    transforms: frozenset[str] | None = None
    """The served transforms its batches may name; ``None``: every one."""

    def may_read(self, dataset: str) -> bool:
        return self.admin or dataset in self.datasets or "*" in self.datasets

    def check_dataset(self, dataset: str) -> None:
        if not self.may_read(dataset):
            raise Forbidden(f"token {self.name!r} may not read dataset {dataset[:200]!r} "
                            f"(scope dataset:{dataset[:200]} needed)")

    def check_buckets(self, buckets: Iterable[str]) -> None:
        missing = [] if self.admin or "*" in self.buckets else sorted(set(buckets) - self.buckets)
        if missing:
            raise Forbidden(f"token {self.name!r} may not read bucket {missing[0][:255]!r} "
                            f"(scope bucket:{missing[0][:255]} needed)")

    def check_transform(self, transform: str) -> None:
        if not (self.admin or self.transforms is None or transform in self.transforms):
            raise Forbidden(f"token {self.name!r} may not use transform {transform[:64]!r} (its transforms: "
                            f"{', '.join(sorted(self.transforms)) or 'none'})")

    def check_admin(self, what: str) -> None:
        if not self.admin:
            raise Forbidden(f"token {self.name!r} may not {what} (scope admin needed)")

    def check_owner(self, owner: str | None, what: str) -> None:
        """Only its owner, or an admin, may change what ``owner`` made (a plan)."""
        if owner != self.name:
            self.check_admin(f"{what}, which {owner!r} made" if owner else what)


EVERYTHING = Tenant(FULL_ACCESS, admin=True)


class Tenants:
    """Tokens by the SHA-256 of their secret; ``bearer`` finds the tenant of a token."""

    def __init__(self, keys: dict[bytes, Tenant]):
        self.keys = list(keys.items())
        self.names = sorted({tenant.name for tenant in keys.values()} - {FULL_ACCESS})

    def bearer(self, token: bytes) -> Tenant | None:
        digest = hashlib.sha256(token).digest()
        found = None
        for key, tenant in self.keys:  # compared with every key: timing says nothing about which matched
            if hmac.compare_digest(digest, key):
                found = tenant
        return found


def full_access_tokens(token_file: Path | None, environment: str) -> frozenset[str]:
    """The tokens of ``--token-file`` (one a line) and of ``SHARDFEED_TOKENS`` (``environment``,
    comma-separated)."""
    tokens = {t.strip() for t in environment.split(",") if t.strip()}
    if token_file is not None:
        try:
            lines = token_file.read_text().splitlines()
        except OSError as err:
            raise ValueError(f"cannot read --token-file {token_file}: {err.strerror}") from None
        tokens |= {line.strip() for line in lines if line.strip()}
        if not tokens:
            raise ValueError(f"--token-file {token_file} holds no token")
    return frozenset(tokens)


def load_tenants(path: Path | None, full_access: Iterable[str], batch_limit: int) -> Tenants:
    """The tenants of the token file at ``path`` (none: only the full-access tokens), their
    default bound an equal share of ``batch_limit``; ``TokenFileError`` if it is unusable."""
    keys = {hashlib.sha256(token.encode()).digest(): EVERYTHING for token in full_access}
    tables = _tables(path) if path is not None else {}
    share = max(1, batch_limit // max(1, len(tables)))
    for name, table in tables.items():
        where = f"--tokens {path}: tenant {name[:64]!r}"
        tenant, key = _tenant(name, table, share, where)
        other = keys.get(key)
        if other is not None:  # one token, two names: which one is it?
            raise TokenFileError(f"{where} has the secret of {other.name!r}" if other.name != FULL_ACCESS
                                 else f"{where} has the secret of a --token-file or SHARDFEED_TOKENS token")
        keys[key] = tenant
    return Tenants(keys)


def _tables(path: Path) -> dict:
    try:
        text = path.read_bytes().decode()
    except OSError as err:
        raise TokenFileError(f"cannot read --tokens {path}: {err.strerror}") from None
    except UnicodeDecodeError:
        raise TokenFileError(f"--tokens {path} is not UTF-8 text") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:  # its message gives the place, not the text there
        raise TokenFileError(f"--tokens {path} is not TOML: {err}") from None


def _tenant(name: str, table, share: int, where: str) -> tuple[Tenant, bytes]:
    """The tenant a table of the file describes, and its key."""
    if not _NAME.fullmatch(name):
        raise TokenFileError(f"{where}: a tenant's name is 1-64 letters, digits, '.', '_' or '-'")
    if name == FULL_ACCESS:
        raise TokenFileError(f"{where}: the name is reserved for --token-file and SHARDFEED_TOKENS tokens")
    if not isinstance(table, dict):
        raise TokenFileError(f"{where} is not a table: write [{name}] above its keys")
    unknown = sorted(set(table) - set(KEYS))
    if unknown:
        raise TokenFileError(f"{where}: unknown key {unknown[0][:64]!r} (keys: {', '.join(KEYS)})")
    secret, digest = table.get("secret"), table.get("sha256")
    if (secret is None) == (digest is None):
        raise TokenFileError(f"{where}: give its secret or its sha256, one of the two")
    if secret is not None and not (isinstance(secret, str) and _SECRET.fullmatch(secret)):
        raise TokenFileError(f"{where}: the secret must be printable ASCII without spaces")
    if digest is not None and not (isinstance(digest, str) and _DIGEST.fullmatch(digest)):
        raise TokenFileError(f"{where}: sha256 must be 64 hexadecimal digits")
    scopes = table.get("scopes", [])
    if not isinstance(scopes, list) or not all(isinstance(s, str) for s in scopes):
        raise TokenFileError(f"{where}: scopes must be a list of strings ({SCOPES})")
    datasets, buckets = set(), set()
    for scope in scopes:
        kind = _SCOPE.fullmatch(scope)
        if kind is not None:
            (datasets if kind[1] == "dataset" else buckets).add(kind[2])
        elif scope != "admin":
            raise TokenFileError(f"{where}: unknown scope {scope[:80]!r} (scopes: {SCOPES})")
    bound = table.get("max_inflight_batches", share)
    if not isinstance(bound, int) or isinstance(bound, bool) or not 1 <= bound <= 1 << 20:
        raise TokenFileError(f"{where}: max_inflight_batches must be a whole number from 1 to {1 << 20}")
    transforms = table.get("transforms")
    if transforms is not None and not (isinstance(transforms, list) and all(isinstance(t, str) for t in transforms)):
        raise TokenFileError(f"{where}: transforms must be a list of served transforms' names")
    key = hashlib.sha256(secret.encode()).digest() if secret is not None else bytes.fromhex(digest)
    return Tenant(name, frozenset(datasets), frozenset(buckets), "admin" in scopes, bound,
                  None if transforms is None else frozenset(transforms)), key


class TokenFile:
    """The tenants as the token file says now: ``tenants`` is replaced when the file changes
    and parses, kept when it no longer does. ``serve`` checked the file before starting; a
    worker restarted while it is broken starts with the full-access tokens alone, and takes
    the tenants once the file is mended (rather than dying again and again)."""

    def __init__(self, path: Path | None, full_access: frozenset[str], batch_limit: int):
        self.path = path
        self.full_access = full_access
        self.batch_limit = batch_limit
        self.seen = None
        self.tenants = load_tenants(None, full_access, batch_limit)
        self.reload(always=True)

    def _stamp(self) -> tuple | None:
        try:
            st = os.stat(self.path)
        except OSError:  # gone: the load says so
            return None
        return st.st_mtime_ns, st.st_size, st.st_ino

    def reload(self, *, always: bool = False) -> None:
        """Read the file again if it changed since last read (``always``: even if not)."""
        if self.path is None:
            return
        stamp = self._stamp()
        if stamp == self.seen and not always:
            return
        self.seen = stamp
        try:
            tenants = load_tenants(self.path, self.full_access, self.batch_limit)
        except TokenFileError as err:
            log.error("%s; the tokens read before stay (tenants: %s)", err, ", ".join(self.tenants.names) or "none")
            return
        self.tenants = tenants
        log.info("--tokens %s read: tenants %s", self.path, ", ".join(tenants.names) or "none")

    async def watch(self) -> None:
        while True:
            await asyncio.sleep(POLL)
            self.reload()


class TenantBatches:
    """Batch requests in flight per tenant; 429 past a tenant's ``max_inflight_batches``."""

    def __init__(self, metrics: Metrics):
        self.inflight: dict[str, int] = {}
        self.metrics = metrics

    def full(self, tenant: Tenant) -> bool:
        bound = tenant.max_inflight_batches
        return bound is not None and self.inflight.get(tenant.name, 0) >= bound

    def acquire(self, tenant: Tenant) -> None:
        if self.full(tenant):
            self.metrics.rejected.inc()
            raise Overloaded(f"token {tenant.name!r} has {tenant.max_inflight_batches} batch requests in flight, "
                             "its max_inflight_batches; retry later")
        self.inflight[tenant.name] = self.inflight.get(tenant.name, 0) + 1
        self.metrics.tenant_batches.labels(tenant.name).inc()

    def release(self, tenant: Tenant) -> None:
        left = self.inflight[tenant.name] - 1
        if left:
            self.inflight[tenant.name] = left
        else:  # a tenant removed from the file leaves no entry behind
            del self.inflight[tenant.name]
        self.metrics.tenant_batches.labels(tenant.name).dec()
