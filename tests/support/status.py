"""Reading `coevolve status` in tests, as an operator would."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import anyio

from coevolve.cli.status import collect
from coevolve.shared.runtime.bus import Bus

StatusRow = dict[str, Any]


async def status_row(
    bus: Bus,
    service: str,
    want: Callable[[StatusRow], bool],
    timeout_s: float,
    poll_s: float = 0.2,
) -> StatusRow:
    """The `status` row of ``service`` once ``want(row)`` holds."""
    with anyio.fail_after(timeout_s):
        while True:
            report = await collect(bus, stale_after_s=5.0)
            rows = [s for s in report["services"] if s["service"] == service]
            if rows and want(rows[0]):
                return rows[0]
            await anyio.sleep(poll_s)
