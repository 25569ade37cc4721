"""A per-turn task through the rollout path (``run_group``) with the real SmolLM2 policy."""

from __future__ import annotations

import pytest

from coevolve.shared.envs.bfcl import BfclEnvironment, load_tasks, turn_tasks
from coevolve.shared.episodes import run_group
from coevolve.shared.messages import Task
from coevolve.shared.policy import SamplingParams, TransformersEngine, load_policy
from coevolve.shared.policy.chat import render_prompt_ids
from tests.support.cache import CACHE_DIR

# the model cache the policy and learner tests share (converted once from the GGUF file)


@pytest.fixture(scope="module")
def engine() -> TransformersEngine:
    return TransformersEngine(load_policy(run_dir=CACHE_DIR, device="cpu", finetune="none"))


@pytest.fixture(scope="module")
def task() -> Task:
    # TradingBot only, two turns: the shortest conversation to carry into the second turn
    entry = next(t for t in load_tasks("multi_turn_base") if t.id == "multi_turn_base_100")
    return turn_tasks(entry)[-1]


def test_rollout_plays_a_turn_task_from_its_conversation_so_far(
    engine: TransformersEngine, task: Task
) -> None:
    assert task.env_config["turn"] >= 1
    env = BfclEnvironment()
    start = env.reset(task)
    assert [m.role for m in start][:2] == ["user", "assistant"]
    params = SamplingParams(max_new_tokens=8, temperature=1.0, seed=0)
    [trajectory] = run_group(engine, BfclEnvironment, task, 1, params, max_steps=1)
    assert trajectory.messages[: len(start)] == start
    assert trajectory.tool_rendering == "compact"
    prompt = render_prompt_ids(engine.tokenizer, start, env.tools())
    assert trajectory.token_ids[: len(prompt)] == prompt
    assert set(trajectory.loss_mask[: len(prompt)]) == {0} and sum(trajectory.loss_mask) > 0
    full = render_prompt_ids(engine.tokenizer, start, env.tools(), tool_rendering="full")
    assert len(prompt) < len(full) / 2
