"""The transform pool with real processes and real transforms (``common.sample_transforms``): results in
job order and byte for byte what the transform gives in this process; a raising sample, a hang past the
deadline, a process dying once or twice each settle their own job only; a bad spec fails ``start``;
``close`` leaves no process. One pool serves most tests: starting processes is the cost."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from common.sample_transforms import SPECS, BytesShifted
from common.wait import wait_until
from shardfeed.service.transform.pool import Done, Failed, Job, TransformPool
from shardfeed.transforms import TransformError, apply, pack

DEADLINE = 1.0


@pytest.fixture(scope="module")
def pool():
    pool = TransformPool(SPECS, processes=2, deadline=DEADLINE)
    asyncio.run(pool.start())
    yield pool
    asyncio.run(pool.close())


def pool_pids() -> set[int]:
    """The pool processes alive now: the fork server is this process's child, they are its children."""
    return {pid for server in children(os.getpid()) for pid in children(server) if alive(pid)}


def children(pid: int) -> list[int]:
    """``pid``'s children, whichever of its threads started them."""
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(child) for child in (task / "children").read_text().split()]
        except FileNotFoundError:
            pass  # a thread that ended
    return out


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False


def jobs(*values: bytes, seed: int = 7, epoch: int = 2) -> list[Job]:
    return [Job(index=100 + i, sample={"x": value}, prepared=None, seed=seed, epoch=epoch)
            for i, value in enumerate(values)]


def expected(job: Job) -> bytes:
    """What the transform gives for ``job`` in this process: the pool must give the same bytes."""
    t = BytesShifted()
    return pack(apply(t, t.prepare(job.sample), job.seed, job.epoch, job.index))


def reasons(results: list) -> list[str | None]:
    return [r.reason if isinstance(r, Failed) else None for r in results]


def test_results_come_in_job_order_byte_for_byte_with_prepare_or_from_the_cache(pool):
    given = jobs(*(bytes([i]) * (i * 1000) for i in range(12)))
    done = asyncio.run(pool.run("bytes_shifted", given))
    assert all(isinstance(d, Done) for d in done), reasons(done)
    assert [d.outputs for d in done] == [expected(job) for job in given]
    assert [d.prepared for d in done] == [pack(BytesShifted().prepare(job.sample)) for job in given]
    assert all(d.seconds >= 0 for d in done)
    cached = [Job(job.index, None, d.prepared, job.seed, job.epoch) for job, d in zip(given, done)]
    again = asyncio.run(pool.run("bytes_shifted", cached))
    assert [(d.outputs, d.prepared) for d in again] == [(d.outputs, None) for d in done]


def test_a_sample_that_raises_or_outputs_a_wrong_dtype_fails_alone(pool):
    before = pool.stats()
    raised = asyncio.run(pool.run("raising", jobs(b"ok", b"bad", b"ok", b"worse")))
    assert reasons(raised) == [None, "prepare raised ValueError: this sample is bad", None,
                               "augment raised KeyError: 'worse'"]
    wrong = asyncio.run(pool.run("wrong_dtype", jobs(b"ab")))
    assert reasons(wrong) == ["output 'y' is int32, declared uint8"]
    after = pool.stats()
    assert (after["jobs"] - before["jobs"], after["failed"] - before["failed"]) == (5, 3)
    assert after["restarts"] == before["restarts"]


def test_a_hang_past_the_deadline_fails_its_job_only_and_the_pool_keeps_its_size(pool):
    restarts, pids = pool.stats()["restarts"], pool_pids()
    given = jobs(b"a", b"hang", b"b", b"c")
    results = asyncio.run(pool.run("hanging", given))
    assert reasons(results) == [None, "timed out after 1 s", None, None]
    assert [r.outputs for r in results if isinstance(r, Done)] == [expected(given[i]) for i in (0, 2, 3)]
    wait_until(lambda: pool.stats()["processes"] == 2, 10, "the hung process replaced")
    assert pool.stats()["restarts"] == restarts + 1
    now = pool_pids()
    assert len(now) == 2 and len(now - pids) == 1


def test_a_process_that_dies_once_is_replaced_and_its_job_retried(pool, tmp_path):
    restarts = pool.stats()["restarts"]
    given = jobs(b"a", f"once:{tmp_path / 'first'}".encode(), b"b", f"once:{tmp_path / 'second'}".encode())
    results = asyncio.run(pool.run("dying_once", given))
    assert [r.outputs if isinstance(r, Done) else r.reason for r in results] == [expected(job) for job in given]
    wait_until(lambda: pool.stats()["processes"] == 2, 10, "both dead processes replaced")
    assert pool.stats()["restarts"] == restarts + 2


def test_a_job_that_kills_every_process_fails_after_two(pool):
    given = jobs(b"a", b"exit", b"b")
    results = asyncio.run(pool.run("exiting", given))
    assert reasons(results) == [None, "the pool process died twice running it (exit code 3)", None]
    wait_until(lambda: pool.stats()["processes"] == 2, 10, "the dead processes replaced")


def test_a_process_killed_from_outside_loses_no_job(pool):
    killed = pool_pids()
    for pid in killed:
        os.kill(pid, 9)
    # Dead before the jobs come (a loaded machine may take a while to end them): killed while idle.
    wait_until(lambda: not any(alive(pid) for pid in killed), 30, "the killed processes to end")
    given = jobs(b"a", b"b", b"c")
    assert [r.outputs for r in asyncio.run(pool.run("bytes_shifted", given))] == [expected(job) for job in given]


def test_two_runs_at_once_share_the_processes_and_both_complete(pool):
    first, second = jobs(*[b"first"] * 20, seed=1), jobs(*[b"second"] * 20, seed=2)

    async def both():
        return await asyncio.gather(pool.run("bytes_shifted", first), pool.run("bytes_shifted", second))

    one, two = asyncio.run(both())
    assert [d.outputs for d in one] == [expected(job) for job in first]
    assert [d.outputs for d in two] == [expected(job) for job in second]
    stats = pool.stats()  # a process an earlier test killed may still be on its way back: not counted
    assert 0 < stats["busy_share"] <= 1 and 1 <= stats["processes"] <= 2


def test_an_unknown_name_is_the_callers_error(pool):
    with pytest.raises(TransformError, match="no transform 'nope' in the pool"):
        asyncio.run(pool.run("nope", jobs(b"a")))
    with pytest.raises(ValueError, match="exactly one of sample and prepared"):
        Job(0, None, None, 0, 0)


@pytest.mark.parametrize("spec, message", [
    ("common.sample_transforms:nothing", "cannot load transform 'bad': .*has no 'nothing'"),
    ("common.no_such_module:f", "cannot load transform 'bad': .*cannot import 'common.no_such_module'"),
    ("common.sample_transforms:failing_factory",
     "cannot load transform 'bad': .*the factory raised RuntimeError: no model file here"),
])
def test_a_spec_that_does_not_load_fails_start_and_leaves_no_process(spec, message):
    before = pool_pids()
    pool = TransformPool({"fine": SPECS["bytes_shifted"], "bad": spec}, processes=2, deadline=DEADLINE)
    with pytest.raises(TransformError, match=message):
        asyncio.run(pool.start())
    assert pool_pids() <= before
    with pytest.raises(RuntimeError, match="the transform pool is closed"):
        asyncio.run(pool.run("fine", jobs(b"a")))


def test_close_kills_every_process_and_run_after_it_is_an_error():
    before = pool_pids()
    pool = TransformPool({"fine": SPECS["bytes_shifted"]}, processes=2, deadline=DEADLINE)
    asyncio.run(pool.start())
    ours = pool_pids() - before
    assert len(ours) == 2
    asyncio.run(pool.close())
    assert not any(alive(pid) for pid in ours)
    with pytest.raises(RuntimeError, match="the transform pool is closed"):
        asyncio.run(pool.run("fine", jobs(b"a")))
