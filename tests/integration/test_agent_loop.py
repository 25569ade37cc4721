"""The agent loop as services: real NATS, DuckDB, BFCL environment and SmolLM2.

pool-store feeds a rollout job, rollout runs a real group and publishes it; the learner
trains on a group, publishes the new weights through the object store, a rollout engine
loads them and computes identical logits; a restarted learner resumes where it stopped.
"""

from __future__ import annotations

import json

import anyio
import pytest
import torch

from coevolve.services.learner.actor import LearnerActor
from coevolve.services.learner.handler import STEPS_FILE, trained_ids_file
from coevolve.services.pool_store.actor import PoolStoreActor
from coevolve.services.rollout.actor import RolloutActor
from coevolve.shared.config import Settings
from coevolve.shared.envs.bfcl.tasks import seed_tasks
from coevolve.shared.messages import (
    GRPO_STEP_PHASE,
    PolicyVersion,
    RolloutGroup,
    decode,
)
from coevolve.shared.pool_client import PoolClient
from coevolve.shared.runtime.bus import Bus
from coevolve.shared.runtime.subjects import POLICY_UPDATES, ROLLOUT_GROUPS
from tests.support.actors import heartbeats_of, running
from tests.support.rollout import sampled_group

pytestmark = pytest.mark.anyio


async def test_rollout_service_turns_a_job_into_a_group(loop_settings: Settings) -> None:
    actors = [PoolStoreActor(loop_settings), RolloutActor(loop_settings)]
    bus = await Bus.connect(loop_settings.bus, "test")
    await bus.ensure_streams()
    groups = await bus.js.pull_subscribe(ROLLOUT_GROUPS, durable="test-groups")
    async with running(actors):
        with anyio.fail_after(240):
            while True:
                try:
                    msgs = await groups.fetch(1, timeout=5)
                    break
                except Exception:
                    continue
        group = decode(msgs[0].data, RolloutGroup)
        assert len(group.trajectories) == 2
        assert group.policy_version == 0
        for trajectory in group.trajectories:
            n = len(trajectory.token_ids)
            assert n == len(trajectory.logprobs) == len(trajectory.loss_mask) > 0
            assert 0 < sum(trajectory.loss_mask) < n  # generated tokens only
            assert all(
                lp == 0.0
                for lp, m in zip(trajectory.logprobs, trajectory.loss_mask, strict=True)
                if not m
            )
            assert 0.0 <= trajectory.reward <= 1.0
        pool = PoolClient(bus)
        with anyio.fail_after(30):
            while (await pool.stats()).results < 2:
                await anyio.sleep(0.2)
    await bus.close()


async def test_learner_publishes_weights_that_rollout_loads_identically(
    loop_settings: Settings,
) -> None:
    learner_actor = LearnerActor(loop_settings)
    bus = await Bus.connect(loop_settings.bus, "test")
    await bus.ensure_streams()

    from coevolve.shared.policy import SamplingParams
    from coevolve.shared.policy_sync import fetch_policy

    task = seed_tasks()[0]
    # a group with signal; the rollout actor is used for its engine and hot swap, not run
    group, rollout = await sampled_group(loop_settings, bus, task)
    trajectories = group.trajectories
    updates = await bus.nc.subscribe(POLICY_UPDATES)
    beats = await heartbeats_of(bus, "learner")
    async with running([learner_actor]):
        await bus.publish(ROLLOUT_GROUPS, group)
        update = decode((await updates.next_msg(timeout=240)).data, PolicyVersion)
        assert update.version == 0  # announced at start-up (no warm start)
        update = decode((await updates.next_msg(timeout=240)).data, PolicyVersion)
        assert update.version == 1 and update.step == 1
        # the heartbeat says when a step runs (what `bench chaos` waits for to kill it)
        assert GRPO_STEP_PHASE in [beat.phase for beat in beats]
        with anyio.fail_after(30):
            while learner_actor.last_metrics is None:
                await anyio.sleep(0.1)
        assert learner_actor.last_metrics.trained

        rollout.policies.hear("target", update)
        await rollout._use("target")
        assert rollout.engine.policy_version == 1
        saved = loop_settings.run_dir / "policies" / "v1.safetensors"
        assert saved.read_bytes() == await fetch_policy(bus, update)  # for `eval --policy 1`
        # the rollout engine (llama.cpp, an f16 base here) samples what the learner scores
        prompt = trajectories[0].token_ids[:64]
        sampled = rollout.engine.generate(
            [prompt], SamplingParams(max_new_tokens=8, temperature=1.0, seed=0)
        )[0]
        learner_model = learner_actor.learner.policy.model  # type: ignore[union-attr]
        with torch.no_grad():
            ids = torch.tensor([prompt + sampled.completion_ids])
            logits = learner_model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
        chosen = torch.tensor(sampled.completion_ids).unsqueeze(1)
        recomputed = torch.log_softmax(logits, -1).gather(1, chosen).squeeze(1)
        assert float((recomputed - torch.tensor(sampled.logprobs)).abs().mean()) < 0.02
        with anyio.fail_after(30):
            while not trained_ids_file(learner_actor.checkpoint).exists():
                await anyio.sleep(0.1)
        # the step's record: what `coevolve report` counts as trained on
        steps = loop_settings.run_dir / STEPS_FILE
        with anyio.fail_after(30):
            while not steps.exists():
                await anyio.sleep(0.1)
        (record,) = [json.loads(line) for line in steps.read_text().splitlines()]
        assert (record["step"], record["version"], record["published"]) == (1, 1, True)
        assert [(g["group_id"], g["task_id"], g["origin"]) for g in record["groups"]] == [
            (group.id, task.id, "seed")
        ]
        assert record["stale"] == []

    # a new learner (as after SIGKILL) resumes from the checkpoint and remembers the group
    resumed = LearnerActor(loop_settings)
    resumed._bus = bus
    await resumed.setup()
    assert resumed.learner is not None
    assert (resumed.learner.step_count, resumed.learner.version) == (1, 1)
    assert group.id in resumed._trained
    original_state = learner_actor.learner.optimizer.state_dict()["state"]  # type: ignore[union-attr]
    resumed_state = resumed.learner.optimizer.state_dict()["state"]
    assert original_state.keys() == resumed_state.keys()
    for key in original_state:
        assert torch.equal(original_state[key]["exp_avg"], resumed_state[key]["exp_avg"])
    await bus.close()
