"""The node's service for a training script that names only a dataset URL.

``ShardfeedDataset("s3://bucket/prefix")`` (or ``file://``, or a path) needs no service
started by hand: :func:`node_dataset` finds the node service (``shardfeed serve --node``)
through the per-user run directory (:mod:`shardfeed.node`), starts it when there is none,
registers the dataset with it and returns a client of it. Every rank and DataLoader
worker of the node then shares that one service and its cache. Concurrent first starts
(the ranks of ``torchrun``) settle on one service: the run directory's lock is held while
one of them looks and starts, and the others find its address file once it serves.

The started service inherits this process's environment (the AWS settings it reads the
store with) and takes its options from ``$SHARDFEED_SERVE_ARGS`` (``serve`` flags, e.g.
``--cache-size 200GiB --workers 8``); its log is ``<run dir>/node.log`` (the one before,
``node.log.1``). It exits after ``--idle-exit`` (15 minutes by default) without a request;
while a process holds a dataset read through it, a thread of that process asks it a
question every third of that time, so a long evaluation between epochs does not find it
gone. ``shardfeed ps`` lists it, ``shardfeed stop`` stops it.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shlex
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path
from urllib.parse import urlparse

import httpx

from shardfeed import node

from .errors import ShardfeedError
from .sync import Client

log = logging.getLogger("shardfeed.client")

SERVE_ARGS_ENV = "SHARDFEED_SERVE_ARGS"
START_TIMEOUT = 120.0
"""Seconds a node service has to answer its first health check after it was started."""

HEALTH_TIMEOUT = 2.0


class ServiceStartError(ShardfeedError):
    """The node's service could not be started (or found): the message ends with its log's last line."""


def is_dataset_url(url: object) -> bool:
    """Whether ``url`` names a dataset (``s3://``, ``file://``, a path), not a service (``http(s)://``)."""
    return isinstance(url, (str, os.PathLike)) and urlparse(os.fspath(url)).scheme in ("", "file", "s3")


def absolute_url(url: str | os.PathLike) -> str:
    """``url`` as the service must be told it: a path made absolute (the service's working
    directory is not this script's), as a ``file://`` URL."""
    text = os.fspath(url)
    scheme = urlparse(text).scheme
    if scheme == "s3":
        return text.rstrip("/")
    path = urlparse(text).path if scheme == "file" else text
    return Path(path).expanduser().resolve().as_uri()


def dataset_name(url: str) -> str:
    """The name a dataset URL is registered under: its last path segment, made a valid name,
    and a digest of the whole URL (two datasets never share a name, one URL always gets the same)."""
    last = re.sub(r"[^A-Za-z0-9._-]", "-", urlparse(url).path.rstrip("/").rpartition("/")[2] or
                  urlparse(url).netloc).strip(".-_")[:64]
    digest = hashlib.sha1(url.encode()).hexdigest()[:10]
    return f"{last}-{digest}" if last else digest


def node_dataset(url: str | os.PathLike, client_options: dict) -> tuple[Client, str]:
    """A client of the node's service (started if need be) and the name ``url`` is served under."""
    url = absolute_url(url)
    record = node_service()
    name = dataset_name(url)
    client = Client(record.url, **{"token": record.token, **client_options})

    def progress(registering: dict) -> None:
        indexing = registering.get("indexing")
        if indexing:
            log.warning("shardfeed: indexing %s: %.0f%% of %d shards' headers (%.0f s)", url,
                        100 * indexing["fraction"], indexing["shards"], indexing["seconds"])

    client.register_dataset(name, url, on_progress=progress)
    if record.idle_exit:
        _keep_alive(client, name, record)
    return client, name


_kept: weakref.WeakKeyDictionary[Client, tuple[str, str | None, float]] = weakref.WeakKeyDictionary()
"""The node service's clients this process holds, with what keeps the service alive for them."""
_keeper: threading.Thread | None = None
_keeper_lock = threading.Lock()
_wake = threading.Event()


def _keep_alive(client: Client, name: str, record: node.ServiceRecord) -> None:
    """While ``client`` lives (its dataset is held: between epochs, through a long evaluation),
    ask the service about ``name`` often enough that ``--idle-exit`` does not stop it."""
    global _keeper
    with _keeper_lock:
        _kept[client] = (f"{record.url}/v1/datasets/{name}", record.token, record.idle_exit / 3)
        _wake.set()  # its interval may be shorter than the one the thread sleeps out
        if _keeper is None or not _keeper.is_alive():  # none yet, or this is a fork of the process that had it
            _keeper = threading.Thread(target=_keep_pinging, name="shardfeed-keep-alive", daemon=True)
            _keeper.start()


def _keep_pinging() -> None:
    global _keeper
    while True:
        with _keeper_lock:
            kept = list(_kept.values())
            if not kept:  # every dataset it kept alive is gone
                _keeper = None
                return
        _wake.wait(min(interval for _, _, interval in kept))
        _wake.clear()
        for url, token, _ in list(_kept.values()):
            try:
                httpx.get(url, headers={"Authorization": f"Bearer {token}"} if token else {}, timeout=10, verify=False)
            except httpx.HTTPError:
                pass  # gone: the next batch finds out, and says so


def node_service(timeout: float = START_TIMEOUT) -> node.ServiceRecord:
    """The node's service, answering: the one running, or one started now (``ServiceStartError``)."""
    with node.node_lock(timeout + 30):
        record = node.node_service()
        if record is not None:
            if _healthy(record, patience=timeout):  # one started by hand may still be opening datasets
                return record
            raise ServiceStartError(f"the node's shardfeed service (pid {record.pid}, {record.url}) does not "
                                    f"answer; `shardfeed stop {record.pid}` stops it{_log_hint(record.log)}")
        return _start(timeout)


def _start(timeout: float) -> node.ServiceRecord:
    run_dir = node.run_dir()
    log_path = run_dir / node.NODE_LOG
    if log_path.exists():
        log_path.replace(log_path.with_suffix(".log.1"))
    command = [sys.executable, "-m", "shardfeed", "serve", "--node", "--log-file", str(log_path),
               *shlex.split(os.environ.get(SERVE_ARGS_ENV, ""))]
    log.info("shardfeed: starting the node's service: %s", shlex.join(command))
    with open(log_path, "ab") as out:
        # Its own session: a Ctrl-C of this job does not stop the service that other jobs share.
        process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                   start_new_session=True)
    deadline = time.monotonic() + timeout
    while True:
        if process.poll() is not None:
            raise ServiceStartError(f"the node's shardfeed service did not start (exit status {process.returncode})"
                                    f"{_log_hint(log_path)}")
        record = next((r for r in node.services() if r.pid == process.pid), None)
        if record is not None and _healthy(record):
            log.info("shardfeed: the node's service serves at %s (pid %d)", record.url, record.pid)
            return record
        if time.monotonic() >= deadline:
            process.kill()
            raise ServiceStartError(f"the node's shardfeed service did not answer within {timeout:g} s"
                                    f"{_log_hint(log_path)}")
        time.sleep(0.1)


def _healthy(record: node.ServiceRecord, patience: float = 0.0) -> bool:
    """Whether ``record``'s service answers ``/healthz`` (trying for ``patience`` seconds)."""
    deadline = time.monotonic() + patience
    while True:
        try:
            if httpx.get(f"{record.url}/healthz", timeout=HEALTH_TIMEOUT, verify=False).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        if time.monotonic() >= deadline or not record.alive:
            return False
        time.sleep(0.1)


def _log_hint(path: str | os.PathLike | None) -> str:
    if path is None:
        return ""
    line = node.last_line(path)
    return f": {line} (log: {path})" if line else f" (log: {path})"
