"""``shardfeed stack``: the docker-compose stack as local processes, for a machine without Docker.

The same topology as ``docker-compose.yml`` (``tests/deploy/test_deploy.py`` checks that the two agree):
SeaweedFS (``weed mini``, S3 on ``--s3-port``) with the bucket ``shardfeed`` -> the seeder, which
writes a synthetic dataset to ``s3://shardfeed/train`` (skipped when ``index.parquet`` is already
there) -> three replicas ``shardfeed-0/1/2`` that are each other's ``--peers``, each with its own
cache. Everything binds to 127.0.0.1 and keeps its state under ``--dir``, so a second run reuses
the data and the caches (also after a crash: SeaweedFS reuses its directory, the caches their blocks).
SIGINT or SIGTERM stops every process the stack started, and it exits 0. Prometheus is left out: it
is not a Python package; point one at the replicas' ``/metrics`` if you want it.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import botocore.exceptions

from shardfeed.process import ServiceProcess, ensure_free, launch_service
from shardfeed.s3server import S3Server, start_seaweedfs

BUCKET = "shardfeed"
DATASET = "train"
DATASET_URL = f"s3://{BUCKET}/{DATASET}"
SAMPLES = 20000
SEED_ARGV = ("seed", DATASET_URL, "--size", "10KiB", "--shard-size", "8MiB")
"""The seeder's command line, without ``--samples`` (``SAMPLES`` unless told)."""
REPLICAS = ("shardfeed-0", "shardfeed-1", "shardfeed-2")
CACHE_SIZE = "2GiB"
# The compose file's defaults, so that a client configured for one works with the other.
DEFAULT_ACCESS_KEY, DEFAULT_SECRET_KEY = "shardfeed", "shardfeed-secret"
LOOPBACK = "127.0.0.1"


def seed_argv(samples: int = SAMPLES) -> list[str]:
    return [*SEED_ARGV[:2], "--samples", str(samples), *SEED_ARGV[2:]]


def replica_argv(name: str, *, host: str, port: int, peers: str, cache_dir: str) -> list[str]:
    """The ``shardfeed`` command line of replica ``name``: here, and in docker-compose.yml."""
    return ["serve", f"--host={host}", f"--port={port}", f"--dataset={DATASET}={DATASET_URL}",
            f"--cache-dir={cache_dir}", f"--cache-size={CACHE_SIZE}", f"--peers={peers}", f"--node-id={name}"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dir", type=Path, default=Path(".shardfeed/stack"),
                        help="state kept between runs: SeaweedFS data, caches, logs (default: %(default)s)")
    parser.add_argument("--port", type=int, default=8080,
                        help="port of shardfeed-0; the other replicas take the next ones (default: %(default)s)")
    parser.add_argument("--s3-port", type=int, default=8333, help="SeaweedFS's S3 port (default: %(default)s)")
    parser.add_argument("--samples", type=int, default=SAMPLES,
                        help="samples the seeder writes when the dataset is not there yet (default: %(default)s)")


class _Stop(Exception):
    """SIGINT or SIGTERM arrived."""


@contextmanager
def _stop_on_signals() -> Iterator[None]:
    """SIGINT and SIGTERM raise ``_Stop`` inside the block; the handlers before it come back after it."""
    def handler(signum, frame):
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the shutdown short
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise _Stop(signal.Signals(signum).name)

    before = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, previous in before.items():
            signal.signal(sig, previous)


def _seeded(server: S3Server) -> bool:
    try:
        server.client().head_object(Bucket=BUCKET, Key=f"{DATASET}/index.parquet")
        return True
    except botocore.exceptions.ClientError as err:
        if err.response["ResponseMetadata"]["HTTPStatusCode"] == 404:
            return False
        raise


def _seed(server: S3Server, samples: int, log_path: Path) -> None:
    """Run the seeder as its own process (the compose seeder's command line), stopping it if we are stopped."""
    with open(log_path, "wb") as log:
        process = subprocess.Popen([sys.executable, "-m", "shardfeed", *seed_argv(samples), "--quiet"],
                                   stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **server.env()})
    try:
        status = process.wait()
    finally:
        if process.poll() is None:
            process.terminate()
            process.wait()
    if status != 0:
        lines = log_path.read_text(errors="replace").strip().splitlines()
        raise RuntimeError(f"the seeder failed: {lines[-1] if lines else f'status {status}'} (log: {log_path})")


def _watch(replicas: dict[str, ServiceProcess]) -> None:
    """Wait for a signal; a replica that exits on its own is an error."""
    while True:
        for name, service in replicas.items():
            if service.process.poll() is not None:
                raise RuntimeError(f"{name} exited with status {service.process.returncode} "
                                   f"(log: {service.log_path})")
        time.sleep(0.5)


def run(args: argparse.Namespace) -> int:
    ports = {name: args.port + i for i, name in enumerate(REPLICAS)}
    for port in (args.s3_port, *ports.values()):
        if not 1 <= port <= 65535:
            raise ValueError(f"port {port} is out of range (1-65535)")
    if args.samples < 1:
        raise ValueError(f"--samples must be at least 1, not {args.samples}")
    ensure_free(args.s3_port, "SeaweedFS S3, --s3-port")
    for name, port in ports.items():
        ensure_free(port, f"{name}, --port")
    access_key = os.environ.get("AWS_ACCESS_KEY_ID", DEFAULT_ACCESS_KEY)
    secret_key = os.environ.get("AWS_SECRET_ACCESS_KEY", DEFAULT_SECRET_KEY)
    state = args.dir.resolve()
    state.mkdir(parents=True, exist_ok=True)
    began = time.monotonic()
    with _stop_on_signals(), ExitStack() as stack:
        try:
            server = start_seaweedfs(state / "seaweedfs", s3_port=args.s3_port, access_key=access_key,
                                     secret_key=secret_key)
            stack.callback(server.stop)
            server.create_bucket(BUCKET)
            if _seeded(server):
                print(f"{DATASET_URL} is already seeded", flush=True)
            else:
                print(f"seeding {DATASET_URL} ({args.samples} samples; log: {state / 'seed.log'})", flush=True)
                _seed(server, args.samples, state / "seed.log")
            urls = {name: f"http://{LOOPBACK}:{port}" for name, port in ports.items()}
            peers = ",".join(f"{name}={url}" for name, url in urls.items())
            replicas: dict[str, ServiceProcess] = {}
            for name, port in ports.items():
                argv = replica_argv(name, host=LOOPBACK, port=port, peers=peers, cache_dir=str(state / name))
                replicas[name] = launch_service(argv, port=port, log_path=state / f"{name}.log", env=server.env())
                stack.callback(replicas[name].stop)
            _announce(server, urls, state, time.monotonic() - began)
            _watch(replicas)
        except _Stop as stop:
            print(f"{stop}: stopping the stack", file=sys.stderr, flush=True)
    return 0


def _announce(server: S3Server, urls: dict[str, str], state: Path, seconds: float) -> None:
    first = next(iter(urls.values()))
    print(f"""
shardfeed stack up in {seconds:.0f}s (state in {state}):
  S3 (SeaweedFS): {server.endpoint}  bucket {BUCKET}, dataset {DATASET_URL}
  credentials:    AWS_ACCESS_KEY_ID={server.access_key} AWS_SECRET_ACCESS_KEY={server.secret_key}
  replicas:       {' '.join(urls.values())}
  status:         {first}/ and {first}/metrics (each replica)
  try:            python -c "from shardfeed.client import Client; print([s['__key__'] for s in Client('{first}').get_batch('{DATASET}', [17, 4, 9])])"
Ctrl-C stops everything.""", flush=True)
