"""Helpers for tests of ``serve --workers N`` (a supervisor and its worker processes)."""

from __future__ import annotations

from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from shardfeed.process import child_pids

from common.datasets import dir_put, make_dataset


def directory_dataset(root: Path, samples: int) -> tuple[str, dict]:
    """A dataset of ``samples`` in shards of 20 in a local directory: its URL and its bytes."""
    return root.as_uri(), make_dataset(dir_put(root), samples=samples, per_shard=20)


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


def cached_blocks(cache: Path, worker: int) -> set[str]:
    """The names of the block files in a worker's cache directory."""
    return {p.name for p in (cache / f"worker-{worker}").glob("*/*.blk")}


def owned_shards(url: str, worker_url: str, samples: int, dataset: str = "train") -> list[list[int]]:
    """The samples of each shard a worker owns (from the routing table), shard by shard."""
    table = httpx.get(f"{url}/v1/datasets/{dataset}/routing", timeout=10).json()
    ends = table["starts"][1:] + [samples]
    return [list(range(start, end)) for start, end, owner in zip(table["starts"], ends, table["owner"])
            if table["urls"][owner] == worker_url]
