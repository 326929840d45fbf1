"""Small helpers for tests that talk to a running service."""

from __future__ import annotations

import io
import tarfile
import urllib.request

import httpx

from shardfeed.service.process import scrape_metrics as metrics  # noqa: F401  (re-exported for tests)


def tar_members(data: bytes) -> list[tuple[str, bytes]]:
    """Members of a tar response, read with Python's own tarfile (an independent parser)."""
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        return [(m.name, tar.extractfile(m).read()) for m in tar.getmembers()]


def hops(url: str, kind: str) -> float:
    """Sub-batches a node sent on to another ``replica`` or sibling ``worker`` (its peer requests)."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as resp:
        lines = resp.read().decode().splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines
               if line.startswith("shardfeed_peer_requests_total{") and f'kind="{kind}"' in line)


def fetch_batch(url: str, indices, dataset: str = "train") -> list[tuple[str, bytes]]:
    """``POST /v1/batch`` that must succeed: its tar members, in order."""
    resp = httpx.post(f"{url}/v1/batch", json={"dataset": dataset, "indices": list(indices)}, timeout=60)
    assert resp.status_code == 200, resp.text
    return tar_members(resp.content)
