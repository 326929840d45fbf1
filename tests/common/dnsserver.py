"""A real DNS server on loopback for membership tests: SRV records of a headless Service's named
port, as Kubernetes publishes them, with an A record per target; the records change as a test says."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from dnslib import AAAA, QTYPE, RCODE, RR, SRV, A
from dnslib.server import BaseResolver, DNSLogger, DNSServer

from shardfeed.process import free_port

RDATA = {"A": A, "AAAA": AAAA}


class ServiceRecords(BaseResolver):
    """``_http._tcp.<zone>`` SRV -> ``<name>.<zone>`` at each member's port; ``<name>.<zone>`` A ->
    127.0.0.1; ``<zone>`` A/AAAA -> ``addresses`` (a headless Service's plain records).
    ``failing``: every answer is SERVFAIL."""

    def __init__(self, zone: str):
        self.zone = zone.rstrip(".")
        self.srv_name = f"_http._tcp.{self.zone}"
        self.members: dict[str, int] = {}  # name -> port
        self.addresses: list[str] = []
        self.failing = False

    def resolve(self, request, handler):
        reply = request.reply()
        name, kind = str(request.q.qname).rstrip("."), QTYPE[request.q.qtype]
        members = dict(self.members)
        if self.failing:
            reply.header.rcode = RCODE.SERVFAIL
        elif name == self.srv_name and kind == "SRV":
            for member, port in sorted(members.items()):
                reply.add_answer(RR(request.q.qname, QTYPE.SRV, ttl=0,
                                    rdata=SRV(priority=0, weight=0, port=port, target=f"{member}.{self.zone}.")))
        elif name == self.zone and kind in ("A", "AAAA"):
            for address in self.addresses:
                if (":" in address) == (kind == "AAAA"):
                    reply.add_answer(RR(request.q.qname, getattr(QTYPE, kind), ttl=0, rdata=RDATA[kind](address)))
        elif name.endswith(f".{self.zone}") and name.split(".")[0] in members:
            if kind == "A":
                reply.add_answer(RR(request.q.qname, QTYPE.A, ttl=0, rdata=A("127.0.0.1")))
        else:
            reply.header.rcode = RCODE.NXDOMAIN
        return reply


@contextmanager
def dns_server(zone: str) -> Iterator[tuple[ServiceRecords, str]]:
    """A UDP DNS server on 127.0.0.1 answering for ``zone``: its records and ``HOST:PORT``."""
    records = ServiceRecords(zone)
    port = free_port()
    server = DNSServer(records, address="127.0.0.1", port=port,
                       logger=DNSLogger("-request,-reply,-truncated,-error,-recv,-send,-data", prefix=False))
    server.start_thread()
    try:
        yield records, f"127.0.0.1:{port}"
    finally:
        server.stop()
