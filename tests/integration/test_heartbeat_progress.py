"""Phase and progress a service reports travel in its heartbeats to `coevolve status`."""

from __future__ import annotations

import threading

import anyio
import msgspec
import pytest

from coevolve.cli.status import service_lines
from coevolve.shared.config import Settings
from coevolve.shared.messages import Heartbeat, decode
from coevolve.shared.runtime.actor import Actor
from coevolve.shared.runtime.bus import Bus
from tests.support.actors import running
from tests.support.status import status_row

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class WarmingUp(Actor):
    """Reports progress from a worker thread during setup, as the learner's SFT does."""

    name = "warming"

    def __init__(self, settings: Settings) -> None:
        super().__init__(settings)
        self.may_finish = threading.Event()

    async def setup(self) -> None:
        def train() -> None:
            for done in range(8):
                self.report_progress("warm start", done, 16, detail="epoch 1")
            self.may_finish.wait(30)

        await anyio.to_thread.run_sync(train, abandon_on_cancel=True)


async def test_reported_progress_reaches_status_and_clears_when_running(
    settings: Settings,
) -> None:
    actor = WarmingUp(settings)
    bus = await Bus.connect(settings.bus, "test")
    try:
        async with running([actor]):
            row = await status_row(bus, "warming", lambda r: r["progress_done"] == 7, 15, 0.1)
            assert (row["phase"], row["progress_total"], row["detail"]) == (
                "warm start",
                16,
                "epoch 1",
            )
            line = service_lines([row])[1]
            assert line.startswith("warming")
            assert line.endswith("  warm start 7/16  epoch 1")

            actor.may_finish.set()
            row = await status_row(bus, "warming", lambda r: r["phase"] == "running", 15, 0.1)
            assert (row["progress_done"], row["progress_total"], row["detail"]) == (None, None, "")
            assert service_lines([row])[1].endswith("  running")
    finally:
        actor.may_finish.set()
        await bus.close()


def test_a_heartbeat_without_the_progress_fields_still_decodes() -> None:
    old = {
        "type": "Heartbeat",
        "service": "rollout",
        "instance": "abc",
        "pid": 1,
        "host": "h",
        "started_at": 1.0,
        "phase": "starting",
    }
    beat = decode(msgspec.msgpack.encode(old), Heartbeat)
    assert beat.phase == "starting"
    assert (beat.progress_done, beat.progress_total, beat.detail) == (None, None, "")
