"""A rollout worker on a real NATS server, run until it publishes the group of one job."""

from __future__ import annotations

from typing import Any

import anyio
from nats.errors import TimeoutError as FetchTimeout

from coevolve.services.rollout.actor import RolloutActor
from coevolve.shared.config import Settings
from coevolve.shared.envs import make_environment
from coevolve.shared.episodes import run_group
from coevolve.shared.messages import RolloutGroup, RolloutJob, Task, decode
from coevolve.shared.policy import SamplingParams
from coevolve.shared.runtime.actor import ActorRunner
from coevolve.shared.runtime.bus import Bus
from coevolve.shared.runtime.subjects import ROLLOUT_GROUPS, ROLLOUT_JOBS
from tests.support.cache import CACHE_DIR

MODEL_CACHE = CACHE_DIR / "models"


def rollout_settings(
    settings: Settings, step_credit: dict[str, Any], llm: dict[str, Any] | None = None
) -> Settings:
    """Short episodes of the cached SmolLM2 on CPU, with these ``step_credit`` and
    ``llm`` sections."""
    MODEL_CACHE.mkdir(parents=True, exist_ok=True)
    settings.run_dir.mkdir(parents=True, exist_ok=True)
    (settings.run_dir / "models").symlink_to(MODEL_CACHE, target_is_directory=True)
    rollout = {"max_new_tokens": 24, "max_steps": 2, "device": "cpu", "wait_for_policy": False}
    settings.services = {"rollout": {**rollout, "step_credit": step_credit}}
    if llm is not None:
        settings.services["llm"] = llm
    return settings


async def published_group(
    settings: Settings, actor: RolloutActor, job: RolloutJob, timeout_s: float = 300
) -> RolloutGroup:
    """Run ``actor``, hand it ``job`` and return the group it publishes."""
    bus = await Bus.connect(settings.bus, "test")
    try:
        await bus.ensure_streams()
        # the groups' stream keeps a message only for the consumers it has when published
        groups = await bus.js.pull_subscribe(ROLLOUT_GROUPS, durable="test-groups")
        runner = ActorRunner(actor)
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: runner.run(handle_signals=False))
            await bus.publish(ROLLOUT_JOBS, job)
            with anyio.fail_after(timeout_s):
                while True:
                    try:
                        msgs = await groups.fetch(1, timeout=5)
                        break
                    except FetchTimeout:
                        continue
            runner.request_stop()
        return decode(msgs[0].data, RolloutGroup)
    finally:
        await bus.close()


async def sampled_group(
    settings: Settings, bus: Bus, task: Task, rewards: tuple[float, ...] = (1.0, 0.0)
) -> tuple[RolloutGroup, RolloutActor]:
    """A group of ``len(rewards)`` real trajectories of ``task`` from a rollout actor's
    engine (loaded, not run), their rewards set to ``rewards`` (a gradient by default);
    the actor too, for its engine and hot swap."""
    rollout = RolloutActor(settings)
    rollout._bus = bus
    rollout.engine = await anyio.to_thread.run_sync(rollout._load_engine)
    engine = rollout.engine
    trajectories = await anyio.to_thread.run_sync(
        lambda: run_group(
            engine,
            lambda: make_environment("bfcl"),
            task,
            len(rewards),
            SamplingParams(max_new_tokens=16, seed=0),
            max_steps=1,
        )
    )
    for trajectory, reward in zip(trajectories, rewards, strict=True):
        trajectory.reward = reward
    group = RolloutGroup(
        task_id=task.id, origin="seed", policy_version=0, trajectories=trajectories
    )
    return group, rollout
