"""Replicas that follow their membership source while a client reads: ``--peers-from file:`` and
``--peers-from dns+srv:`` (a real DNS server on loopback), ownership moved as rendezvous hashing
moves it, no sample wrong, lost or duplicated."""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path

import httpx
import pytest

from shardfeed.client import Client
from shardfeed.process import free_port, start_all, start_service, stop_all

from common.cli import refusals
from common.dnsserver import ServiceRecords, dns_server
from common.service import metrics
from common.wait import wait_until
from common.workers import directory_dataset

pytestmark = pytest.mark.slow  # starts several services; not in `make check`

SAMPLES = 480  # 24 shards of 20
NAMES = "abcd"
REFRESH = "0.3"


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    url, source = directory_dataset(tmp_path_factory.mktemp("membership") / "train", SAMPLES)
    by_sample: dict[int, dict] = {}
    for (i, field), data in source.items():
        by_sample.setdefault(i, {"__key__": f"sample{i:06d}", "__index__": i})[field] = data
    return url, by_sample


def write_peers(path: Path, ports: dict[str, int], names: str) -> None:
    """The peers file, replaced at once (as a ConfigMap update swaps its symlink)."""
    lines = ["# shardfeed replicas", ""] + [f"{n}=http://127.0.0.1:{ports[n]}  # replica {n}" for n in names]
    tmp = path.with_suffix(".tmp")
    tmp.write_text("\n".join(lines) + "\n")
    tmp.replace(path)


def ownership(url: str) -> tuple[str, dict[int, str]]:
    """A replica's routing version and the owner URL of each shard (by its first sample)."""
    table = httpx.get(f"{url}/v1/datasets/train/routing", timeout=10).json()
    return table["version"], {start: table["urls"][o] for start, o in zip(table["starts"], table["owner"])}


def settle(urls: list[str], size: int, timeout: float = 20) -> str:
    """Wait until every replica in ``urls`` lists ``size`` peers, all up, and they agree on the
    routing version; that version."""
    deadline = time.monotonic() + timeout
    while True:
        views = [httpx.get(f"{u}/v1/cluster", timeout=10).json()["peers"] for u in urls]
        versions = {ownership(u)[0] for u in urls}
        if all(len(v) == size and all(p["up"] for p in v) for v in views) and len(versions) == 1:
            return versions.pop()
        assert time.monotonic() < deadline, f"replicas never settled on {size} peers: {views}"
        time.sleep(0.2)


class Reader(threading.Thread):
    """A client reading shuffled batches until stopped, checking each one byte for byte."""

    def __init__(self, url: str, by_sample: dict[int, dict]):
        super().__init__(daemon=True)
        self.url, self.by_sample = url, by_sample
        self.stop = threading.Event()
        self.batches = self.samples = 0
        self.wrong: list[list[int]] = []
        self.error: BaseException | None = None
        self.version = ""
        """The routing version of the client's table after its last batch."""
        self.announced: dict[str, tuple[int, float]] = {}
        """Routing version -> the batch whose answer first carried it, and when."""
        self.taken: dict[str, tuple[int, float]] = {}
        """Routing version -> the first batch the client sent on a table of it, and when it ended."""

    def run(self) -> None:
        rng = random.Random(11)
        try:
            with Client(self.url) as client:
                saw = client.router.saw  # observed, not changed: which answer told the client first

                def noted(dataset: str, version: str | None, base: str) -> None:
                    self.announced.setdefault(version, (self.batches, time.monotonic()))
                    saw(dataset, version, base)

                client.router.saw = noted
                while not self.stop.is_set():
                    batch = rng.sample(range(SAMPLES), 32)
                    if client.get_batch("train", batch) != [self.by_sample[i] for i in batch]:
                        self.wrong.append(batch)
                    self.batches += 1
                    self.samples += len(batch)
                    self.version = client.router.version("train")
                    self.taken.setdefault(self.version, (self.batches - 1, time.monotonic()))
        except BaseException as err:  # noqa: BLE001 - reported by the test
            self.error = err

    def finish(self) -> None:
        self.stop.set()
        self.join(60)
        assert not self.is_alive() and self.error is None, self.error
        assert self.wrong == [] and self.batches > 0


def moved(before: dict[int, str], after: dict[int, str]) -> set[int]:
    return {shard for shard in before if before[shard] != after[shard]}


class FileMembers:
    """The members as lines of a peers file (``--peers-from file:``)."""

    def __init__(self, path: Path, ports: dict[str, int]):
        self.path, self.ports = path, ports
        self.spec = f"file:{path}"
        self.error = "membership: file:"

    def set(self, names: str) -> None:
        write_peers(self.path, self.ports, names)

    def break_(self) -> None:
        self.path.write_text("this is not a peer list\n")


class DnsMembers:
    """The members as SRV records of a real DNS server (``--peers-from dns+srv:``)."""

    def __init__(self, records: ServiceRecords, server: str, ports: dict[str, int]):
        self.records, self.ports = records, ports
        self.spec = f"dns+srv:{records.srv_name}@{server}"
        self.error = "membership: dns+srv:"

    def set(self, names: str) -> None:
        self.records.failing = False
        self.records.members = {n: self.ports[n] for n in names}

    def break_(self) -> None:
        self.records.failing = True


def churn(tmp_path: Path, dataset, ports: dict[str, int], members) -> None:
    """Replicas a, b, c, then d joins, then c fails and b and c leave, while a client reads batches: every
    batch byte for byte, ownership moved only as rendezvous hashing moves it, a new routing
    version each time and the client on it; a source that fails keeps the set."""
    url, by_sample = dataset
    urls = {n: f"http://127.0.0.1:{ports[n]}" for n in NAMES}
    members.set("abc")

    def start(name):
        return lambda: start_service({"train": url}, cache_dir=tmp_path / f"cache-{name}", port=ports[name],
                                     args=["--node-id", name, "--peers-from", members.spec,
                                           "--peers-refresh", REFRESH, "--block-size", "64KiB"])

    services = dict(zip("abc", start_all([start(n) for n in "abc"])))
    reader = Reader(urls["a"], by_sample)
    try:
        version3 = settle([urls[n] for n in "abc"], 3)
        _, owners3 = ownership(urls["a"])
        reader.start()
        wait_until(lambda: reader.batches >= 3, 30, "the reader's first batches")

        members.set("abcd")  # d joins: the others list it before it is up
        services["d"] = start("d")()
        version4 = settle([urls[n] for n in NAMES], 4)
        _, owners4 = ownership(urls["a"])
        assert version4 != version3
        # Rendezvous hashing moves to d exactly the shards d now owns, and nothing else.
        assert moved(owners3, owners4) == {s for s, owner in owners4.items() if owner == urls["d"]}
        before = reader.batches
        wait_until(lambda: reader.batches >= before + 3, 30, "the reader's batches on four replicas")

        before = reader.batches
        members.break_()  # a source that fails keeps the set
        wait_until(lambda: members.error in services["a"].log() and reader.batches > before, 30,
                   "the failing source reported, the reader served")
        assert ownership(urls["a"]) == (version4, owners4)

        services["c"].process.kill()  # c fails (no goodbye) while it serves sub-batches: routed around
        services.pop("c").process.wait()
        before = reader.batches
        wait_until(lambda: reader.batches >= before + 3, 30, "the reader's batches routed around c")
        members.set("ad")  # then the source drops b and c; b stops
        version2 = settle([urls["a"], urls["d"]], 2)
        services.pop("b").stop()
        _, owners2 = ownership(urls["a"])
        assert version2 not in (version3, version4)
        # Only the shards of the replicas that left move.
        assert moved(owners4, owners2) == {s for s, owner in owners4.items() if owner in (urls["b"], urls["c"])}
        assert set(owners2.values()) == {urls["a"], urls["d"]}
        deadline = time.monotonic() + 10
        while reader.version != version2:  # the client follows: an answer told it its table is stale
            assert time.monotonic() < deadline, "the client never took the new routing table"
            time.sleep(0.1)
        reader.finish()
        assert metrics(urls["a"])["shardfeed_peers_up"] == 2
        # From the first answer that carried a new version to the first batch sent on it.
        for n, v in ((4, version4), (2, version2)):
            (taken, ended), (announced, at) = reader.taken[v], reader.announced[v]
            print(f"routing: {n} replicas' version taken {taken - announced} batches, {ended - at:.3f} s after an "
                  "answer carried it")
    finally:
        reader.stop.set()
        stop_all(list(services.values()))


def test_file_source_follows_three_to_four_to_two_replicas_under_a_reading_client(dataset, tmp_path):
    ports = {n: free_port() for n in NAMES}
    churn(tmp_path, dataset, ports, FileMembers(tmp_path / "peers", ports))


def test_dns_srv_source_follows_three_to_four_to_two_replicas_under_a_reading_client(dataset, tmp_path):
    ports = {n: free_port() for n in NAMES}
    with dns_server("peers.test") as (records, server):
        churn(tmp_path, dataset, ports, DnsMembers(records, server, ports))


def test_a_bad_peers_source_fails_serve_at_start_with_one_clear_line(dataset, tmp_path):
    url, _ = dataset
    port = free_port()
    good = tmp_path / "peers"
    good.write_text(f"a=http://127.0.0.1:{port}\n")
    cases = [
        ("a", "ftp:/etc/peers", "--peers-from 'ftp:/etc/peers': expected file:PATH"),
        ("a", f"file:{tmp_path / 'missing'}", "No such file or directory"),
        ("a", "dns:peers.test:99999", "bad port '99999'"),
        ("a", "dns+srv:_http._tcp.peers.test@127.0.0.1:x", "bad port 'x'"),
        ("a", "dns+srv:_http._tcp.peers.test@ns.example", "nameserver 'ns.example' is not an IP address"),
        ("z", f"file:{good}", "--node-id 'z' is not one of --peers"),  # the file must name this replica
    ]
    serve = ["serve", "--dataset", f"train={url}", "--cache-dir", str(tmp_path / "c"), "--port", str(port),
             "--workers", "1"]
    runs = refusals([[*serve, "--node-id", node, "--peers-from", spec] for node, spec, _ in cases])
    for (_, spec, message), run in zip(cases, runs):
        assert run.returncode != 0 and message in run.stderr, (spec, run.stderr)
        assert "Traceback" not in run.stderr