"""``TransformPool``: the processes that run the served transforms, so the event loop never decodes.

Each of ``processes`` processes loads every served transform once (``shardfeed.transforms.load``)
and then runs one job at a time: ``prepare`` (or the prepared arrays the cache gave) then
``apply`` (augment, seeded by ``(seed, epoch, index)``, and the output check), answering a
``Done`` with the packed arrays or a ``Failed`` naming what went wrong. A sample's fault never
raises out of ``run``: an exception is that job's ``Failed`` and the process goes on; a job past
``deadline`` seconds has its process killed and replaced, and is ``Failed``; a process that dies
under a job (``os._exit``, a segfault, the OOM killer) is replaced and the job runs once more on
a fresh process, ``Failed`` only if that one dies too (a job that kills every process it meets
must not take the pool down with it, nor be blamed for a death that was not its own).

Each process has a thread of its own in the service that feeds it: the thread takes the next job
from one queue that every ``run`` call shares (first come, first served, job by job: a retried job
keeps its place), pickles it down the pipe, waits for the answer or the deadline and unpickles it;
the last job of a call settles the call's one future. So the loop only awaits a future a call;
pickling the payloads (a few MiB a job) happens in those threads, decoding in the processes. What
is in flight is what the callers gave: the service admits batches of at most ``--max-batch``.
Measured on 2 busy cores: 235 us a job of wall time (75 us of the service's CPU) for a transform
that does nothing; 256 KiB arrays in and out, 400-460 jobs a second (0.45 ms of the service's
CPU a job, mostly the pipe's copies); the loop's worst lag no worse than with the pool idle.

The processes come from the ``forkserver`` context: the service has threads, so ``fork`` is not
safe, and measured here (2 cores, Python 3.11) a ``spawn`` start costs 320 ms a process (the
interpreter and numpy each time) where the fork server, with this module preloaded, forks a
ready one in 6 ms after its own first start (250 ms): a killed process is back at once. Its
processes are the fork server's children, not the service's: none inherits the service's
sockets or another process's pipe, so a dead process's pipe reads as closed.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import logging
import multiprocessing
import multiprocessing.connection
import queue
import signal
import threading
import time
from collections import deque
from dataclasses import dataclass

from shardfeed.transforms import Transform, TransformError, apply, checked, load, pack, unpack

log = logging.getLogger("shardfeed.transform")
_CONTEXT = multiprocessing.get_context("forkserver")
LOAD_TIMEOUT = 60.0
"""Seconds a process may take to load the transforms (imports included) before start() gives up."""
BUSY_WINDOW = 60.0
"""Seconds over which ``stats()["busy_share"]`` is measured."""
_REASON_LIMIT = 1000  # characters of a Failed reason: it goes into an answer


@dataclass
class Job:
    """One sample to transform: its raw fields (``prepare`` runs) or its packed prepared arrays
    from the cache (``prepare`` is skipped), exactly one of the two."""

    index: int
    sample: dict[str, bytes] | None
    prepared: bytes | None
    seed: int
    epoch: int

    def __post_init__(self) -> None:
        if (self.sample is None) == (self.prepared is None):
            raise ValueError("a Job has exactly one of sample and prepared")


@dataclass
class Done:
    """A job's checked outputs (``pack``ed), its ``prepare`` output when it ran (for the cache), and the
    CPU seconds the pool process spent on it."""

    outputs: bytes
    prepared: bytes | None
    seconds: float


@dataclass
class Failed:
    """Why a job gave no outputs: an exception of the transform, an output unlike its declaration,
    the deadline, or the pool process dying under it twice."""

    reason: str


class _Slot:
    """One pool process, its pipe, whether it has loaded the transforms, and since when it runs a job."""

    def __init__(self) -> None:
        self.process: multiprocessing.process.BaseProcess | None = None
        self.conn: multiprocessing.connection.Connection | None = None
        self.ready = False
        self.busy_since: float | None = None


class _Call:
    """One ``run`` call: its results as its jobs end, and the one future its caller awaits, settled from
    a slot's thread when the last job ends (one wake-up of the loop a call, not one a job)."""

    def __init__(self, name: str, count: int):
        self.name = name
        self.results: list[Done | Failed | None] = [None] * count
        self.left = count
        self.loop = asyncio.get_running_loop()
        self.future = self.loop.create_future()
        self.gone = False  # its caller stopped waiting (cancelled): its jobs not begun are skipped

    def finish(self, error: BaseException | None = None) -> None:
        """From a slot's thread: the future settled with the results, or with ``error``."""
        with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits
            self.loop.call_soon_threadsafe(self._set, error)

    def _set(self, error: BaseException | None) -> None:
        if not self.future.done():
            self.future.set_result(self.results) if error is None else self.future.set_exception(error)


@dataclass
class _Work:
    """A job queued: its call, its place in the call's results and in the queue (kept by a retry), and
    how many processes died running it."""

    call: _Call
    position: int
    job: Job
    order: int
    deaths: int = 0


_STOP = (-1, 0, None)  # what a slot's thread takes from the queue when the pool closes: it sorts before any job


class TransformPool:
    """``processes`` processes running the transforms ``specs`` names (``{name: "package.module:factory"}``),
    each job within ``deadline`` seconds. ``start`` before ``run``; ``close`` kills them all."""

    def __init__(self, specs: dict[str, str], processes: int, deadline: float):
        if processes < 1:
            raise ValueError(f"a transform pool needs at least 1 process, not {processes}")
        if not deadline > 0:
            raise ValueError(f"a transform's deadline is a positive number of seconds, not {deadline}")
        self.specs = dict(specs)
        self.processes = processes
        self.deadline = float(deadline)
        self._slots = [_Slot() for _ in range(processes)]
        self._threads: list[threading.Thread] = []
        self._queue: queue.PriorityQueue = queue.PriorityQueue()
        self._order = itertools.count()
        self._lock = threading.Lock()  # the slots' processes and the counters, between the threads
        self._started = self._closed = False
        self._restarts = self._jobs = self._failed = 0
        self._busy = 0.0  # process-seconds busy in jobs that ended
        self._history: deque[tuple[float, float]] = deque()  # (when, busy then): busy_share's window

    async def start(self) -> None:
        """Every process started and its transforms loaded; ``TransformError`` naming the transform
        that did not load (and nothing left running)."""
        if self._started:
            raise RuntimeError("the transform pool was started already")
        self._started = True
        # The fork server imports this module once; each process forked from it then starts warm.
        _CONTEXT.set_forkserver_preload([__name__])
        loaded = [concurrent.futures.Future() for _ in self._slots]
        for slot, future in zip(self._slots, loaded):
            thread = threading.Thread(target=self._serve, args=(slot, future), daemon=True,
                                      name=f"transform-pool-{len(self._threads)}")
            thread.start()
            self._threads.append(thread)
        try:
            outcomes = await asyncio.gather(*map(asyncio.wrap_future, loaded), return_exceptions=True)
            errors = [outcome for outcome in outcomes if isinstance(outcome, BaseException)]
            if errors:
                raise errors[0]
        except BaseException:  # a transform that did not load, or start cancelled: nothing left running
            await self.close()
            raise
        self._history.append((time.monotonic(), 0.0))

    async def close(self) -> None:
        """Every process killed and reaped, every thread ended; a job still waiting fails its ``run``."""
        with self._lock:
            self._closed = True
            for slot in self._slots:
                if slot.process is not None:
                    slot.process.kill()  # its thread reaps it
        for _ in self._threads:
            self._queue.put(_STOP)
        await asyncio.to_thread(self._reap)
        while not self._queue.empty():
            self._closed_under(self._queue.get_nowait()[2])

    async def run(self, name: str, jobs: list[Job]) -> list[Done | Failed]:
        """The jobs' results, in their order, once all are in. Raises only for the caller's faults
        (a transform not served, a pool not started or closed), never for a sample's."""
        if name not in self.specs:
            raise TransformError(f"no transform {name!r} in the pool (it runs {', '.join(sorted(self.specs))})")
        if self._closed or not self._started:
            raise RuntimeError("the transform pool is closed" if self._closed else "the transform pool is not started")
        if not jobs:
            return []
        call = _Call(name, len(jobs))
        for position, job in enumerate(jobs):
            order = next(self._order)
            self._queue.put((0, order, _Work(call, position, job, order)))
        try:
            return list(await call.future)
        finally:
            call.gone = True

    def stats(self) -> dict:
        """Processes ready, the share of their time spent in jobs over the last ``BUSY_WINDOW`` seconds
        (or since start), processes replaced, jobs ended, jobs failed."""
        now = time.monotonic()
        with self._lock:
            busy = self._busy + sum(now - s.busy_since for s in self._slots if s.busy_since is not None)
            history = self._history  # readings at least a second apart, the oldest the window's start
            if history and now - history[-1][0] >= 1.0:
                history.append((now, busy))
            while len(history) > 1 and history[1][0] <= now - BUSY_WINDOW:
                history.popleft()
            since, busy_then = history[0] if history else (now, busy)
            share = (busy - busy_then) / ((now - since) * self.processes) if now > since else 0.0
            return {"processes": sum(s.ready for s in self._slots), "busy_share": round(min(1.0, share), 4),
                    "restarts": self._restarts, "jobs": self._jobs, "failed": self._failed}

    def _reap(self) -> None:
        """After ``close`` killed them: the threads ended, then the processes no thread reaped."""
        for thread in self._threads:
            thread.join()
        for slot in self._slots:
            if slot.process is not None:
                self._end(slot)

    # The slots' threads.

    def _serve(self, slot: _Slot, loaded: concurrent.futures.Future) -> None:
        """A slot's thread: its process started, then job after job until the pool closes."""
        try:
            self._begin(slot)
        except BaseException as err:
            loaded.set_exception(err)
            return
        loaded.set_result(None)
        while True:
            _, _, work = self._queue.get()
            if work is None:
                return
            if self._closed:
                self._closed_under(work)
                return
            if not work.call.gone:
                self._attempt(slot, work)
            if slot.process is None and not self._restart(slot):
                return

    def _attempt(self, slot: _Slot, work: _Work) -> None:
        """``work`` run on ``slot``'s process; a process that hangs or dies leaves ``slot.process`` None."""
        if multiprocessing.connection.wait([slot.process.sentinel], 0):
            self._end(slot)  # it died idle (killed from outside): the job never reached it, nothing to count
            self._queue.put((0, work.order, work))
            return
        with self._lock:
            slot.busy_since = time.monotonic()
        try:
            slot.conn.send((work.call.name, work.job))
            ready = multiprocessing.connection.wait([slot.conn, slot.process.sentinel], self.deadline)
            if not ready:
                self._end(slot)
                log.warning("transform %r: sample %d ran past %g s; its process was killed and is replaced",
                            work.call.name, work.job.index, self.deadline)
                return self._settle(slot, work, Failed(f"timed out after {self.deadline:g} s"))
            if slot.conn not in ready and not slot.conn.poll():
                raise EOFError
            return self._settle(slot, work, slot.conn.recv())
        except (EOFError, OSError):
            code = self._end(slot)
        self._idle(slot)
        if self._closed:
            return self._closed_under(work)
        log.warning("transform %r: the pool process died (%s) running sample %d; it is replaced",
                    work.call.name, _exit(code), work.job.index)
        work.deaths += 1
        if work.deaths < 2:
            self._queue.put((0, work.order, work))  # its old place: the next process to be free takes it
            return
        self._settle(None, work, Failed(f"the pool process died twice running it ({_exit(code)})"))

    def _idle(self, slot: _Slot) -> None:
        """``slot`` free again: its time in the job counted busy."""
        with self._lock:
            slot.busy_since, self._busy = None, self._busy + time.monotonic() - slot.busy_since

    def _settle(self, slot: _Slot | None, work: _Work, result: Done | Failed) -> None:
        """``work``'s result in (``slot``, when given, free again), its call finished if it was the last."""
        if slot is not None:
            self._idle(slot)
        call = work.call
        with self._lock:
            self._jobs += 1
            self._failed += isinstance(result, Failed)
            call.results[work.position] = result
            call.left -= 1
            last = call.left == 0
        if last:
            call.finish()

    def _closed_under(self, work: _Work | None) -> None:
        """``work``'s ``run`` raises: the pool closed (as ``run`` after ``close`` does)."""
        if work is not None:
            work.call.finish(RuntimeError("the transform pool was closed while the job waited"))

    def _begin(self, slot: _Slot) -> None:
        """A process started on ``slot`` with every transform loaded; ``TransformError`` if one does not load."""
        ours, theirs = _CONTEXT.Pipe()
        process = _CONTEXT.Process(target=_main, args=(theirs, self.specs), daemon=True, name="shardfeed-transform")
        with self._lock:
            if self._closed:
                raise RuntimeError("the transform pool is closed")
            process.start()
            slot.process, slot.conn = process, ours
        theirs.close()  # only the process holds its end: its death reads as the pipe closed
        try:
            if not multiprocessing.connection.wait([ours, process.sentinel], LOAD_TIMEOUT):
                raise TransformError(f"the transform pool's process did not load the transforms in {LOAD_TIMEOUT:g} s")
            answer = ours.recv() if ours.poll() else None
        except (EOFError, OSError):
            answer = None
        if answer is None:
            code = self._end(slot)
            raise TransformError(f"the transform pool's process died loading the transforms ({_exit(code)})")
        if answer != "ready":
            self._end(slot)
            raise TransformError(answer)
        with self._lock:
            slot.ready = True

    def _restart(self, slot: _Slot) -> bool:
        """A fresh process on ``slot`` (whose process hung or died); False once the pool closes. A start
        that fails (a fork refused, the machine out of memory) is tried again a second later."""
        with self._lock:
            self._restarts += 1
        while not self._closed:
            try:
                self._begin(slot)
                return True
            except Exception as err:
                if not self._closed:
                    log.warning("the transform pool could not start a process (%s); trying again", err)
                    time.sleep(1.0)
        return False

    def _end(self, slot: _Slot) -> int | None:
        """``slot``'s process killed (if it lives) and reaped, its pipe closed; its exit code."""
        process, conn = slot.process, slot.conn
        with self._lock:
            slot.process = slot.conn = None
            slot.ready = False
        process.kill()
        process.join()
        conn.close()
        return process.exitcode


def _exit(code: int | None) -> str:
    """How a process ended, in words: ``exit code 3``, ``killed by SIGSEGV``."""
    signals = {-s.value: s.name for s in signal.Signals}
    return f"killed by {signals[code]}" if code in signals else f"exit code {code}"


# The pool's processes.

def _main(conn: multiprocessing.connection.Connection, specs: dict[str, str]) -> None:
    """A pool process: every transform loaded (or why not, answered), then job after job until the
    service closes its end of the pipe."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the service's to handle: it closes the pool
    transforms = {}
    for name, spec in specs.items():
        try:
            transforms[name] = load(spec)
        except Exception as err:
            said = str(err) if isinstance(err, TransformError) else \
                f"transform {spec!r}: the factory raised {type(err).__name__}: {err}"
            conn.send(f"cannot load transform {name!r}: {said}")
            return
    conn.send("ready")
    while True:
        try:
            name, job = conn.recv()
        except EOFError:
            return
        conn.send(_run(transforms[name], job))


def _run(transform: Transform, job: Job) -> Done | Failed:
    """One job in the process: its ``Done``, or a ``Failed`` saying which step raised what."""
    started = time.process_time()
    step = "prepare"
    try:
        if job.sample is not None:
            prepared = transform.prepare(job.sample)
            packed = pack(prepared)
        else:
            packed, prepared = None, unpack(job.prepared)
        step = "augment"
        outputs = pack(apply(transform, prepared, job.seed, job.epoch, job.index))
    except Exception as err:
        if isinstance(err, TransformError) and (_raised_in(err, checked) or _raised_in(err, pack)
                                                 or _raised_in(err, unpack)):
            return Failed(str(err)[:_REASON_LIMIT])  # it names the output or array that is wrong
        return Failed(f"{step} raised {type(err).__name__}: {err}"[:_REASON_LIMIT])
    return Done(outputs=outputs, prepared=packed, seconds=time.process_time() - started)


def _raised_in(err: BaseException, function) -> bool:
    """Whether ``err`` was raised by ``function`` itself (our check, not the transform's code)."""
    frame = err.__traceback__
    while frame.tb_next is not None:
        frame = frame.tb_next
    return frame.tb_frame.f_code is function.__code__
