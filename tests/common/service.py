"""Small helpers for tests that talk to a running service."""

from __future__ import annotations

import io
import tarfile

import httpx

from shardfeed.process import hops  # noqa: F401  (re-exported for tests)
from shardfeed.process import scrape_metrics as metrics  # noqa: F401  (re-exported for tests)


def tar_members(data: bytes) -> list[tuple[str, bytes]]:
    """Members of a tar response, read with Python's own tarfile (an independent parser)."""
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        return [(m.name, tar.extractfile(m).read()) for m in tar.getmembers()]


def fetch_batch(url: str, indices, dataset: str = "train") -> list[tuple[str, bytes]]:
    """``POST /v1/batch`` that must succeed: its tar members, in order."""
    resp = httpx.post(f"{url}/v1/batch", json={"dataset": dataset, "indices": list(indices)}, timeout=60)
    assert resp.status_code == 200, resp.text
    return tar_members(resp.content)
