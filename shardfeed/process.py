"""Run ``shardfeed serve`` as a subprocess on a free loopback port: for tests, the demo
and the benchmarks, which all talk to the real service over a real socket."""

from __future__ import annotations

import json
import os
import random
import shutil
import socket
import subprocess
import sys
import sysconfig
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")


def installed_script(name: str) -> str | None:
    """The path of command ``name`` installed beside this Python (a virtualenv need not be on PATH),
    else on PATH; None when neither has it."""
    return shutil.which(name, path=sysconfig.get_path("scripts")) or shutil.which(name)


LOWEST_PORT = 10000
"""``free_port`` draws from here up to the ephemeral range (well above the registered services)."""


def free_port() -> int:
    """A loopback port nothing is bound to now, for a server started next. Drawn below the
    kernel's ephemeral range: the outgoing connections of a busy test or benchmark take
    their ports from that range, and one could take this port before its server binds it."""
    first_ephemeral = _ephemeral_range()[0]
    draw = random.SystemRandom()
    for _ in range(100 if first_ephemeral > LOWEST_PORT + 1000 else 0):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", draw.randrange(LOWEST_PORT, first_ephemeral)))
            except OSError:
                continue
            return s.getsockname()[1]
    with socket.socket() as s:  # no room below the range: the kernel's choice
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def ensure_free(port: int, what: str, host: str = "127.0.0.1") -> None:
    """``OSError`` with a one-line message naming ``port`` and its use when it cannot be bound."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers bind: TIME_WAIT is no conflict
        try:
            s.bind((host, port))
        except OSError:
            raise OSError(f"port {port} ({what}) is in use on {host}: stop what uses it or choose another port") \
                from None


def scrape_metrics(url: str, timeout: float = 10, token: str | None = None) -> dict[str, float]:
    """A service's Prometheus metrics summed over labels: ``{"shardfeed_store_requests_total": 3.0}``."""
    request = urllib.request.Request(f"{url}/metrics", headers={"Authorization": f"Bearer {token}"} if token else {})
    with urllib.request.urlopen(request, timeout=timeout) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            name = name.split("{", 1)[0]
            out[name] = out.get(name, 0.0) + float(value)
    return out


def hops(url: str, kind: str, timeout: float = 10) -> float:
    """Sub-batches a service sent on to another ``replica`` or sibling ``worker``
    (``shardfeed_peer_requests_total`` of that kind, summed over peers and outcomes)."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=timeout) as resp:
        lines = resp.read().decode().splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines
               if line.startswith("shardfeed_peer_requests_total{") and f'kind="{kind}"' in line)


def stop_process(process: subprocess.Popen, timeout: float = 10) -> int:
    """SIGTERM, and SIGKILL after ``timeout`` seconds; the exit status."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    return process.returncode


class ServiceProcess:
    """A running service. Use as a context manager, or call ``stop()``."""

    def __init__(self, process: subprocess.Popen, url: str, log_path: Path):
        self.process = process
        self.url = url
        self.log_path = log_path

    def metrics(self) -> dict[str, float]:
        return scrape_metrics(self.url)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, timeout: float = 10) -> int:
        return stop_process(self.process, timeout)

    def __enter__(self) -> "ServiceProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def start_service(datasets: dict[str, str] | None = None, *, cache_dir: str | os.PathLike,
                  cache_size: str | None = None, port: int | None = None, env: dict[str, str] | None = None,
                  args: list[str] | tuple[str, ...] = (), workers: int = 1, timeout: float = 60) -> ServiceProcess:
    """Start ``shardfeed serve`` and wait until ``/healthz`` answers.

    Args:
        datasets: ``{name: url}``; None serves the embedded default.
        cache_dir: the block cache directory (also where the log file goes).
        cache_size: e.g. ``"1GiB"``; default the service's.
        env: extra environment (AWS settings, tokens).
        args: further ``serve`` arguments.
        workers: ``--workers``; one process unless asked, whatever the machine's cores.
    """
    port = port or free_port()
    cache_dir = Path(cache_dir)
    argv = ["serve", "--port", str(port), "--cache-dir", str(cache_dir), "--workers", str(workers)]
    for name, url in (datasets or {}).items():
        argv += ["--dataset", f"{name}={url}"]
    if cache_size:
        argv += ["--cache-size", cache_size]
    argv += list(args)
    cache_dir.mkdir(parents=True, exist_ok=True)
    return launch_service(argv, port=port, log_path=cache_dir.parent / f"service-{port}.log", env=env,
                          timeout=timeout)


def launch_service(argv: list[str], *, port: int, log_path: Path, env: dict[str, str] | None = None,
                   timeout: float = 60) -> ServiceProcess:
    """Run ``shardfeed <argv>`` (a ``serve`` command line listening on loopback ``port``) and wait
    until ``/healthz`` answers; its output goes to ``log_path``."""
    log_file = open(log_path, "wb")
    process = subprocess.Popen([sys.executable, "-m", "shardfeed", *argv], stdout=log_file, stderr=subprocess.STDOUT,
                               env={**os.environ, **(env or {})})
    log_file.close()
    service = ServiceProcess(process, f"http://127.0.0.1:{port}", log_path)
    return ready_or_stopped(service, lambda: _wait_healthy(service, timeout), service.stop)


def start_all(starts: Sequence[Callable[[], ServiceProcess]]) -> list[ServiceProcess]:
    """Run every one of ``starts`` (each ``start_service`` or ``launch_service``) at once, so that
    replicas come up together rather than one after another. If one fails, those that came
    up are stopped and its error is raised."""
    with ThreadPoolExecutor(max(1, len(starts))) as pool:
        futures = [pool.submit(start) for start in starts]
    started, error = [], None
    for future in futures:
        try:
            started.append(future.result())
        except BaseException as err:  # noqa: BLE001 - raised below, once the others are stopped
            error = error or err
    if error is not None:
        stop_all(started)
        raise error
    return started


def stop_all(services: Sequence[ServiceProcess], timeout: float = 10) -> None:
    """SIGTERM every service at once, then wait for each (SIGKILL after ``timeout`` seconds)."""
    for service in services:
        if service.process.poll() is None:
            service.process.terminate()
    for service in services:
        service.stop(timeout)


def ready_or_stopped(started: T, wait: Callable[[], None], stop: Callable[[], object]) -> T:
    """``started`` once ``wait()`` returns; when it raises (a signal or Ctrl-C while waiting too),
    ``stop()`` first, so that nothing is left running."""
    try:
        wait()
    except BaseException:
        stop()
        raise
    return started


def healthy(url: str, timeout: float = 2) -> bool:
    """Whether the service at ``url`` answers ``/healthz`` with a 2xx now."""
    try:
        with urllib.request.urlopen(f"{url}/healthz", timeout=timeout):
            return True
    except (urllib.error.URLError, OSError):  # refused, timed out, or an error status
        return False


def child_pids(pid: int) -> list[int]:
    """The pids of process ``pid``'s children: for ``serve --workers N``, its workers (a
    restarted worker has a new pid)."""
    return sorted(int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split())


def answering_pid(url: str, timeout: float = 2) -> int | None:
    """The pid that ``/healthz`` at ``url`` names now; None when nothing healthy answers."""
    try:
        with urllib.request.urlopen(f"{url}/healthz", timeout=timeout) as resp:
            return json.load(resp).get("pid")
    except (urllib.error.URLError, OSError, ValueError):  # refused, timed out, an error status or not JSON
        return None


def _wait_healthy(service: ServiceProcess, timeout: float) -> None:
    # Healthy means our own process answers (with --workers N, one of its workers): a stale
    # service left on a reused port would otherwise pass for the one just started.
    pid = service.process.pid
    deadline = time.monotonic() + timeout
    while (answer := answering_pid(service.url, timeout=1)) is None or not (
            answer == pid or answer in child_pids(pid)):
        if service.process.poll() is not None:
            raise RuntimeError(f"shardfeed serve exited with {service.process.returncode}:\n{service.log()[-3000:]}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"shardfeed serve did not become healthy:\n{service.log()[-3000:]}")
        time.sleep(0.05)
