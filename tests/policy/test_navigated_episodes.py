"""Navigated episodes (self-navigating) with the real SmolLM2 policy in the real BFCL
environment: the advice shapes the sampling, and the training sample holds none of it."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from coevolve.shared.envs import make_environment
from coevolve.shared.envs.bfcl.tasks import seed_tasks
from coevolve.shared.episodes import Navigation, run_group
from coevolve.shared.experience import with_guidance
from coevolve.shared.messages import Task, Trajectory
from coevolve.shared.policy import (
    LoadedPolicy,
    SamplingParams,
    TransformersEngine,
    encode_text,
    render_text,
)

ADVICE = "Advice from earlier attempts at similar requests:\n- Call get_stock_info before buying."


@pytest.fixture(scope="module")
def task() -> Task:
    return next(t for t in seed_tasks() if t.id == "multi_turn_base_100")


def bfcl() -> Any:
    return make_environment("bfcl")


def first_generated(trajectory: Trajectory) -> int:
    return trajectory.loss_mask.index(1)


def token_logprobs(policy: LoadedPolicy, ids: list[int]) -> torch.Tensor:
    """log π(ids[t] | ids[:t]) for t >= 1, at temperature 1."""
    with torch.no_grad():
        logits = policy.model(torch.tensor([ids])).logits[0, :-1].float()
    return torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]


def test_a_navigated_trajectory_holds_no_advice_and_keeps_the_advised_logprobs(
    policy: LoadedPolicy, engine: TransformersEngine, task: Task
) -> None:
    params = SamplingParams(max_new_tokens=12, temperature=1.0, seed=3)
    navigation = [Navigation(ADVICE, ["exp-1"]), None]
    guided, plain = run_group(
        engine, bfcl, task, group_size=2, params=params, max_steps=2, navigation=navigation
    )
    assert guided.experience_ids == ["exp-1"] and plain.experience_ids == []

    # nothing of the advice is left in what the learner trains on
    text = engine.tokenizer.decode(guided.token_ids)
    assert "get_stock_info before buying" not in text and "Advice from" not in text
    assert not any("Advice from" in message.content for message in guided.messages)
    start = first_generated(guided)
    assert guided.token_ids[:start] == plain.token_ids[: first_generated(plain)]
    assert len(guided.token_ids) == len(guided.logprobs) == len(guided.loss_mask)
    assert guided.messages[0] == plain.messages[0]

    # its behaviour log-probs are the advised prompt's, not the plain one's
    generated = [t for t, m in zip(guided.token_ids, guided.loss_mask, strict=True) if m][:5]
    n = len(generated)
    behaviour = torch.tensor(guided.logprobs[start : start + n])
    plain_prompt = guided.token_ids[:start]
    under_plain = token_logprobs(policy, plain_prompt + generated)[-n:]
    env = bfcl()
    try:
        messages = with_guidance(list(env.reset(task)), ADVICE)
        advised_prompt = encode_text(
            engine.tokenizer, render_text(engine.tokenizer, messages, env.tools())
        )
    finally:
        env.close()
    under_advice = token_logprobs(policy, advised_prompt + generated)[-n:]
    assert torch.allclose(behaviour, under_advice, atol=1e-3)
    assert not torch.allclose(behaviour, under_plain, atol=1e-3)
