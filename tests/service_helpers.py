"""Small helpers for tests that talk to a running service."""

from __future__ import annotations

import io
import tarfile
import urllib.request


def metrics(url: str) -> dict[str, float]:
    """The service's Prometheus metrics, summed over labels: ``{"shardfeed_store_requests_total": 3.0}``."""
    text = urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            name = name.split("{", 1)[0]
            out[name] = out.get(name, 0.0) + float(value)
    return out


def tar_members(data: bytes) -> list[tuple[str, bytes]]:
    """Members of a tar response, read with Python's own tarfile (an independent parser)."""
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        return [(m.name, tar.extractfile(m).read()) for m in tar.getmembers()]
