from __future__ import annotations

import itertools
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from shardfeed.benchmarks.s3server import MotoS3, start_moto  # noqa: E402

_bucket_ids = itertools.count()


@pytest.fixture(scope="session")
def moto() -> MotoS3:
    """One moto S3 server (SigV4 checked) for the whole session."""
    server = start_moto()
    yield server
    server.stop()


@pytest.fixture
def s3_env(moto, monkeypatch) -> MotoS3:
    """Point the AWS settings of this process (and its children) at the moto server."""
    for key in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE"):
        monkeypatch.delenv(key, raising=False)
    for key, value in moto.env().items():
        monkeypatch.setenv(key, value)
    return moto


@pytest.fixture
def bucket(s3_env) -> str:
    """A fresh, empty bucket name on the moto server."""
    name = f"test-{os.getpid()}-{next(_bucket_ids)}"
    s3_env.create_bucket(name)
    return name
