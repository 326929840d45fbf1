from __future__ import annotations

import os
import tempfile

import pytest

from shardfeed.s3server import S3Server, start_moto, start_seaweedfs

from common.s3 import EVERY_SERVER, new_bucket, point_aws_at


def pytest_configure(config):
    # Every service a test starts leaves its address in the run directory (shardfeed/node.py):
    # one of this session's own (per xdist process), never the user's, so that a node service
    # of the user's is not found by the tests, nor theirs by the user.
    os.environ["SHARDFEED_RUN_DIR"] = tempfile.mkdtemp(prefix="shardfeed-test-run-")
    config.addinivalue_line("markers", "slow: several services, S3 servers, a browser or a benchmark: left out of "
                                       "`make check` (`-m 'not slow'`), run by `make test`")
    config.addinivalue_line("markers", "both_s3: run against every S3 server (SeaweedFS and moto) through "
                                       "the s3_server fixture")


def pytest_generate_tests(metafunc):
    """S3 round-trip tests (marked ``both_s3``) run once per server; the rest on moto."""
    if "s3_server" in metafunc.fixturenames and metafunc.definition.get_closest_marker("both_s3"):
        metafunc.parametrize("s3_server", EVERY_SERVER, indirect=True, scope="session")


@pytest.fixture(scope="session")
def moto() -> S3Server:
    """One moto S3 server (SigV4 checked) for the whole session."""
    server = start_moto()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def seaweedfs(tmp_path_factory) -> S3Server:
    """One SeaweedFS (``weed mini``, SigV4 checked) for the whole session, stopped with its
    whole process group even when tests fail."""
    server = start_seaweedfs(tmp_path_factory.mktemp("seaweedfs"))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def s3_server(request) -> S3Server:
    """The S3 server of this test: each of ``EVERY_SERVER`` for tests marked ``both_s3``, else moto."""
    return request.getfixturevalue(getattr(request, "param", "moto"))


@pytest.fixture
def s3_env(s3_server, monkeypatch) -> S3Server:
    """Point the AWS settings of this process (and its children) at the test's S3 server."""
    point_aws_at(s3_server, monkeypatch)
    return s3_server


@pytest.fixture
def bucket(s3_env) -> str:
    """A fresh, empty bucket name on the test's S3 server."""
    return new_bucket(s3_env)
