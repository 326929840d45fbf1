"""A real S3 server on loopback for tests and benchmarks: moto's server in a subprocess, with SigV4 checking on.

moto checks signatures only after ``INITIAL_NO_AUTH_ACTION_COUNT`` unauthenticated
requests; we spend those creating an IAM user with an allow-all policy and an access
key, then sign everything with that key (a wrong secret then gets 403).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

import boto3
import botocore.config


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class MotoS3:
    endpoint: str
    access_key: str
    secret_key: str
    process: subprocess.Popen
    region: str = "us-east-1"

    def env(self) -> dict[str, str]:
        """Environment variables that point boto3 / shardfeed at this server."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_DEFAULT_REGION": self.region,
        }

    def client(self, secret_key: str | None = None):
        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=self.access_key,
            aws_secret_access_key=secret_key or self.secret_key,
            region_name=self.region,
            config=botocore.config.Config(s3={"addressing_style": "path"}, retries={"max_attempts": 1}),
        )

    def create_bucket(self, name: str) -> None:
        self.client().create_bucket(Bucket=name)

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(5)
        except subprocess.TimeoutExpired:
            self.process.kill()


def start_moto() -> MotoS3:
    port = free_port()
    env = dict(os.environ, INITIAL_NO_AUTH_ACTION_COUNT="3", MOTO_PORT=str(port))
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError("moto server did not start")
            time.sleep(0.1)
    iam = boto3.client("iam", endpoint_url=endpoint, region_name="us-east-1",
                       aws_access_key_id="bootstrap", aws_secret_access_key="bootstrap")
    iam.create_user(UserName="shardfeed")
    iam.put_user_policy(
        UserName="shardfeed", PolicyName="allow-all",
        PolicyDocument=json.dumps({"Version": "2012-10-17", "Statement": [
            {"Effect": "Allow", "Action": "*", "Resource": "*"}]}),
    )
    key = iam.create_access_key(UserName="shardfeed")["AccessKey"]
    return MotoS3(endpoint, key["AccessKeyId"], key["SecretAccessKey"], proc)
