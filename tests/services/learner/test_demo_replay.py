"""Demonstration replay: each GRPO update also lowers the ground truth's cross-entropy."""

from __future__ import annotations

import random

import pytest
import torch

from coevolve.services.learner.config import LearnerConfig
from coevolve.services.learner.trainer import GrpoLearner
from coevolve.shared.demonstrations import IGNORE_INDEX, SftExample
from coevolve.shared.policy import LoadedPolicy
from coevolve.shared.policy.logprobs import sequence_logprobs

from .conftest import GroupFactory, PolicyFactory


def demonstration(policy: LoadedPolicy, prompt: str, target: str, task_id: str) -> SftExample:
    tokenize = policy.tokenizer
    prompt_ids = tokenize(prompt, add_special_tokens=False)["input_ids"]
    target_ids = tokenize(target, add_special_tokens=False)["input_ids"]
    labels = [IGNORE_INDEX] * len(prompt_ids) + target_ids
    return SftExample(task_id, prompt_ids + target_ids, labels)


def target_logprob(policy: LoadedPolicy, example: SftExample) -> float:
    ids = torch.tensor([example.input_ids])
    positions = torch.tensor([[label != IGNORE_INDEX for label in example.labels]])
    with torch.no_grad():
        logprobs, _ = sequence_logprobs(
            policy.model, ids, torch.ones_like(ids), 1.0, positions=positions, with_entropy=False
        )
    return float(logprobs[positions].mean())


def test_replayed_demonstrations_raise_the_ground_truths_likelihood(
    policy_factory: PolicyFactory, make_group: GroupFactory
) -> None:
    group = make_group([1.0, 0.0, 1.0, 0.0])
    settings = {
        "micro_batch_size": 8,
        "min_shared_prompt": 1,
        "lr": 2e-3,
        "demo_examples": 2,
        "groups_per_step": 1,
    }
    gains = {}
    losses = {}
    for coef in (0.0, 1.0):
        policy = policy_factory()
        demos = [
            demonstration(policy, "My favourite colour is", " ultramarine blue", "a"),
            demonstration(policy, "The capital of France is", " Paris, of course", "b"),
        ]
        before = target_logprob(policy, demos[0])
        learner = GrpoLearner(policy, LearnerConfig(demo_coef=coef, **settings))
        learner.set_demonstrations(demos)
        metrics = learner.step([group])
        assert metrics.trained
        gains[coef] = target_logprob(policy, demos[0]) - before
        losses[coef] = metrics.demo_loss
    assert losses[0.0] == 0.0  # replay off: nothing replayed
    assert losses[1.0] > 0.5  # the untrained model does not know these continuations
    assert gains[1.0] > gains[0.0] + 0.05


def test_draws_are_fixed_by_step_and_off_without_demonstrations(policy: LoadedPolicy) -> None:
    learner = GrpoLearner(policy, LearnerConfig(demo_examples=2))
    assert learner.draw_demonstrations() == []
    demos = [demonstration(policy, f"Item {i}:", f" value {i}", str(i)) for i in range(6)]
    learner.set_demonstrations(demos)
    for step in (0, 1, 7):
        learner.step_count = step
        drawn = {e.task_id for e in learner.draw_demonstrations()}
        assert drawn == {e.task_id for e in random.Random(step).sample(demos, 2)}
    learner.config = LearnerConfig(demo_coef=0.0, demo_examples=2)
    assert learner.draw_demonstrations() == []


def test_a_step_with_fewer_groups_replays_its_share(policy: LoadedPolicy) -> None:
    learner = GrpoLearner(policy, LearnerConfig(demo_examples=4, groups_per_step=4))
    learner.set_demonstrations(
        [demonstration(policy, f"Item {i}:", f" value {i}", str(i)) for i in range(6)]
    )
    assert [len(learner.draw_demonstrations(groups)) for groups in (1, 2, 3, 4, 6)] == [
        1,
        2,
        3,
        4,
        4,
    ]
    assert len(learner.draw_demonstrations()) == 4


def test_negative_demo_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="demo_coef"):
        LearnerConfig(demo_coef=-0.1)
