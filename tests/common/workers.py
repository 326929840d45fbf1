"""Helpers for tests of ``serve --workers N`` (a supervisor and its worker processes)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from shardfeed.client import Client
from shardfeed.faults import cached_blocks
from shardfeed.process import ServiceProcess, child_pids, start_service

from common.datasets import dir_put, make_dataset
from common.synthetic import seed_synthetic
from common.wait import wait_until


def directory_dataset(root: Path, samples: int, per_shard: int = 20) -> tuple[str, dict]:
    """A dataset of ``samples`` in shards of ``per_shard`` in a local directory: its URL and its bytes."""
    return root.as_uri(), make_dataset(dir_put(root), samples=samples, per_shard=per_shard)


def worker_urls(url: str) -> list[str]:
    """Each worker's own URL, in worker order (``/v1/cluster``)."""
    workers = httpx.get(f"{url}/v1/cluster", timeout=10).json()["workers"]
    assert [w["id"] for w in workers] == [f"w{i}" for i in range(len(workers))]
    return [w["url"] for w in workers]


def worker_pids(service) -> list[int]:
    """The pids of the supervisor's children, the workers (a restarted one has a new pid)."""
    return child_pids(service.process.pid)


def sibling_blocks(url: str, result: str) -> float:
    """``shardfeed_sibling_blocks_total{result}``: blocks read from siblings' files, absent or bad."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples
               if s.name == "shardfeed_sibling_blocks_total" and s.labels["result"] == result)


def worker_blocks(cache: Path, worker: int) -> set:
    """The blocks a worker's cache holds (its catalogue on disk)."""
    return set(cached_blocks(cache / f"worker-{worker}"))


def owned_shards(url: str, worker_url: str, samples: int, dataset: str = "train") -> list[list[int]]:
    """The samples of each shard a worker owns (from the routing table), shard by shard."""
    table = httpx.get(f"{url}/v1/datasets/{dataset}/routing", timeout=10).json()
    ends = table["starts"][1:] + [samples]
    return [list(range(start, end)) for start, end, owner in zip(table["starts"], ends, table["owner"])
            if table["urls"][owner] == worker_url]


def each_workers_shards(url: str, worker_urls: list[str], samples: int, at_least: int = 1,
                        dataset: str = "train") -> list[list[list[int]]]:
    """``owned_shards`` of ``dataset`` for every worker, once the routing table gives each ``at_least``
    shards: a worker not yet up owns none, its shards going to the live one."""
    def listed() -> list[list[list[int]]] | None:
        shards = [owned_shards(url, u, samples, dataset) for u in worker_urls]
        return shards if all(len(s) >= at_least for s in shards) else None

    return wait_until(listed, 60, f"the routing table giving every worker {at_least} shards")


@contextmanager
def routed_client(root: Path, **client_options) -> Iterator[Client]:
    """A client of ``serve --workers 2`` over 1000 synthetic samples (about 13 shards: each
    worker owns some; all on one: p < 0.001), once its routing table lists both workers."""
    with routed_service(root, **client_options) as (_, client):
        yield client


@contextmanager
def routed_service(root: Path, **client_options) -> Iterator[tuple[ServiceProcess, Client]]:
    """``routed_client``'s service (the workers' supervisor) and client."""
    url = seed_synthetic(root / "train", samples=1000)
    with start_service({"train": url}, cache_dir=root / "cache", workers=2) as svc, \
            Client(svc.url, **client_options) as client:
        def both_listed() -> bool:
            client.router.load("train", client._routing_table("train"))  # both workers up yet?
            return len({part.owner for part in client.router.split("train", list(range(1000)))}) == 2

        wait_until(both_listed, 60, "the routing table listing both workers")
        yield svc, client
