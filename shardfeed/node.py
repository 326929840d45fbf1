"""The services of this node, found through a per-user run directory.

Every ``shardfeed serve`` leaves its address there while it runs, so that ``shardfeed ps``
lists the node's services and ``shardfeed stop`` stops them; one of them may be *the node
service* (``serve --node``), the one a training script reaches by naming only a dataset
URL (``ShardfeedDataset("s3://bucket/prefix")``, ``client/node.py``), which starts it
when there is none. ::

    <run dir>/services/<pid>.json   one per running service: ``ServiceRecord``
    <run dir>/node.lock             held while a client looks for the node service or starts it
    <run dir>/node.log              the log of a node service a client started

The run directory is ``$SHARDFEED_RUN_DIR``, else ``$XDG_RUNTIME_DIR/shardfeed``, else
``/tmp/shardfeed-<uid>``; made with mode 0700 and refused when another user owns it,
since its records hold the node service's bearer token. A record outlives a service
killed with SIGKILL: a record whose process is gone, or is another process now holding
the same pid, is *stale*; readers skip it and remove it.

Dependency-free: the client, the service and the command line all use it.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

NODE_LOG = "node.log"
NODE_LOCK = "node.lock"


@dataclass(frozen=True)
class ServiceRecord:
    """A running service's address file."""

    pid: int
    """The process ``serve`` started as (the supervisor of ``--workers N``): SIGTERM it to stop them all."""
    url: str
    node: bool
    """Whether it is the node service (``serve --node``), which clients find and start."""
    ticks: int
    """The process's start time (``/proc/<pid>/stat``, clock ticks since boot): tells it from a
    later process that got the same pid."""
    started: float
    """Unix time it started serving."""
    cache_dir: str
    token: str | None = None
    """The bearer token it accepts, for clients of the node service (the file is the user's alone)."""
    log: str | None = None
    idle_exit: float = 0.0
    """Seconds without data requests after which it exits; 0: never."""

    @property
    def alive(self) -> bool:
        """Whether this record's process still runs (the same process, not a reused pid)."""
        return process_ticks(self.pid) == self.ticks


def run_dir() -> Path:
    """This user's run directory (made, mode 0700, on first use; ``PermissionError`` when
    another user owns it)."""
    chosen = os.environ.get("SHARDFEED_RUN_DIR")
    if chosen:
        path = Path(chosen)
    elif os.environ.get("XDG_RUNTIME_DIR"):
        path = Path(os.environ["XDG_RUNTIME_DIR"]) / "shardfeed"
    else:
        path = Path(tempfile.gettempdir()) / f"shardfeed-{os.getuid()}"
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    if path.stat().st_uid != os.getuid():
        raise PermissionError(f"the shardfeed run directory {path} belongs to another user: "
                              "set SHARDFEED_RUN_DIR to a directory of yours")
    (path / "services").mkdir(mode=0o700, exist_ok=True)
    return path


def process_ticks(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks since boot), or None if there is none (or
    only its zombie, which its parent has not reaped yet)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may hold spaces: count from its end.
    fields = stat[stat.rindex(")") + 2:].split()
    if fields[0] in ("Z", "X"):  # field 3, the state: dead
        return None
    return int(fields[19])  # field 22, starttime


def record_path(pid: int, directory: Path | None = None) -> Path:
    return (directory or run_dir()) / "services" / f"{pid}.json"


def write_record(record: ServiceRecord) -> Path:
    """Leave ``record`` in the run directory (atomically, readable by this user only)."""
    path = record_path(record.pid)
    temp = path.with_suffix(f".{os.getpid()}.tmp")
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        json.dump(asdict(record), out)
    os.replace(temp, path)
    return path


def announce(url: str, **fields) -> Path:
    """Leave this process's record: its ``url`` and the other ``ServiceRecord`` ``fields``."""
    pid = os.getpid()
    return write_record(ServiceRecord(pid=pid, url=url, ticks=process_ticks(pid) or 0, started=time.time(), **fields))


def remove_record(pid: int) -> None:
    with contextlib.suppress(OSError):
        record_path(pid).unlink()


def services() -> list[ServiceRecord]:
    """The live services of this node, oldest first; stale records are removed."""
    found = []
    for path in sorted((run_dir() / "services").glob("*.json")):
        try:
            record = ServiceRecord(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError):  # half-written by a crash, or from another version
            record = None
        if record is None or not record.alive:
            with contextlib.suppress(OSError):
                path.unlink()
            continue
        found.append(record)
    return sorted(found, key=lambda r: r.started)


def node_service() -> ServiceRecord | None:
    """The live node service, if any (the oldest, should there be two)."""
    return next((r for r in services() if r.node), None)


@contextlib.contextmanager
def node_lock(timeout: float) -> Iterator[None]:
    """Hold the node lock (``TimeoutError`` after ``timeout`` seconds of waiting for it).
    An ``flock``: released by the kernel when its holder dies, so it is never stale."""
    fd = os.open(run_dir() / NODE_LOCK, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"waited {timeout:g} s for {run_dir() / NODE_LOCK}, held by another "
                                       "process starting the node's shardfeed service") from None
                time.sleep(0.05)
        yield
    finally:
        os.close(fd)  # releases the lock


def stop_service(record: ServiceRecord, timeout: float = 60.0) -> bool:
    """SIGTERM the service (it drains its connections) and wait up to ``timeout`` seconds for
    it to exit; whether it did."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(record.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while record.alive:
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    remove_record(record.pid)
    return True


def last_line(path: str | os.PathLike, limit: int = 64 * 1024) -> str:
    """The last non-empty line of a log file ("" when there is none)."""
    try:
        with open(path, "rb") as log:
            log.seek(max(0, log.seek(0, os.SEEK_END) - limit))
            lines = log.read().decode(errors="replace").splitlines()
    except OSError:
        return ""
    return next((line.strip() for line in reversed(lines) if line.strip()), "")
