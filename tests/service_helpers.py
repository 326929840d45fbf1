"""Small helpers for tests that talk to a running service."""

from __future__ import annotations

import io
import tarfile
import urllib.request

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
