"""A data-parallel learner (world_size 2, gloo): a rank killed mid-step ends the service,
and the restarted learner resumes from its checkpoint without announcing a version twice."""

from __future__ import annotations

import os
import signal

import anyio
import pytest
import torch

from coevolve.services.learner.actor import LearnerActor
from coevolve.shared.config import Settings
from coevolve.shared.messages import ChatMessage, RolloutGroup, Trajectory
from coevolve.shared.policy import SamplingParams, TransformersEngine, load_policy
from coevolve.shared.policy_sync import latest_policy
from coevolve.shared.runtime.actor import Delivery, ServiceFailed
from coevolve.shared.runtime.bus import Bus
from coevolve.shared.runtime.subjects import POLICY_UPDATES, stream_for

pytestmark = pytest.mark.anyio


def sampled_groups(settings: Settings, count: int) -> list[RolloutGroup]:
    """Groups of real samples of the untrained policy, rewarded by position (mixed)."""
    torch.manual_seed(0)
    policy = load_policy(run_dir=settings.run_dir, device="cpu")
    prompt = policy.tokenizer("My favourite colour is", add_special_tokens=False)["input_ids"]
    params = SamplingParams(max_new_tokens=48, temperature=1.0, seed=0)
    generations = TransformersEngine(policy).generate([prompt] * 4 * count, params)
    groups = []
    for g in range(count):
        trajectories = [
            Trajectory(
                id=f"g{g}-t{i}",
                task_id=f"colour-{g}",
                messages=[ChatMessage(role="user", content="Name a colour.")],
                token_ids=prompt + gen.completion_ids,
                logprobs=[0.0] * len(prompt) + gen.logprobs,
                loss_mask=[0] * len(prompt) + [1] * len(gen.completion_ids),
                reward=float(i % 2),
                policy_version=0,
                temperature=gen.temperature,
            )
            for i, gen in enumerate(generations[4 * g : 4 * g + 4])
        ]
        groups.append(
            RolloutGroup(
                task_id=f"colour-{g}", origin="seed", policy_version=0, trajectories=trajectories
            )
        )
    return groups


async def announced_versions(bus: Bus) -> int:
    info = await bus.js.stream_info(stream_for(POLICY_UPDATES).name)
    return int(info.state.messages)


async def started_learner(settings: Settings, bus: Bus) -> LearnerActor:
    learner = LearnerActor(settings)
    learner._bus = bus
    with anyio.fail_after(240):
        await learner.setup()
    return learner


async def test_a_rank_killed_mid_step_ends_the_service_and_the_restart_resumes(
    loop_settings: Settings,
) -> None:
    loop_settings.services["learner"]["world_size"] = 2
    groups = sampled_groups(loop_settings, 3)
    delivery = Delivery(subject="test", headers={}, num_delivered=1, message_id="m")
    bus = await Bus.connect(loop_settings.bus, "test")
    await bus.ensure_streams()

    learner = await started_learner(loop_settings, bus)
    assert learner.ranks is not None and not learner.ranks.dead()
    await learner.on_group(groups[0], delivery)  # step 1 on both ranks: v1
    assert (await latest_policy(bus)).version == 1  # type: ignore[union-attr]

    rank = learner.ranks.processes[0]
    assert rank.pid is not None

    async def kill_when_stepping() -> None:
        while learner._progress is None or learner._progress.phase != "grpo step":
            await anyio.sleep(0.01)
        os.kill(rank.pid, signal.SIGKILL)  # type: ignore[arg-type]

    with anyio.fail_after(120):
        async with anyio.create_task_group() as tg:
            tg.start_soon(kill_when_stepping)
            with pytest.raises(RuntimeError, match="learner step failed"):
                await learner.on_group(groups[1], delivery)
    with anyio.fail_after(10), pytest.raises(ServiceFailed, match="learner rank lost"):
        await learner._watch_ranks()
    await learner.teardown()
    assert (await latest_policy(bus)).version == 1  # type: ignore[union-attr]

    restarted = await started_learner(loop_settings, bus)  # as the supervisor would
    assert restarted.learner is not None and restarted.learner.version == 1
    assert await announced_versions(bus) == 2  # v0 and v1: the checkpoint is not re-announced
    await restarted.on_group(groups[1], delivery)  # the failed step's group comes back
    await restarted.on_group(groups[2], delivery)
    latest = await latest_policy(bus)
    assert latest is not None and latest.version == 3
    assert await announced_versions(bus) == 4  # v0..v3, each once
    await restarted.teardown()
    assert restarted.ranks is not None and not any(p.is_alive() for p in restarted.ranks.processes)
    await bus.close()
