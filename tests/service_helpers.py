"""Small helpers for tests that talk to a running service."""

from __future__ import annotations

import io
import tarfile

from shardfeed.service.process import scrape_metrics as metrics  # noqa: F401  (re-exported for tests)


def tar_members(data: bytes) -> list[tuple[str, bytes]]:
    """Members of a tar response, read with Python's own tarfile (an independent parser)."""
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        return [(m.name, tar.extractfile(m).read()) for m in tar.getmembers()]
