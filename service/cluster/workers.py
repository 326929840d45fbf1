"""``serve --workers N``: N processes serve one host, each a member of the cluster.

Each worker is a whole service (``server.serve``) that owns the rendezvous share of the
shards given to its id (``peers.py``) and has its own slice of the cache
(``cache_dir/worker-<i>``, ``cache_size / N``, ``memory_cache / N``), so no block is
cached twice on a host.
All workers accept on the public port (``SO_REUSEPORT``: the kernel spreads the
connections), so a plain HTTP client gets any batch, whole and in order, from any
worker: members owned by a sibling are read from its cache directory (``siblings.py``),
or, when it has not cached them, come over that sibling's Unix socket. Each worker
also listens on a TCP port of its own, its URL in the routing tables
(``api/routing.py``), so the Python client can send each worker its own part of a batch.

The supervisor (this module, the process ``serve`` started as) holds every port for the
service's lifetime, bound but not listening: no other program takes a port while its
worker restarts, and a connection to a dead worker's own port is refused at once
instead of waiting in a queue nobody reads. It restarts a worker that dies, after a
pause (``--restart-pause``) that grows while the worker keeps dying; meanwhile the
siblings find it down and serve its shards: from its slabs while they are there
(read-only: a dead worker's directory is written by nobody, and its successor reopens
it), else from the store (``coalescer.py``). Each worker's counters are kept in files in
the supervisor's run directory, so the host's sums never go down while a worker restarts
(``keptcounters.py``). SIGTERM or SIGINT is passed on to every worker, which drains its
connections; the supervisor exits 0 once all are gone. SIGHUP is passed on too: each
worker reopens its datasets (``datasets/served.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, replace
from pathlib import Path

from shardfeed.service.cluster.keptcounters import keep_counters
from shardfeed.service.config import ServiceConfig, WorkerPlace
from shardfeed.service.observe.activity import Activity

log = logging.getLogger("shardfeed.workers")

LONGEST_PAUSE = 10.0
"""Seconds a dead worker waits for its restart at most, unless ``--restart-pause`` is longer:
the pause starts there and doubles while the worker keeps dying."""

STABLE_AFTER = 30.0
"""A worker that served this long before dying is restarted after the first pause again."""

STOP_TIMEOUT = 45.0
"""Seconds the workers have to drain after SIGTERM before they are killed (uvicorn's own
graceful timeout is 30 s)."""

SIBLING_WAIT = 10.0
"""Seconds a starting worker waits for its siblings before it accepts on the public port."""

BACKLOG = 2048
_PR_SET_PDEATHSIG = 1


async def worker_sockets(config: ServiceConfig) -> list[socket.socket]:
    """A worker's listening sockets: its own port, its Unix socket, then the shared public port.

    The public port is taken last, once every sibling's Unix socket exists (or after
    ``SIBLING_WAIT`` seconds): a batch served before its siblings listen would find
    them down and read, and cache, their shards here.
    """
    place = config.worker
    own = _bound(config.host, place.ports[place.index])
    path = place.sockets[place.index]
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)  # left by a predecessor that died
    unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    unix.bind(path)
    os.chmod(path, 0o600)
    for sock in (own, unix):
        sock.listen(BACKLOG)
    deadline = time.monotonic() + SIBLING_WAIT
    while not all(map(os.path.exists, place.sockets)) and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    public = _bound(config.host, config.port)
    public.listen(BACKLOG)
    return [public, own, unix]


def _bound(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port``, sharing the port with this service's other processes."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


@dataclass
class _Worker:
    config: ServiceConfig
    process: multiprocessing.process.BaseProcess | None = None
    started: float = 0.0
    pause: float = 0.0
    restart_at: float | None = None
    served: bool = False
    """Whether any run of this worker listened on its own port: an exit with an error before
    that is a startup failure (a bad dataset, an unreadable cache), not a crash to restart
    from. A death by a signal (the OOM killer during a long index build) is a crash."""


def supervise(config: ServiceConfig, serve_worker: Callable[[ServiceConfig], None], activity: Activity,
              announce: Callable[[int], None] = lambda port: None) -> int:
    """Run ``config.workers`` workers, each ``serve_worker(its config)``, until SIGTERM/SIGINT
    (or ``config.idle_exit`` seconds without a data request in ``activity``, whose slots are
    the workers'); ``announce(port)`` once the public port is bound (``--port 0``: any)."""
    count = config.workers
    try:
        held = [_bound(config.host, config.port)]
        held += [_bound(config.host, 0) for _ in range(count)]
    except OSError as err:
        raise ValueError(f"cannot bind {config.host}:{config.port}: {err.strerror}") from None
    port = held[0].getsockname()[1]
    announce(port)
    ports = tuple(sock.getsockname()[1] for sock in held[1:])
    rundir = tempfile.mkdtemp(prefix="shardfeed-")  # short: a Unix socket path has 107 bytes at most
    sockets = tuple(os.path.join(rundir, f"w{i}.sock") for i in range(count))
    cache_dirs = tuple(config.cache_dir / f"worker-{i}" for i in range(count))
    # In the run directory: counters live as long as this supervisor, as a lone service's do.
    counter_dirs = tuple(Path(rundir) / f"w{i}.counters" for i in range(count))
    workers = [_Worker(replace(config, port=port, cache_dir=cache_dirs[i], cache_size=config.cache_size // count,
                               memory_cache=config.memory_cache // count,
                               worker=WorkerPlace(i, ports, sockets, cache_dirs, counter_dirs,
                                                  Path(rundir) / "datasets.json")),
                       pause=config.restart_pause)
               for i in range(count)]
    stop: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, frame: stop.append(signum))
                for sig in (signal.SIGTERM, signal.SIGINT)}
    previous[signal.SIGHUP] = signal.signal(signal.SIGHUP, lambda signum, frame: _forward(workers, signum))
    log.info("%d workers on %s:%d (own ports %s)", count, config.host, port, ", ".join(map(str, ports)))
    try:
        for worker in workers:
            _start(worker, serve_worker)
        failed = _watch(workers, serve_worker, stop, lambda: _idle(config, activity))
        _stop(workers)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for sock in held:
            sock.close()
        shutil.rmtree(rundir, ignore_errors=True)
    if failed is not None:
        raise ChildProcessError(f"worker {failed} exited before serving (its error is above)")
    return 0


def _watch(workers: list[_Worker], serve_worker: Callable[[ServiceConfig], None], stop: list[int],
           idle: Callable[[], bool]) -> int | None:
    """Restart workers as they die, until asked to stop or ``idle()``; the index of a worker
    that never started."""
    while not stop:
        if all(worker.served for worker in workers) and idle():  # idle from serving on, not while starting
            return None
        alive = {w.process.sentinel: w for w in workers if w.process is not None}
        ready = multiprocessing.connection.wait(list(alive), timeout=0.1)
        now = time.monotonic()
        for worker in workers:
            if worker.process is not None and not worker.served and _listening(worker.config):
                worker.served = True
        for sentinel in ready:
            worker = alive[sentinel]
            worker.process.join()
            index = worker.config.worker.index
            if not worker.served and worker.process.exitcode >= 0:
                return index
            first = worker.config.restart_pause
            worker.pause = first if now - worker.started >= STABLE_AFTER else worker.pause
            log.warning("worker %d (pid %d) exited with %s; restarting it in %.1f s", index, worker.process.pid,
                        _status(worker.process.exitcode), worker.pause)
            worker.process, worker.restart_at = None, now + worker.pause
            worker.pause = min(2 * worker.pause, max(LONGEST_PAUSE, first))
        for worker in workers:
            if worker.process is None and worker.restart_at is not None and worker.restart_at <= now:
                _start(worker, serve_worker)
    log.info("stopping the workers (%s)", signal.Signals(stop[0]).name)
    return None


def _idle(config: ServiceConfig, activity: Activity) -> bool:
    idle = activity.idle()
    if config.idle_exit and idle >= config.idle_exit:
        log.info("no data request for %.0f s (--idle-exit %g): exiting", idle, config.idle_exit)
        return True
    return False


def _start(worker: _Worker, serve_worker: Callable[[ServiceConfig], None]) -> None:
    # fork: the worker starts at once from this process's state (the supervisor runs no
    # event loop and no threads, so there is nothing a fork would break).
    process = multiprocessing.get_context("fork").Process(
        target=_worker_main, args=(serve_worker, worker.config), name=f"shardfeed-worker-{worker.config.worker.index}")
    process.start()
    worker.process, worker.started, worker.restart_at = process, time.monotonic(), None


def _forward(workers: list[_Worker], signum: int) -> None:
    """Pass a signal on to every live worker (SIGHUP: each reopens its datasets)."""
    for worker in workers:
        if worker.process is not None and worker.process.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(worker.process.pid, signum)


def _worker_main(serve_worker: Callable[[ServiceConfig], None], config: ServiceConfig) -> None:
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # the supervisor's forwarding is not ours; the app's comes
    with contextlib.suppress(OSError, AttributeError):  # a worker never outlives its supervisor
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    try:
        keep_counters(config.worker.counter_dirs[config.worker.index])  # before the service makes its metrics
        serve_worker(config)
    except Exception as err:  # noqa: BLE001 - one line, as the CLI prints its own errors
        message = " ".join(str(err).split()) or type(err).__name__
        print(f"shardfeed: error: worker {config.worker.index}: {message}", file=sys.stderr)
        sys.exit(1)


def run_serving(main: Coroutine) -> None:
    """Run a serving process's event loop (a worker's, or a lone service's) on ``main``."""
    # uvicorn drains the connections on SIGTERM, then raises the signal again: by then the
    # shutdown was graceful, so exit 0 (and SIGTERM before serving starts still ends us).
    signal.signal(signal.SIGTERM, _exit_cleanly)
    # SIGHUP reopens the datasets once the app runs (``create_app``); until then it must not end us.
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        import uvloop
    except ImportError:
        asyncio.run(_then_ignore_sigterm(main))
    else:
        uvloop.run(_then_ignore_sigterm(main))


def _exit_cleanly(signum: int, frame) -> None:
    raise SystemExit(0)


async def _then_ignore_sigterm(main: Coroutine) -> None:
    # Once serving has ended, either way, the process is on its way out. A SIGTERM now (the
    # supervisor stopping a worker that fails on its own, as its sibling did) would break the
    # event loop's closing half-way, and the loop's executor thread would print a traceback.
    try:
        await main
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)


def _listening(config: ServiceConfig) -> bool:
    """Whether the worker accepts on its own port (only that worker listens there)."""
    try:
        with socket.create_connection((config.host, config.worker.ports[config.worker.index]), timeout=0.5):
            return True
    except OSError:
        return False


def _stop(workers: list[_Worker]) -> None:
    running = [w.process for w in workers if w.process is not None and w.process.is_alive()]
    for process in running:
        with contextlib.suppress(ProcessLookupError):
            os.kill(process.pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_TIMEOUT
    for process in running:
        process.join(max(0.0, deadline - time.monotonic()))
        if process.is_alive():
            log.warning("worker pid %d did not drain in %.0f s: killing it", process.pid, STOP_TIMEOUT)
            process.kill()
            process.join()


def _status(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        return signal.Signals(-exitcode).name
    return f"status {exitcode}"
