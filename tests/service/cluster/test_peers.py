"""Peer lists: ids, this node's place among them (pure functions, no service)."""

from __future__ import annotations

import pytest

from shardfeed.service.cluster.sources import parse_peers


def test_plain_urls_on_one_host_get_host_and_port_ids():
    peers, me = parse_peers("http://127.0.0.1:8081,http://127.0.0.1:8082,http://other:8080",
                            "127.0.0.1:8082")
    assert [p.id for p in peers] == ["127.0.0.1:8081", "127.0.0.1:8082", "other"]
    assert me == 1
    assert parse_peers("http://127.0.0.1:8081,http://127.0.0.1:8082", "http://127.0.0.1:8081")[1] == 0


def test_plain_urls_on_distinct_hosts_keep_host_name_ids():
    peers, me = parse_peers("http://shardfeed-0.svc:8080,http://shardfeed-1.svc:8080", "shardfeed-1")
    assert [p.id for p in peers] == ["shardfeed-0.svc", "shardfeed-1.svc"]
    assert me == 1


def test_a_node_id_naming_a_shared_host_is_ambiguous():
    with pytest.raises(ValueError, match="matches several of --peers"):
        parse_peers("http://127.0.0.1:8081,http://127.0.0.1:8082", "127.0.0.1")


def test_named_peers_must_still_be_unique():
    with pytest.raises(ValueError, match="peer ids must be unique"):
        parse_peers("a=http://h1:1,a=http://h2:1", "a")
    with pytest.raises(ValueError, match="bad port"):
        parse_peers("http://h1:99999", "h1")
