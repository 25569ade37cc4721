"""A test actor for the runtime: consumes candidates, records what it handled.

Run in-process (``ProbeActor``) or as a subprocess (``python -m tests.integration.probe``)
so a test can SIGKILL or SIGTERM it. Behaviour comes from environment variables:
PROBE_RECORD (file to append "start <id> <delivery>" / "done <id>" lines), PROBE_SLEEP_S
(seconds each handler takes), PROBE_BLOCKING=worker (the handler blocks a worker thread
for those seconds, as a training step does; =executor: a thread of the event loop's default
executor, which the loop's close waits for), PROBE_FORWARD (subject to republish to, for
trace chains).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal, cast

import anyio

from coevolve.shared.config import load_settings
from coevolve.shared.messages import TaskCandidate
from coevolve.shared.runtime.actor import Actor, Consumer, Delivery, run_actor
from coevolve.shared.runtime.subjects import CANDIDATES, ConsumerSpec

Blocking = Literal["", "worker", "executor"]
PROBE_CONSUMER = ConsumerSpec("COEVOLVE_CANDIDATES", "probe", CANDIDATES, ack_wait_s=2.0)


class ProbeActor(Actor):
    name = "probe"

    def __init__(
        self,
        *args: Any,
        record: Path,
        sleep_s: float = 0.0,
        blocking: Blocking = "",
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.record = record
        self.sleep_s = sleep_s
        self.blocking = blocking
        self.handled: list[str] = []

    def consumers(self) -> Sequence[Consumer[Any]]:
        return (Consumer(PROBE_CONSUMER, TaskCandidate, self.on_candidate, concurrency=2),)

    async def on_candidate(self, candidate: TaskCandidate, delivery: Delivery) -> None:
        self._write(f"start {candidate.id} {delivery.num_delivered}")
        if self.blocking == "worker":
            await anyio.to_thread.run_sync(time.sleep, self.sleep_s, abandon_on_cancel=True)
        elif self.blocking == "executor":
            await asyncio.to_thread(time.sleep, self.sleep_s)
        else:
            await anyio.sleep(self.sleep_s)
        self.handled.append(candidate.id)
        self._write(f"done {candidate.id}")

    def _write(self, line: str) -> None:
        with self.record.open("a") as out:
            out.write(line + "\n")


if __name__ == "__main__":
    run_actor(
        ProbeActor(
            load_settings(),
            record=Path(os.environ["PROBE_RECORD"]),
            sleep_s=float(os.environ.get("PROBE_SLEEP_S", "0")),
            blocking=cast(Blocking, os.environ.get("PROBE_BLOCKING", "")),
        )
    )
