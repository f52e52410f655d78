"""Polling with a deadline, for tests: wait for a condition instead of sleeping a fixed time.

A fixed sleep is either too short on a loaded 2-core machine (flaky) or too long everywhere
(slow); these return as soon as the condition holds and fail with a message when it never does.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import Union

Condition = Callable[[], Union[bool, Awaitable[bool]]]


async def wait_until(cond: Condition, timeout: float = 10.0, interval: float = 0.02,
                     what: str = "condition") -> None:
    """Poll `cond` (sync or async) on the event loop until it is true; AssertionError after
    `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        result = cond()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return
        assert time.monotonic() < deadline, f"{what} not reached within {timeout}s"
        await asyncio.sleep(interval)


def wait_until_sync(cond: Callable[[], bool], timeout: float = 10.0, interval: float = 0.05,
                    what: str = "condition") -> None:
    """The blocking twin of wait_until, for tests that are not async."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"{what} not reached within {timeout}s"
        time.sleep(interval)
