"""GRPO maths on tiny tensors, checked against numbers worked out by hand."""

from __future__ import annotations

import math

import pytest
import torch

from coevolve.services.learner.grpo import (
    filter_stale,
    group_advantages,
    grpo_loss,
    k3_kl,
)
from coevolve.shared.messages import RolloutGroup, Trajectory

# Two sequences of 5 tokens; token 0 (the prompt) and the last token of sequence 2
# (an observation) are masked out and given absurd values that must not matter.
LOGPROBS = [[-9.0, -1.0, -2.0, -0.7, -3.0], [-9.0, -1.1, -2.5, -0.2, 40.0]]
BEHAVIOUR = [[0.0, -1.2, -1.5, -0.7, -3.0], [0.0, -1.2, -2.0, -0.2, -40.0]]
REFERENCE = [[0.0, -1.0, -1.5, -1.2, -2.0], [0.0, -1.1, -2.5, -0.2, 9.0]]
MASK = [[0, 1, 1, 1, 1], [0, 1, 1, 1, 0]]
ADVANTAGES = [1.0, -1.0]


def hand_computed_loss(eps: float, beta: float) -> tuple[float, float, float]:
    """(loss, kl, clip fraction), token by token.

    seq 1, A=+1:  log-ratios 0.2, -0.5, 0, 0
        r = 1.2214 -> clipped to 1.2 (counts as clipped)  -> -min = -1.2
        r = 0.6065 -> min(0.6065, 0.8) = 0.6065             -> -0.6065
        r = 1, 1                                            -> -1, -1
    seq 2, A=-1:  log-ratios 0.1, -0.5, 0
        r = 1.1052 -> inside [0.8, 1.2]                     -> +1.1052
        r = 0.6065 -> min(-0.6065, -0.8) = -0.8 (clipped)   -> +0.8
        r = 1                                               -> +1
    7 masked tokens; 2 of them clipped.
    k3 with d = ref - logp: seq 1: 0, 0.5, -0.5, 1.0; seq 2: 0, 0, 0.
    """
    policy_terms = [
        -1.2,
        -math.exp(-0.5),
        -1.0,
        -1.0,
        math.exp(0.1),
        0.8,
        1.0,
    ]
    kl_terms = [math.exp(d) - d - 1 for d in (0.0, 0.5, -0.5, 1.0, 0.0, 0.0, 0.0)]
    assert eps == 0.2
    n = 7
    policy = sum(policy_terms) / n
    kl = sum(kl_terms) / n
    return policy + beta * kl, kl, 2 / n


def tensors() -> tuple[torch.Tensor, ...]:
    return (
        torch.tensor(LOGPROBS, requires_grad=True),
        torch.tensor(BEHAVIOUR),
        torch.tensor(REFERENCE),
        torch.tensor(ADVANTAGES),
        torch.tensor(MASK),
    )


def test_loss_matches_hand_computation() -> None:
    logprobs, behaviour, reference, advantages, mask = tensors()
    loss, stats = grpo_loss(logprobs, behaviour, reference, advantages, mask, 0.2, 0.2, 0.1)
    expected_loss, expected_kl, expected_clip = hand_computed_loss(0.2, 0.1)
    # written out: policy (-1.2 - .60653 - 1 - 1 + 1.10517 + .8 + 1)/7 = -.128766,
    # kl (0 + .148721 + .106531 + .718282)/7 = .139076; loss = -.128766 + 0.1 * .139076
    assert expected_loss == pytest.approx(-0.114858, abs=1e-5)
    assert loss.item() == pytest.approx(expected_loss, abs=1e-6)
    assert stats.kl == pytest.approx(expected_kl, abs=1e-6)
    assert stats.clip_fraction == pytest.approx(expected_clip)
    assert stats.tokens == 7
    ratios = [math.exp(x) for x in (0.2, -0.5, 0.0, 0.0, 0.1, -0.5, 0.0)]
    assert stats.ratio_mean == pytest.approx(sum(ratios) / 7, abs=1e-6)


def test_gradient_matches_hand_computation() -> None:
    logprobs, behaviour, _, advantages, mask = tensors()
    loss, _ = grpo_loss(logprobs, behaviour, None, advantages, mask, 0.2, 0.2, 0.0)
    loss.backward()
    assert logprobs.grad is not None
    grad = logprobs.grad
    # d(-r*A)/d logp = -r*A/N where unclipped; 0 where the clip is active
    assert grad[0, 1].item() == 0.0  # clipped above with A>0
    assert grad[0, 2].item() == pytest.approx(-math.exp(-0.5) / 7, abs=1e-7)
    assert grad[1, 1].item() == pytest.approx(math.exp(0.1) / 7, abs=1e-7)
    assert grad[1, 2].item() == 0.0  # clipped below with A<0


def test_asymmetric_clip_uses_the_high_bound() -> None:
    logprobs, behaviour, _, advantages, mask = tensors()
    # with eps_high = 0.28 the first token's ratio 1.2214 is no longer clipped
    loss, stats = grpo_loss(logprobs, behaviour, None, advantages, mask, 0.2, 0.28, 0.0)
    policy_terms = [-math.exp(0.2), -math.exp(-0.5), -1.0, -1.0, math.exp(0.1), 0.8, 1.0]
    assert loss.item() == pytest.approx(sum(policy_terms) / 7, abs=1e-6)
    assert stats.clip_fraction == pytest.approx(1 / 7)


def test_observation_tokens_get_no_gradient() -> None:
    logprobs, behaviour, reference, advantages, mask = tensors()
    loss, _ = grpo_loss(logprobs, behaviour, reference, advantages, mask, 0.2, 0.2, 0.5)
    loss.backward()
    assert logprobs.grad is not None
    masked_out = mask == 0
    assert torch.all(logprobs.grad[masked_out] == 0.0)
    assert torch.isfinite(logprobs.grad).all()
    assert logprobs.grad[0, 2].item() != 0.0  # a generated token does get one


def test_token_normalizer_splits_a_batch_into_micro_batches() -> None:
    logprobs, behaviour, reference, advantages, mask = tensors()
    whole, _ = grpo_loss(logprobs, behaviour, reference, advantages, mask, 0.2, 0.2, 0.1)
    parts = [
        grpo_loss(
            logprobs[i : i + 1],
            behaviour[i : i + 1],
            reference[i : i + 1],
            advantages[i : i + 1],
            mask[i : i + 1],
            0.2,
            0.2,
            0.1,
            token_normalizer=7,
        )[0]
        for i in range(2)
    ]
    assert (parts[0] + parts[1]).item() == pytest.approx(whole.item(), abs=1e-6)


def test_group_advantages_by_hand() -> None:
    advantages = group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), eps=0.0)
    # mean 0.5, population std 0.5
    assert advantages.tolist() == [1.0, -1.0, -1.0, 1.0]
    rows = group_advantages(torch.tensor([[0.0, 0.0, 3.0], [2.0, 2.0, 2.0]]), eps=1e-6)
    std = math.sqrt(((1) ** 2 + 1 + 2**2) / 3)
    assert rows[0].tolist() == pytest.approx([-1 / std, -1 / std, 2 / std], abs=1e-5)
    assert rows[1].tolist() == [0.0, 0.0, 0.0]


def test_equal_rewards_give_zero_advantage_and_zero_policy_gradient() -> None:
    for value in (0.0, 0.3, 1.0):
        advantages = group_advantages(torch.full((8,), value), eps=1e-6)
        assert torch.equal(advantages, torch.zeros(8))
    logprobs = torch.tensor([[-1.0, -0.3, -2.0]] * 8, requires_grad=True)
    behaviour = torch.tensor([[-1.0, -0.9, -0.1]] * 8)
    mask = torch.ones(8, 3)
    loss, _ = grpo_loss(logprobs, behaviour, None, advantages, mask, 0.2, 0.2, 0.0)
    loss.backward()
    assert loss.item() == 0.0
    assert logprobs.grad is not None
    assert torch.equal(logprobs.grad, torch.zeros_like(logprobs))


def test_k3_is_zero_at_equality_and_positive_elsewhere() -> None:
    logprobs = torch.tensor([-1.0, -1.0, -1.0])
    reference = torch.tensor([-1.0, -0.5, -3.0])
    kl = k3_kl(logprobs, reference)
    assert kl[0].item() == 0.0
    assert kl[1].item() == pytest.approx(math.exp(0.5) - 0.5 - 1)
    assert kl[2].item() == pytest.approx(math.exp(-2.0) + 2.0 - 1)


def test_kl_needs_reference() -> None:
    logprobs, behaviour, _, advantages, mask = tensors()
    with pytest.raises(ValueError):
        grpo_loss(logprobs, behaviour, None, advantages, mask, 0.2, 0.2, 0.1)


def make_group(version: int, trajectory_versions: list[int]) -> RolloutGroup:
    trajectories = [
        Trajectory(
            id=f"t{i}",
            task_id="task",
            messages=[],
            token_ids=[1, 2],
            logprobs=[0.0, -1.0],
            loss_mask=[0, 1],
            reward=float(i % 2),
            policy_version=v,
        )
        for i, v in enumerate(trajectory_versions)
    ]
    return RolloutGroup(
        task_id="task", origin="seed", policy_version=version, trajectories=trajectories
    )


def test_stale_groups_are_dropped_and_counted() -> None:
    groups = [
        make_group(10, [10, 10]),  # fresh
        make_group(8, [8, 8]),  # 2 behind: kept at bound 2
        make_group(7, [7, 7]),  # 3 behind: dropped
        make_group(10, [10, 6]),  # one trajectory from an old policy: dropped
        make_group(0, [0]),  # very old: dropped
    ]
    kept, dropped = filter_stale(groups, current_version=10, max_staleness=2)
    assert [g.id for g in kept] == [groups[0].id, groups[1].id]
    assert dropped == 3
    kept, dropped = filter_stale(groups, current_version=10, max_staleness=0)
    assert [g.id for g in kept] == [groups[0].id] and dropped == 4
