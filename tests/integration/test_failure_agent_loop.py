"""The failure agent between the services: real NATS, the real learner and rollout code,
the llama.cpp engine. Its versions go out on their own subject; rollout rolls a failure
job with its weights and a target job with the target's."""

from __future__ import annotations

import anyio
import msgspec
import pytest
import torch

from coevolve.services.learner.actor import LearnerActor
from coevolve.services.rollout.actor import AGENTS, RolloutActor
from coevolve.shared.config import Settings
from coevolve.shared.envs.bfcl.tasks import seed_tasks
from coevolve.shared.messages import RolloutGroup, RolloutJob, decode
from coevolve.shared.policy import export_weights, load_policy
from coevolve.shared.policy_sync import latest_policy, publish_policy
from coevolve.shared.runtime.bus import Bus
from coevolve.shared.runtime.subjects import ROLLOUT_GROUPS, ROLLOUT_RESULTS, stream_for

pytestmark = pytest.mark.anyio


async def stored(bus: Bus, subject: str) -> int:
    return int((await bus.js.stream_info(stream_for(subject).name)).state.messages)


async def test_rollout_rolls_each_agents_jobs_with_that_agents_newest_weights(
    loop_settings: Settings,
) -> None:
    grpo = loop_settings.services["learner"]["grpo"]
    grpo |= {"objective": "coevolving_dpo", "preference": {"failure_agent": True}}
    bus = await Bus.connect(loop_settings.bus, "test")
    await bus.ensure_streams()
    learner = LearnerActor(loop_settings)
    learner._bus = bus
    await learner.setup()
    trainer = learner.learner
    assert trainer is not None and trainer.failure_agent is not None
    first = await latest_policy(bus, "failure")
    target = await latest_policy(bus)
    assert first is not None and first.version == 1
    assert target is not None and target.version == 0  # the target's subject is its own
    # the failure agent trained apart: other weights, announced as its v2
    agent = trainer.failure_agent
    with torch.no_grad():
        for weight in agent.weights:
            weight.add_(0.05)
    agent.version = 2
    await learner._announce_failure_agent()
    assert (await latest_policy(bus, "failure")).version == 2  # type: ignore[union-attr]
    assert (loop_settings.run_dir / "policies" / "failure-v2.safetensors").exists()

    rollout = RolloutActor(loop_settings)
    rollout._bus = bus
    rollout.engine = await anyio.to_thread.run_sync(rollout._load_engine)
    for name in AGENTS:
        update = await latest_policy(bus, name)
        assert update is not None
        rollout.policies.hear(name, update)
    groups = await bus.js.pull_subscribe(ROLLOUT_GROUPS, durable="test-agents")
    task = seed_tasks()[0]

    async def roll(agent: str) -> RolloutGroup:
        job = RolloutJob(task=task, group_size=2, agent=agent)  # type: ignore[arg-type]
        await rollout.on_job(job, None)  # type: ignore[arg-type]
        (msg,) = await groups.fetch(1, timeout=10)
        await msg.ack()
        return decode(msg.data, RolloutGroup)

    failure_group = await roll("failure")
    assert (failure_group.agent, failure_group.policy_version) == ("failure", 2)
    assert rollout.policies.loaded == ("failure", 2)
    assert await stored(bus, ROLLOUT_RESULTS) == 0  # its scores are not the target's
    target_group = await roll("target")
    assert (target_group.agent, target_group.policy_version) == ("target", 0)
    assert rollout.policies.loaded == ("target", 0)
    assert await stored(bus, ROLLOUT_RESULTS) == 1
    # both agents' last weights are kept: switching back loads them without a fetch
    assert set(rollout.policies.kept) == {"target", "failure"}
    again = await roll("failure")
    assert (again.agent, again.policy_version) == ("failure", 2)
    await bus.close()


async def test_a_failure_job_whose_weights_are_refused_is_rolled_and_marked_as_the_target(
    loop_settings: Settings,
) -> None:
    bus = await Bus.connect(loop_settings.bus, "test")
    await bus.ensure_streams()
    blob = export_weights(load_policy(run_dir=loop_settings.run_dir, device="cpu"))
    update = await publish_policy(
        bus, blob, version=3, step=3, base_model="m", kind="lora", agent="failure"
    )
    rollout = RolloutActor(loop_settings)
    rollout._bus = bus
    rollout.engine = await anyio.to_thread.run_sync(rollout._load_engine)
    rollout.policies.hear("failure", msgspec.structs.replace(update, sha256="0" * 64))
    groups = await bus.js.pull_subscribe(ROLLOUT_GROUPS, durable="test-refused")

    job = RolloutJob(task=seed_tasks()[0], group_size=2, agent="failure")
    await rollout.on_job(job, None)  # type: ignore[arg-type]
    (msg,) = await groups.fetch(1, timeout=10)
    group = decode(msg.data, RolloutGroup)

    assert rollout.policies.refused and rollout.policies.loaded is None
    assert (group.agent, group.policy_version) == ("target", 0)
    await bus.close()
