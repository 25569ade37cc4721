"""Waiting for a condition in tests: poll it until it holds, with a generous deadline.

A fixed sleep is either too short on a loaded machine or wasted on a fast one; these poll
the condition itself and fail with what was awaited when the deadline passes.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable

import anyio


async def wait_until(
    condition: Callable[[], object], timeout_s: float, what: str, poll_s: float = 0.2
) -> None:
    """Poll ``condition`` (a plain or an async callable) until it is truthy."""
    deadline = time.monotonic() + timeout_s
    while True:
        outcome = condition()
        if inspect.isawaitable(outcome):
            outcome = await outcome
        if outcome:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        await anyio.sleep(poll_s)


def wait_until_sync(
    condition: Callable[[], object], timeout_s: float, what: str, poll_s: float = 0.05
) -> None:
    """Poll ``condition`` from synchronous code (threads, subprocesses) until it is truthy."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(poll_s)
