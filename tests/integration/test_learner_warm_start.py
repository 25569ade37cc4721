"""The learner service's warm start: a failed phase while no task is reachable, retried,
progress in `coevolve status`, completion recorded in the checkpoint, and the
demonstrations GRPO replays chosen and kept."""

from __future__ import annotations

import anyio
import msgspec
import pytest
import torch

from coevolve.services.learner.actor import LearnerActor
from coevolve.services.pool_store.actor import PoolStoreActor
from coevolve.shared.config import Settings
from coevolve.shared.messages import Task
from coevolve.shared.policy_sync import latest_policy
from coevolve.shared.runtime.actor import ActorRunner
from coevolve.shared.runtime.bus import Bus
from tests.support.status import status_row

pytestmark = pytest.mark.anyio


async def test_warm_start_waits_for_tasks_reports_progress_and_is_recorded(
    loop_settings: Settings,
) -> None:
    loop_settings.services["learner"]["warm_start"] = {
        "enabled": True,
        "tasks": 2,
        "epochs": 1,
        "min_steps": 0,
        "batch_size": 1,
        "max_len": 136,
    }
    loop_settings.services["learner"]["demo_tasks"] = 3
    learner = LearnerActor(loop_settings)
    bus = await Bus.connect(loop_settings.bus, "test")
    await bus.ensure_streams()
    async with anyio.create_task_group() as tg:
        tg.start_soon(lambda: ActorRunner(learner).run(handle_signals=False))
        failed = await status_row(bus, "learner", lambda r: r["phase"] == "warm start failed", 60)
        assert "retrying" in failed["detail"]

        pool = ActorRunner(PoolStoreActor(loop_settings))  # the tasks become reachable
        tg.start_soon(lambda: pool.run(handle_signals=False))
        progress = await status_row(bus, "learner", lambda r: r["phase"] == "warm start", 90)
        assert progress["progress_total"] in (None, 2)
        await status_row(bus, "learner", lambda r: r["phase"] == "running", 240)

        announced = await latest_policy(bus)
        assert announced is not None and announced.version == 1
        payload = torch.load(learner.checkpoint, weights_only=True)
        assert payload["extra"]["warm_started"] is True
        assert payload["reference"]  # the warm-started adapter, frozen as the KL reference
        assert not loop_settings.path("checkpoints", "warm_start.pt").exists()
        # then seed tasks are chosen (and kept) for GRPO's demonstration replay; cut at
        # max_len like the warm start's, these short examples hold no target token
        kept = loop_settings.path("checkpoints", "demonstrations.tasks.json").read_bytes()
        chosen = msgspec.json.decode(kept, type=list[Task])
        assert len(chosen) == 3 and all(any(t.ground_truth) for t in chosen)
        assert learner.learner is not None and learner.learner.demonstrations == []
        pool.request_stop()
        tg.cancel_scope.cancel()
    await bus.close()
