"""The one retry helper: exponential backoff with full jitter, for sync and async callers.

Used by the S3 store and by the HTTP client, so it depends on nothing but the standard
library. A caller supplies the operation and a ``retryable`` predicate that looks at each
failure and answers:

- ``False`` / ``None``: not retryable, re-raise it now (e.g. 403, 404, bad request);
- ``True``: retry after the policy's jittered delay;
- a number: retry after that many seconds (a server's ``Retry-After``), capped at ``cap``.

When the attempts run out, the last exception is re-raised unchanged, so the caller
decides how to word the final error.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")

Retryable = Callable[[Exception], "bool | float | None"]
"""Predicate over a failure: falsy = give up, ``True`` = back off, a number = wait that long."""

OnRetry = Callable[[Exception, float], None]
"""Called before each wait with the failure and the delay chosen (for counters and logs)."""


@dataclass(frozen=True)
class Backoff:
    """Retry policy: how many tries, and how long to wait between them.

    The wait before retry ``n`` (0-based) is drawn uniformly from
    ``[0, min(cap, base * 2**n)]`` ("full jitter"): it grows exponentially but spreads
    clients out so that a store recovering from overload is not hit in lockstep.
    """

    attempts: int = 5
    """Total tries including the first; ``1`` means no retry at all."""
    base: float = 0.05
    """Upper bound, in seconds, of the first wait; doubles after every retry."""
    cap: float = 2.0
    """Longest single wait in seconds, also the limit on a server-given delay, so a
    confused or hostile server cannot park the caller."""

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError(f"Backoff.attempts must be at least 1, not {self.attempts}")
        if self.base < 0 or self.cap < 0:
            raise ValueError(f"Backoff.base and Backoff.cap must not be negative ({self.base}, {self.cap})")

    def delay(self, retry: int, hint: float | None = None) -> float:
        """Seconds to wait before retry number ``retry`` (0-based).

        A server ``hint`` (Retry-After) replaces the exponential value; up to half of it is
        added at random so that clients refused together do not come back in lockstep.
        The result is clamped to ``[0, cap]``; a hint of 0 means "now".
        """
        if hint is not None:
            return min(max(float(hint), 0.0) * random.uniform(1.0, 1.5), self.cap)
        return random.uniform(0.0, min(self.cap, self.base * 2.0 ** min(retry, 62)))

    def delays(self) -> Iterator[float]:
        """The ``attempts - 1`` jittered waits of one retry loop, in order."""
        return (self.delay(n) for n in range(self.attempts - 1))


def next_wait(exc: Exception, retry: int, backoff: Backoff, retryable: Retryable) -> float | None:
    """The delay before the next try, or ``None`` to give up and re-raise ``exc`` (also for a
    caller that keeps its own loop, as the client's batch streams do)."""
    if retry + 1 >= backoff.attempts:
        return None
    verdict = retryable(exc)
    if verdict is None or verdict is False:
        return None
    # bool is an int subclass: True means "use the policy", any other number is a hint.
    return backoff.delay(retry, None if verdict is True else float(verdict))


async def retry_async(
    fn: Callable[[], Awaitable[T]],
    *,
    backoff: Backoff,
    retryable: Retryable,
    on_retry: OnRetry | None = None,
) -> T:
    """Await ``fn()`` until it succeeds, retrying failures that ``retryable`` accepts.

    ``fn`` is called afresh for every try (it must build a new request each time).
    Cancellation is never retried: only ``Exception`` subclasses are looked at.
    """
    retry = 0
    while True:
        try:
            return await fn()
        except Exception as exc:
            if (wait := _reported_wait(exc, retry, backoff, retryable, on_retry)) is None:
                raise
        await asyncio.sleep(wait)
        retry += 1


def retry_sync(
    fn: Callable[[], T],
    *,
    backoff: Backoff,
    retryable: Retryable,
    on_retry: OnRetry | None = None,
) -> T:
    """Blocking twin of :func:`retry_async`: call ``fn()`` with the same policy, sleeping between tries."""
    retry = 0
    while True:
        try:
            return fn()
        except Exception as exc:
            if (wait := _reported_wait(exc, retry, backoff, retryable, on_retry)) is None:
                raise
        time.sleep(wait)
        retry += 1


def _reported_wait(exc: Exception, retry: int, backoff: Backoff, retryable: Retryable,
                   on_retry: OnRetry | None) -> float | None:
    """``next_wait``, told to ``on_retry`` when there is one."""
    wait = next_wait(exc, retry, backoff, retryable)
    if wait is not None and on_retry is not None:
        on_retry(exc, wait)
    return wait
