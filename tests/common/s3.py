"""Pointing a test at one of the S3 servers (used by conftest's fixtures and by tests that pick
the server themselves)."""

from __future__ import annotations

import itertools
import os

import pytest

from shardfeed.s3server import S3_SERVERS, S3Server

_bucket_ids = itertools.count()

EVERY_SERVER = [server if server == "moto" else pytest.param(server, marks=pytest.mark.slow) for server in S3_SERVERS]
"""Each S3 server as a test parameter; moto alone in `make check` (``-m "not slow"``),
SeaweedFS's round left to `make test`."""


def point_aws_at(server: S3Server, monkeypatch: pytest.MonkeyPatch) -> None:
    """Set the AWS settings of this process (and its children) to ``server``'s, and only those."""
    for key in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE"):
        monkeypatch.delenv(key, raising=False)
    for key, value in server.env().items():
        monkeypatch.setenv(key, value)


def new_bucket(server: S3Server) -> str:
    """A fresh, empty bucket on ``server``."""
    name = f"test-{os.getpid()}-{next(_bucket_ids)}"
    server.create_bucket(name)
    return name
