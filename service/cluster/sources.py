"""Where the replica set comes from while serving: ``--peers``, or ``--peers-from`` a file or DNS.

A ``MembershipSource`` answers one question, ``peers()``: every replica, this one
included, and this one's place among them (as ``parse_peers`` gives them). ``follow``
asks it every ``--peers-refresh`` seconds and hands a changed answer to
``Cluster.replace_hosts``; a source that fails (a file that does not parse or no longer
names this replica, a resolution that fails) keeps the set known and logs why, once.

    StaticPeers  ``--peers URL,...``: a fixed set
    FilePeers    ``file:PATH``: one peer a line, ``URL`` or ``ID=URL``, ``#`` comments;
                 read again when it changes (a mounted ConfigMap)
    DnsPeers     ``dns:NAME[:PORT]``: each A/AAAA record of NAME is ``http://ADDR:PORT``
                 (a headless Service; this replica's ``--node-id`` is its address)
    SrvPeers     ``dns+srv:NAME``: each SRV record of NAME (``_http._tcp.SERVICE``, as
                 Kubernetes publishes a headless Service's named port) is the replica
                 ``TARGET=http://ADDR:PORT``, named by its target's first label (a
                 StatefulSet's pod name), ADDR resolved by the same nameserver

Either DNS source takes ``@HOST[:PORT]`` at the end: the nameserver to ask (default: the
system's, with its search domains). Queries go through dnspython's asyncio resolver, never
blocking the event loop (``loop.getaddrinfo`` cannot be aimed at a nameserver, nor read SRV).
DNS answers come in any order: their peers are sorted, so every replica ranks the same list.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
from pathlib import Path
from typing import Protocol
from urllib.parse import urlparse

import dns.asyncresolver
import dns.exception
import dns.resolver

from shardfeed.service.cluster.peers import Cluster, Peer
from shardfeed.service.config import ServiceConfig

log = logging.getLogger("shardfeed.peers")

SCHEMES = ("file", "dns", "dns+srv")
_DNS_SPEC = re.compile(r"(?P<name>[^:@\s]+)(?::(?P<port>[^@]*))?(?:@(?P<server>[^:\s]+)(?::(?P<server_port>.*))?)?")


class MembershipError(Exception):
    """A source could not say who the replicas are now: the set known is kept."""


class MembershipSource(Protocol):
    describe: str
    """The source as given (``file:/etc/shardfeed/peers``), for logs."""

    async def peers(self) -> tuple[list[Peer], int]:
        """Every replica, this one included, and this one's position; ``MembershipError`` if unknown."""


class StaticPeers:
    def __init__(self, spec: str, node_id: str):
        self.describe = f"--peers {spec}"
        self._answer = parse_peers(spec, node_id)

    async def peers(self) -> tuple[list[Peer], int]:
        return self._answer


class FilePeers:
    def __init__(self, path: Path, node_id: str):
        self.describe = f"file:{path}"
        self.path = path
        self.node_id = node_id
        self._read: tuple[tuple[int, int], tuple[list[Peer], int] | MembershipError] | None = None
        try:
            self.current()  # the file must be there, parse and name this replica from the start
        except MembershipError as err:
            raise ValueError(f"--peers-from {err}") from None

    async def peers(self) -> tuple[list[Peer], int]:
        return self.current()

    def current(self) -> tuple[list[Peer], int]:
        """The file's peers, parsed again only when its modification time or size changed
        (a ConfigMap update swaps a symlink: ``stat`` follows it). A stat and a small read:
        not worth a thread."""
        try:
            stat = os.stat(self.path)
        except OSError as err:
            raise MembershipError(f"{self.describe}: {err.strerror}") from None
        stamp = (stat.st_mtime_ns, stat.st_size)
        if self._read is None or self._read[0] != stamp:
            try:
                lines = [line.partition("#")[0].strip() for line in self.path.read_text().splitlines()]
                answer = parse_peers(",".join(filter(None, lines)), self.node_id)
            except (OSError, UnicodeDecodeError, ValueError) as err:
                answer = MembershipError(f"{self.describe}: {err}")
            self._read = (stamp, answer)
        if isinstance(self._read[1], MembershipError):
            raise self._read[1]
        return self._read[1]


class DnsPeers:
    def __init__(self, name: str, port: int, resolver: dns.asyncresolver.Resolver, node_id: str, scheme: str):
        self.describe = f"dns:{name}:{port}"
        self.name, self.port, self.resolver, self.node_id, self.scheme = name, port, resolver, node_id, scheme

    async def peers(self) -> tuple[list[Peer], int]:
        addresses = sorted(set(await _addresses(self.resolver, self.name, self.describe)))
        if not addresses:
            raise MembershipError(f"{self.describe}: no A or AAAA records")
        return _parse(self, ",".join(f"{self.scheme}://{_host(a)}:{self.port}" for a in addresses))


class SrvPeers:
    def __init__(self, name: str, resolver: dns.asyncresolver.Resolver, node_id: str, scheme: str):
        self.describe = f"dns+srv:{name}"
        self.name, self.resolver, self.node_id, self.scheme = name, resolver, node_id, scheme

    async def peers(self) -> tuple[list[Peer], int]:
        try:
            records = [(r.target.to_text(omit_final_dot=True), r.port)
                       for r in await self.resolver.resolve(self.name, "SRV")]
        except dns.exception.DNSException as err:
            raise MembershipError(f"{self.describe}: {err}") from None
        found = await asyncio.gather(*(_addresses(self.resolver, target, self.describe) for target, _ in records))
        entries = sorted(f"{target.split('.')[0]}={self.scheme}://{_host(min(addresses))}:{port}"
                         for (target, port), addresses in zip(records, found) if addresses)
        if not entries:
            raise MembershipError(f"{self.describe}: no SRV records with an address")
        return _parse(self, ",".join(entries))


async def _addresses(resolver: dns.asyncresolver.Resolver, name: str, source: str) -> list[str]:
    """The A and AAAA records of ``name``; ``MembershipError`` (naming ``source``) when one could not be asked."""
    out: list[str] = []
    for kind in ("A", "AAAA"):
        try:
            out += [r.address for r in await resolver.resolve(name, kind)]
        except (dns.resolver.NoAnswer, dns.resolver.NXDOMAIN):
            continue
        except dns.exception.DNSException as err:
            raise MembershipError(f"{source}: resolving {name} ({kind}): {err}") from None
    return out


def _host(address: str) -> str:
    return f"[{address}]" if ":" in address else address


def _parse(source: DnsPeers | SrvPeers, spec: str) -> tuple[list[Peer], int]:
    try:
        return parse_peers(spec, source.node_id)
    except ValueError as err:
        raise MembershipError(f"{source.describe}: {err}") from None


def parse_peers(spec: str, node_id: str) -> tuple[list[Peer], int]:
    """Peers from ``URL,URL,...`` or ``ID=URL,...``, and the position of this node among them.

    Without ``ID=``, a peer's id is its URL's host name, or ``host:port`` when several
    peers share a host (replicas on one machine, different ports); this node is the peer
    whose id, URL, or first host label equals ``node_id`` (``shardfeed-0`` matches
    ``http://shardfeed-0.shardfeed-peers:8080``).
    """
    named: list[tuple[str, str]] = []  # (given id or "", URL)
    for entry in filter(None, (e.strip() for e in spec.split(","))):
        name, sep, url = entry.partition("=")
        if not sep:
            name, url = "", entry
        parsed = urlparse(url)
        try:
            parsed.port
        except ValueError:
            raise ValueError(f"peer {entry!r} has a bad port") from None
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise ValueError(f"peer {entry!r} is not an http(s) URL")
        named.append((name, url.rstrip("/")))
    hosts = [urlparse(url).hostname for name, url in named if not name]
    shared = {h for h in hosts if hosts.count(h) > 1}
    peers = [Peer(name or _default_id(url, shared), url) for name, url in named]
    ids = [p.id for p in peers]
    if len(set(ids)) != len(ids):
        raise ValueError(f"peer ids must be unique (got {', '.join(ids)}); name them with ID=URL")
    exact = [i for i, p in enumerate(peers) if node_id in (p.id, p.url)]
    if exact:
        return peers, exact[0]
    by_host = [i for i, p in enumerate(peers)
               if node_id in (urlparse(p.url).hostname, urlparse(p.url).hostname.split(".")[0])]
    if len(by_host) > 1:
        raise ValueError(f"--node-id {node_id!r} matches several of --peers ({', '.join(ids)}); "
                         "give this replica's id or URL")
    if by_host:
        return peers, by_host[0]
    raise ValueError(f"--node-id {node_id!r} is not one of --peers ({', '.join(ids)})")


def _default_id(url: str, shared_hosts: set[str]) -> str:
    """A peer's id when not named: its host name, or ``host:port`` on a host shared with another peer."""
    parsed = urlparse(url)
    if parsed.hostname not in shared_hosts:
        return parsed.hostname
    return f"{parsed.hostname}:{parsed.port or (443 if parsed.scheme == 'https' else 80)}"


def open_source(config: ServiceConfig) -> MembershipSource | None:
    """The source of ``--peers`` or ``--peers-from`` (``None``: neither); ``ValueError`` naming
    what is wrong (an unknown scheme, a bad port, a file that is missing, does not parse or
    does not name this replica), so that ``serve`` fails at start with that line."""
    spec = config.peers_from
    flag = "--peers-from" if spec else "--peers"
    if not (spec or config.peers):
        return None
    if spec and config.peers:
        raise ValueError("--peers and --peers-from are exclusive: a fixed set, or one followed")
    if not config.node_id:
        raise ValueError(f"{flag} needs --node-id (which of the peers this replica is)")
    if not spec:
        return StaticPeers(config.peers, config.node_id)
    scheme = "https" if config.tls_cert else "http"
    kind, sep, rest = spec.partition(":")
    if not sep or kind not in SCHEMES or not rest:
        raise ValueError(f"--peers-from {spec!r}: expected file:PATH, dns:NAME[:PORT] or dns+srv:NAME")
    if kind == "file":
        return FilePeers(Path(rest), config.node_id)
    match = _DNS_SPEC.fullmatch(rest)
    if match is None or (kind == "dns+srv" and match["port"] is not None):
        raise ValueError(f"--peers-from {spec!r}: expected dns:NAME[:PORT][@SERVER[:PORT]] or "
                         "dns+srv:NAME[@SERVER[:PORT]]")
    resolver = dns.asyncresolver.Resolver(configure=match["server"] is None)
    resolver.lifetime = 2.0
    resolver.use_search_by_default = True  # a Service's short name, as the pod's resolv.conf completes it
    if match["server"] is not None:
        try:
            resolver.nameservers = [match["server"]]
        except ValueError:
            raise ValueError(f"--peers-from {spec!r}: nameserver {match['server']!r} is not an IP address") from None
        resolver.port = _port(spec, match["server_port"], 53)
    if kind == "dns+srv":
        return SrvPeers(match["name"], resolver, config.node_id, scheme)
    return DnsPeers(match["name"], _port(spec, match["port"], 8080), resolver, config.node_id, scheme)


def _port(spec: str, text: str | None, default: int) -> int:
    if text is None:
        return default
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise ValueError(f"--peers-from {spec!r}: bad port {text!r}")
    return int(text)


async def follow(cluster: Cluster, source: MembershipSource, interval: float) -> None:
    """Keep ``cluster``'s replicas those ``source`` names, asking every ``interval`` seconds."""
    failed = None
    while True:
        await asyncio.sleep(interval)
        try:
            hosts, me = await source.peers()
        except MembershipError as err:
            if str(err) != failed:
                log.error("membership: %s; keeping the %d replicas known", err, len(cluster.hosts))
            failed = str(err)
            continue
        except Exception:  # an unforeseen error must not end the following: ask again
            log.exception("membership: asking %s failed", source.describe)
            continue
        failed = None
        if await cluster.replace_hosts(hosts, me):
            log.info("membership (%s): replica %s of %d: %s", source.describe, hosts[me].id, len(hosts),
                     ", ".join(f"{p.id}={p.url}" for p in hosts))
