"""Membership sources in process, against a real DNS server on loopback: A and SRV records as
peers, a replica not listed yet, and what each change of the set moves."""

from __future__ import annotations

import asyncio

import pytest

from shardfeed.service.cluster.membership import build_cluster
from shardfeed.service.cluster.peers import PeerError
from shardfeed.service.cluster.sources import MembershipError, open_source
from shardfeed.service.config import ServiceConfig
from shardfeed.service.observe.metrics import Metrics

from common.dnsserver import dns_server


def test_dns_a_records_are_peers_on_the_given_port_and_a_failed_lookup_keeps_nothing_new():
    """``dns:NAME:PORT``: each A/AAAA record of a headless Service is a replica at PORT; this one is
    the address given as --node-id (a pod's IP)."""
    with dns_server("plain.test") as (records, server):
        records.addresses = ["127.0.0.3", "127.0.0.2", "::1"]
        source = open_source(ServiceConfig(peers_from=f"dns:plain.test:8080@{server}", node_id="127.0.0.2"))
        peers, me = asyncio.run(source.peers())
        assert [p.url for p in peers] == ["http://127.0.0.2:8080", "http://127.0.0.3:8080", "http://[::1]:8080"]
        assert [p.id for p in peers] == ["127.0.0.2", "127.0.0.3", "::1"] and me == 0
        records.addresses = ["127.0.0.3"]  # this replica left the Service: not a set it can take
        with pytest.raises(MembershipError, match="--node-id '127.0.0.2' is not one of"):
            asyncio.run(source.peers())
        records.failing = True
        with pytest.raises(MembershipError, match="dns:plain.test:8080"):
            asyncio.run(source.peers())


def test_a_replica_the_dns_does_not_list_yet_serves_alone_and_changes_move_only_the_rendezvous_share():
    """At start, a DNS name without this replica (its pod not published yet) leaves it alone; then
    each change of the set moves the shards rendezvous hashing moves, within 1.2x of the ideal."""
    shards = [f"shard-{i:05d}.tar" for i in range(4000)]
    url = "s3://bucket/train"

    def first_choice(cluster) -> list[str]:  # each shard's owner while every replica is up
        return [cluster.hosts[h].id for h in cluster.rank(url, shards)[:, 0]]

    async def scenario():
        with dns_server("late.test") as (records, server):
            def publish(names: str) -> None:
                records.members = {n: 8000 + i for i, n in enumerate(names)}

            config = ServiceConfig(peers_from=f"dns+srv:{records.srv_name}@{server}", node_id="a")
            publish("bc")
            cluster = await build_cluster(config, Metrics())
            assert [p.id for p in cluster.hosts] == ["a"] and set(first_choice(cluster)) == {"a"}
            source = open_source(config)
            for names in ("abc", "abcd", "ad"):
                publish(names)
                before, version = first_choice(cluster), cluster.version()
                assert await cluster.replace_hosts(*await source.peers())
                assert [p.id for p in cluster.hosts] == list(names) and cluster.version() != version
                assert [p.up for p in cluster.hosts] == [n == "a" for n in names]  # newcomers: once healthy
                after = first_choice(cluster)
                moved = [(b, a) for b, a in zip(before, after) if b != a]
                if names == "abcd":  # d takes about 1/4, from the others alike
                    assert {a for _, a in moved} == {"d"} and len(moved) <= 1.2 * len(shards) / 4
                if names == "ad":  # only b's and c's shards move, about half
                    assert {b for b, _ in moved} == {"b", "c"} and len(moved) <= 1.2 * len(shards) / 2
            assert not await cluster.replace_hosts(*await source.peers())  # the same set: nothing to do
            with pytest.raises(PeerError):  # a sub-batch picked for a dropped node: read from the store instead
                cluster.reader(len(cluster.peers))
            await cluster.close()

    asyncio.run(scenario())
