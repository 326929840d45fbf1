import asyncio
from types import SimpleNamespace

import pytest

from shardfeed import retry
from shardfeed.retry import Backoff, retry_async, retry_sync

from common.wait import await_until


class Flaky:
    """Fails with ``errors`` in turn, then returns ``"ok"``; counts the calls."""

    def __init__(self, *errors: Exception):
        self.errors = list(errors)
        self.calls = 0

    def __call__(self) -> str:
        self.calls += 1
        if self.errors:
            raise self.errors.pop(0)
        return "ok"


def test_delays_grow_exponentially_with_full_jitter_up_to_the_cap():
    backoff = Backoff(attempts=8, base=0.1, cap=1.0)
    for _ in range(200):
        delays = list(backoff.delays())
        assert len(delays) == 7
        for n, delay in enumerate(delays):
            assert 0 <= delay <= min(1.0, 0.1 * 2**n)
    late = [backoff.delay(6) for _ in range(500)]
    assert max(late) > 0.8 and min(late) < 0.2  # spread over [0, cap], not fixed steps


def test_a_server_hint_replaces_the_delay_but_never_exceeds_the_cap():
    backoff = Backoff(cap=2.0)
    assert all(1.0 <= backoff.delay(0, hint=1.0) <= 1.5 for _ in range(100))  # jittered upwards
    assert len({backoff.delay(0, hint=1.0) for _ in range(20)}) > 1  # not in lockstep
    assert backoff.delay(0, hint=3600) == 2.0
    assert backoff.delay(0, hint=-1) == 0.0


def test_invalid_policies_are_refused():
    with pytest.raises(ValueError, match="attempts"):
        Backoff(attempts=0)
    with pytest.raises(ValueError, match="negative"):
        Backoff(base=-1)


def test_retryable_failures_are_retried_until_success():
    fn = Flaky(OSError("reset"), OSError("reset"))
    waits = []
    result = retry_sync(fn, backoff=Backoff(attempts=3, base=0.001), retryable=lambda e: True,
                        on_retry=lambda e, d: waits.append(d))
    assert (result, fn.calls, len(waits)) == ("ok", 3, 2)


def test_the_last_failure_is_raised_when_attempts_run_out():
    fn = Flaky(OSError("1"), OSError("2"), OSError("3"))
    with pytest.raises(OSError, match="^3$"):
        retry_sync(fn, backoff=Backoff(attempts=3, base=0.001), retryable=lambda e: True)
    assert fn.calls == 3


def test_a_failure_the_predicate_refuses_is_raised_at_once():
    for verdict in (False, None):
        fn = Flaky(PermissionError("403"), OSError("never reached"))
        with pytest.raises(PermissionError):
            retry_sync(fn, backoff=Backoff(attempts=5), retryable=lambda e: verdict)
        assert fn.calls == 1


def test_a_numeric_verdict_is_used_as_the_delay(monkeypatch):
    fn = Flaky(OSError("429"))
    waits, slept = [], []
    monkeypatch.setattr(retry, "time", SimpleNamespace(sleep=slept.append))  # the loop's sleeps, recorded
    retry_sync(fn, backoff=Backoff(attempts=2, base=10, cap=0.2), retryable=lambda e: 0.15,
               on_retry=lambda e, d: waits.append(d))
    assert len(waits) == 1 and 0.15 <= waits[0] <= 0.2  # the hint, jittered upwards, within the cap
    assert slept == waits  # and slept, not base's 10 s
    fn = Flaky(OSError("retry now"))
    retry_sync(fn, backoff=Backoff(attempts=2, base=10), retryable=lambda e: 0,
               on_retry=lambda e, d: waits.append(d))
    assert waits[-1] == 0.0  # 0 seconds is a hint, not a refusal


def test_the_async_loop_follows_the_same_policy():
    fn = Flaky(TimeoutError(), TimeoutError())

    async def call():
        return fn()

    assert asyncio.run(retry_async(call, backoff=Backoff(attempts=3, base=0.001),
                                   retryable=lambda e: isinstance(e, TimeoutError))) == "ok"
    assert fn.calls == 3
    fn = Flaky(ValueError("bad request"))
    with pytest.raises(ValueError):
        asyncio.run(retry_async(call, backoff=Backoff(attempts=3),
                                retryable=lambda e: isinstance(e, TimeoutError)))
    assert fn.calls == 1


def test_cancellation_is_never_retried():
    calls = 0

    async def slow():
        nonlocal calls
        calls += 1
        await asyncio.sleep(10)

    async def main():
        task = asyncio.create_task(retry_async(slow, backoff=Backoff(attempts=5), retryable=lambda e: True))
        await await_until(lambda: calls == 1, 10, "the first call")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert calls == 1
