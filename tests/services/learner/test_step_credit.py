"""Step credit in the learner: labelled steps' advantages joined to the outcome's, token by
token (``grpo.step_advantages``), on the real SmolLM2 policy and its sampled tokens."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import msgspec
import pytest
import torch

from coevolve.services.learner.config import LearnerConfig
from coevolve.services.learner.grpo import (
    group_advantages,
    grpo_loss,
    step_advantages,
    step_token_advantages,
)
from coevolve.services.learner.trainer import GrpoLearner, pad_batch
from coevolve.shared.attribution import step_spans
from coevolve.shared.messages import ChatMessage, RolloutGroup, Trajectory
from coevolve.shared.policy import LoadedPolicy

from .conftest import Sampled
from .gradients import accumulated_gradient

OBSERVATION = [28, 42, 13]  # stand-in token ids of a tool's answer between two steps


def config(**overrides: Any) -> LearnerConfig:
    return LearnerConfig(**{"micro_batch_size": 8, "min_shared_prompt": 1, **overrides})


def two_steps(
    sampled: Sampled, first: int, second: int, reward: float, labels: Sequence[int] = ()
) -> Trajectory:
    """Two sampled answers as two steps of one episode, a tool's answer between them."""
    one, two = sampled.generations[first], sampled.generations[second]
    prompt = sampled.prompt
    return Trajectory(
        id=f"two-{first}-{second}",
        task_id="colour",
        messages=[
            *sampled.messages,
            ChatMessage(role="assistant", content=one.text),
            ChatMessage(role="tool", content="noted"),
            ChatMessage(role="assistant", content=two.text),
        ],
        token_ids=prompt + one.completion_ids + OBSERVATION + two.completion_ids,
        logprobs=[0.0] * len(prompt) + one.logprobs + [0.0] * len(OBSERVATION) + two.logprobs,
        loss_mask=[0] * len(prompt)
        + [1] * len(one.completion_ids)
        + [0] * len(OBSERVATION)
        + [1] * len(two.completion_ids),
        reward=reward,
        policy_version=0,
        temperature=one.temperature,
        step_labels=list(labels),
    )


def group_of(sampled: Sampled, rewards: Sequence[float], *labels: Sequence[int]) -> RolloutGroup:
    """Trajectory i: samples 2i and 2i+1 as its steps, ``labels[i]`` as its labels."""
    trajectories = [
        two_steps(sampled, 2 * i, 2 * i + 1, reward, labels[i] if labels else ())
        for i, reward in enumerate(rewards)
    ]
    return RolloutGroup(
        task_id="colour", origin="seed", policy_version=0, trajectories=trajectories
    )


# --------------------------------------------------------------------------- the maths


def flat(rows: Sequence[Sequence[float]]) -> list[float]:
    return [value for row in rows for value in row]


def test_step_advantages_by_hand() -> None:
    # pooled nonzero labels 1, -1, 1, -1: mean 0, population std 1; the neutral 0 stays 0
    values = step_advantages([[1, -1], [1], [0, -1]], 0.2, eps=0.0)
    assert [len(row) for row in values] == [2, 1, 2]
    assert flat(values) == pytest.approx([0.2, -0.2, 0.2, 0.0, -0.2])
    # 1, 1, -1: mean 1/3, std sqrt(8/9)
    std = math.sqrt(8 / 9)
    values = step_advantages([[1, 1], [-1], []], 1.0, eps=0.0)
    assert [len(row) for row in values] == [2, 1, 0]
    assert flat(values) == pytest.approx([(2 / 3) / std] * 2 + [(-4 / 3) / std])


def test_labels_that_all_agree_or_are_missing_give_no_step_advantage() -> None:
    assert step_advantages([[1, 1], [1]], 0.2) == [[0.0, 0.0], [0.0]]
    assert step_advantages([[-1], [0, -1]], 0.2) == [[0.0], [0.0, 0.0]]
    assert step_advantages([[], [0]], 0.2) == [[], [0.0]]


def test_each_steps_value_lies_on_the_tokens_of_its_run_of_the_mask() -> None:
    mask = [0, 0, 1, 1, 0, 0, 1, 0, 1, 1]
    spans = step_spans(mask)
    assert spans == [(2, 4), (6, 7), (8, 10)]
    assert step_token_advantages(spans, [0.5, -0.5, 0.25], len(mask)) == [
        0.0, 0.0, 0.5, 0.5, 0.0, 0.0, -0.5, 0.0, 0.25, 0.25,
    ]  # fmt: skip
    # cut at 9 tokens (max_tokens): the last step keeps its first token
    assert step_token_advantages(spans, [0.5, -0.5, 0.25], 9)[-1] == 0.25


def test_a_bad_step_is_pushed_down_and_a_good_one_up_in_a_uniform_group() -> None:
    """Equal rewards, so no outcome advantage: the step advantages alone make the
    gradient, which raises the good step's tokens and lowers the bad step's."""
    mask = torch.tensor([[0, 1, 1, 0, 1, 1]])
    logprobs = torch.full((1, 6), -1.0, requires_grad=True)
    spans = step_spans(mask[0].tolist())
    [[good, bad]] = step_advantages([[1, -1]], 0.2)
    tokens = torch.tensor([step_token_advantages(spans, [good, bad], 6)])
    outcome = group_advantages(torch.tensor([0.0]))
    loss, _ = grpo_loss(logprobs, logprobs.detach(), None, outcome[:, None] + tokens, mask)
    loss.backward()
    assert logprobs.grad is not None
    gradient = logprobs.grad[0].tolist()
    assert gradient[1] < 0 and gradient[2] < 0  # lowering the loss raises them
    assert gradient[4] > 0 and gradient[5] > 0
    assert gradient[0] == gradient[3] == 0.0


def test_per_token_advantages_equal_to_the_trajectorys_give_the_same_loss() -> None:
    logprobs = torch.tensor([[-9.0, -1.0, -2.0], [-9.0, -1.5, -0.5]])
    behaviour = torch.tensor([[0.0, -1.2, -1.8], [0.0, -1.4, -0.9]])
    mask = torch.tensor([[0, 1, 1], [0, 1, 0]])
    advantages = torch.tensor([0.7, -0.7])
    per_trajectory, _ = grpo_loss(logprobs, behaviour, None, advantages, mask)
    per_token, _ = grpo_loss(logprobs, behaviour, None, advantages[:, None].expand(2, 3), mask)
    assert torch.equal(per_trajectory, per_token)


# --------------------------------------------------------------------------- the learner


def test_a_bad_step_gets_a_lower_token_advantage_than_a_good_step(
    policy: LoadedPolicy, sampled: Sampled
) -> None:
    group = group_of(sampled, [1.0, 0.0], [1, -1], [-1, -1])
    learner = GrpoLearner(policy, config())
    [samples] = learner.build_samples([group]).groups
    padded = pad_batch(samples, learner.pad_id, torch.device("cpu"))
    assert padded.advantages.shape == padded.ids.shape

    # pooled labels 1, -1, -1, -1: mean -1/2, std sqrt(3)/2; outcome advantages +-1
    std = math.sqrt(3) / 2
    good, bad = 0.2 * 1.5 / std, 0.2 * -0.5 / std
    first, second = step_spans(samples[0].loss_mask)
    row = padded.advantages[0]
    close = {"rel": 1e-5}  # both advantages divide by std + 1e-6
    assert row[first[0] : first[1]].tolist() == pytest.approx(
        [1.0 + good] * (first[1] - first[0]), **close
    )
    assert row[second[0] : second[1]].tolist() == pytest.approx(
        [1.0 + bad] * (second[1] - second[0]), **close
    )
    assert float(row[first[0]]) > float(row[second[0]])
    other = step_spans(samples[1].loss_mask)[1]
    assert float(padded.advantages[1, other[0]]) == pytest.approx(-1.0 + bad, **close)


def test_without_usable_labels_advantages_and_loss_are_exactly_the_outcomes(
    policy: LoadedPolicy, sampled: Sampled
) -> None:
    rewards = [1.0, 0.0, 0.5]
    learner = GrpoLearner(policy, config())
    plain = group_of(sampled, rewards)
    [samples] = learner.build_samples([plain]).groups
    assert all(s.step_advantages is None for s in samples)
    expected = group_advantages(torch.tensor(rewards)).tolist()
    assert [s.advantage for s in samples] == expected
    padded = pad_batch(samples, learner.pad_id, torch.device("cpu"))
    assert padded.advantages.shape == (3,)

    gradient, loss = accumulated_gradient(learner, [plain])
    unusable = {
        "labels that all agree": group_of(sampled, rewards, [1, 1], [1, 1], [1]),
        "labels that do not fit the steps": group_of(sampled, rewards, [1], [-1], [1, -1, 1]),
    }
    for why, group in unusable.items():
        other_gradient, other_loss = accumulated_gradient(learner, [group])
        assert torch.equal(other_gradient, gradient) and other_loss == loss, why
    learner.config = msgspec.structs.replace(learner.config, step_credit_scale=0.0)
    scaled_off = group_of(sampled, rewards, [1, -1], [-1, -1], [1, 1])
    off_gradient, off_loss = accumulated_gradient(learner, [scaled_off])
    assert torch.equal(off_gradient, gradient) and off_loss == loss


def test_a_uniform_group_trains_on_differing_labels_only(
    policy: LoadedPolicy, sampled: Sampled
) -> None:
    learner = GrpoLearner(policy, config())
    differing = group_of(sampled, [0.0, 0.0], [1, -1], [1, 1])
    agreeing = group_of(sampled, [0.0, 0.0], [1, 1], [1, 1])
    unlabelled = group_of(sampled, [0.0, 0.0])

    metrics = learner.step([differing, agreeing, unlabelled])
    assert metrics.trained and metrics.updates == 1
    assert metrics.uniform_groups == 2 and metrics.step_credit_groups == 1
    assert metrics.trajectories == 2

    nothing = learner.step([agreeing, unlabelled])
    assert not nothing.trained and nothing.uniform_groups == 2
