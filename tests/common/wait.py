"""Waiting in tests: poll a condition until it holds, within a deadline that only stops a hang
(a test waits for what it needs to see, never a fixed time that a slow machine may outrun)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

POLL = 0.05
"""Seconds between two looks: a look may be a request that the service answers on the same
two cores as the test, so not much more often than that."""


def wait_until(condition: Callable[[], T], timeout: float = 30, what: str = "the condition") -> T:
    """``condition()``'s first truthy value; an AssertionError naming ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        assert time.monotonic() < deadline, f"{what}: not within {timeout} s"
        time.sleep(POLL)
    return value


async def await_until(condition: Callable[[], T], timeout: float = 30, what: str = "the condition") -> T:
    """``wait_until`` inside an event loop, which runs on between two looks."""
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        assert time.monotonic() < deadline, f"{what}: not within {timeout} s"
        await asyncio.sleep(POLL)
    return value
