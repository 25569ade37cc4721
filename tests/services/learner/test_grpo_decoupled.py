"""The decoupled (AReaL) objective on tiny tensors: synthetic staleness, hand-worked numbers.

Behaviour log-probs are built from the current ones with known shifts, so the
behaviour-to-proximal weights are known exactly: ``w = exp(-shift)``.
"""

from __future__ import annotations

import math

import pytest
import torch

from coevolve.services.learner.grpo import GrpoStats, grpo_loss
from coevolve.services.learner.trainer import weight_caps

CURRENT = [[-9.0, -1.0, -2.0, -0.7, -3.0], [-9.0, -1.1, -2.5, -0.2, -0.4]]
MASK = [[0, 1, 1, 1, 1], [0, 1, 1, 1, 0]]
ADVANTAGES = [1.0, -1.0]
TOKENS = 7
# behaviour = current + shift. Sequence 1 (A>0): tokens 1 and 3 were less likely under the
# stale policy (ratio e > 1 + eps_high); sequence 2 (A<0): tokens 1 and 3 more likely
# (ratio 1/e < 1 - eps_low). Plain PPO clips all four.
STALE_SHIFT = [[0.0, -1.0, 0.0, -1.0, 0.0], [0.0, 1.0, 0.0, 1.0, 0.0]]
STALE = [(0, 1), (0, 3), (1, 1), (1, 3)]


def current() -> torch.Tensor:
    return torch.tensor(CURRENT, requires_grad=True)


def shifted(logprobs: torch.Tensor, shift: list[list[float]]) -> torch.Tensor:
    return logprobs.detach() + torch.tensor(shift)


def example_loss(
    logprobs: torch.Tensor,
    behaviour: torch.Tensor,
    clip_eps_low: float = 0.2,
    clip_eps_high: float = 0.2,
    *,
    proximal_logprobs: torch.Tensor | None = None,
    behaviour_weight_cap: float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, GrpoStats]:
    """``grpo_loss`` over ``MASK`` and ``ADVANTAGES``, with no reference policy (decoupled
    when given ``proximal_logprobs``)."""
    return grpo_loss(
        logprobs,
        behaviour,
        None,
        torch.tensor(ADVANTAGES),
        torch.tensor(MASK),
        clip_eps_low,
        clip_eps_high,
        proximal_logprobs=proximal_logprobs,
        behaviour_weight_cap=behaviour_weight_cap,
    )


def test_stale_tokens_lose_their_gradient_under_the_behaviour_clip_but_not_decoupled() -> None:
    plain = current()
    behaviour = shifted(plain, STALE_SHIFT)
    loss, stats = example_loss(plain, behaviour, 0.2, 0.28)
    loss.backward()
    assert plain.grad is not None
    assert all(plain.grad[row, col].item() == 0.0 for row, col in STALE)
    assert stats.clip_fraction == pytest.approx(4 / TOKENS)

    decoupled = current()
    loss, stats = example_loss(
        decoupled,
        behaviour,
        0.2,
        0.28,
        proximal_logprobs=decoupled.detach(),
        behaviour_weight_cap=5.0,
    )
    loss.backward()
    assert decoupled.grad is not None
    # one update: r = π_θ/π_prox = 1, so d(-w·r·A)/d logp = -w·A/N with w = exp(-shift)
    for row in range(2):
        for col in range(5):
            weight = math.exp(-STALE_SHIFT[row][col])
            expected = -weight * ADVANTAGES[row] / TOKENS if MASK[row][col] else 0.0
            assert decoupled.grad[row, col].item() == pytest.approx(expected, abs=1e-7)
    assert all(decoupled.grad[row, col].item() != 0.0 for row, col in STALE)

    weights = [math.e, 1.0, math.e, 1.0, 1 / math.e, 1.0, 1 / math.e]
    terms = [-w for w in weights[:4]] + weights[4:]  # -w·A
    assert loss.item() == pytest.approx(sum(terms) / TOKENS, abs=1e-6)
    assert stats.ratio_mean == pytest.approx(1.0)
    assert stats.clip_fraction == 0.0
    assert stats.behaviour_weight_mean == pytest.approx(sum(weights) / TOKENS, abs=1e-6)
    assert stats.behaviour_weight_max == pytest.approx(math.e, rel=1e-6)
    assert stats.behaviour_capped == 0.0


def test_the_capped_weight_bounds_a_wildly_stale_token() -> None:
    shift = [[0.0, 0.0, -50.0, 0.0, 0.0], [0.0, 0.0, -50.0, 0.0, 0.0]]  # w = e^50
    one_sided = [shift[0], [0.0] * 5]  # so the uncapped terms cannot cancel
    cap = 5.0

    logprobs = current()
    behaviour = shifted(logprobs, shift)
    loss, stats = example_loss(
        logprobs, behaviour, proximal_logprobs=logprobs.detach(), behaviour_weight_cap=cap
    )
    loss.backward()
    # seq 1 (A=+1): weights 1, 5, 1, 1; seq 2 (A=-1): 1, 5, 1
    assert loss.item() == pytest.approx((-(1 + 5 + 1 + 1) + (1 + 5 + 1)) / TOKENS, abs=1e-6)
    assert abs(loss.item()) <= cap * max(abs(a) for a in ADVANTAGES)
    assert logprobs.grad is not None and torch.isfinite(logprobs.grad).all()
    assert logprobs.grad.abs().max().item() == pytest.approx(cap / TOKENS, rel=1e-6)
    assert stats.behaviour_capped == pytest.approx(2 / TOKENS)
    assert stats.behaviour_weight_mean == pytest.approx((1 + 5 + 1 + 1 + 1 + 5 + 1) / TOKENS)
    assert stats.behaviour_weight_max == pytest.approx(math.exp(50.0), rel=1e-4)

    uncapped = current()
    loss, _ = example_loss(
        uncapped, shifted(uncapped, one_sided), proximal_logprobs=uncapped.detach()
    )
    assert abs(loss.item()) > 1e15  # what the cap is there for


def test_later_updates_clip_against_the_proximal_policy_by_hand() -> None:
    """A second update: π_θ has moved from π_prox, and π_prox from π_behaviour."""
    logprobs = torch.tensor(
        [[-9.0, -1.0, -2.0, -0.7, -3.0], [-9.0, -1.1, -2.5, -0.2, 40.0]], requires_grad=True
    )
    proximal = torch.tensor([[0.0, -1.2, -1.5, -0.7, -3.0], [0.0, -1.2, -2.0, -0.2, -40.0]])
    # log w = proximal - behaviour on the masked tokens
    log_weights = [[0.0, 0.5, 0.0, -0.3, 2.0], [0.0, 0.0, 0.1, 3.0, 0.0]]
    behaviour = proximal - torch.tensor(log_weights)
    loss, stats = example_loss(
        logprobs, behaviour, proximal_logprobs=proximal, behaviour_weight_cap=5.0
    )
    # -min(r·A, clip(r)·A) with r = π_θ/π_prox (as in test_grpo's hand computation):
    # seq 1: r = e^0.2 (clipped to 1.2), e^-0.5, 1, 1; seq 2: e^0.1, e^-0.5 (clipped: 0.8), 1
    terms = [-1.2, -math.exp(-0.5), -1.0, -1.0, math.exp(0.1), 0.8, 1.0]
    weights = [math.exp(0.5), 1.0, math.exp(-0.3), 5.0, 1.0, math.exp(0.1), 5.0]  # e^2, e^3 capped
    expected = sum(w * t for w, t in zip(weights, terms, strict=True)) / TOKENS
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    assert stats.clip_fraction == pytest.approx(2 / TOKENS)
    ratios = [math.exp(x) for x in (0.2, -0.5, 0.0, 0.0, 0.1, -0.5, 0.0)]
    assert stats.ratio_mean == pytest.approx(sum(ratios) / TOKENS, abs=1e-6)
    assert stats.behaviour_capped == pytest.approx(2 / TOKENS)
    assert stats.behaviour_weight_max == pytest.approx(math.exp(3.0), rel=1e-6)
    loss.backward()
    assert logprobs.grad is not None
    assert logprobs.grad[0, 1].item() == 0.0  # clipped against π_prox
    assert logprobs.grad[0, 2].item() == pytest.approx(-math.exp(-0.5) / TOKENS, abs=1e-7)


def test_a_cap_must_be_positive() -> None:
    logprobs = current()
    with pytest.raises(ValueError):
        example_loss(
            logprobs,
            logprobs.detach(),
            proximal_logprobs=logprobs.detach(),
            behaviour_weight_cap=0.0,
        )


def test_a_navigated_sequence_has_its_weights_capped_at_its_own_cap() -> None:
    """Sequence 0 was navigated (advice in its prompt, trained without): its weights
    π_prox/π_behav are truncated at ``navigated_weight_cap`` (1), sequence 1's at the
    plain cap (5), as grpo.py's header states."""
    navigated = torch.tensor([True, False])
    caps = weight_caps(navigated, cap=5.0, navigated_cap=1.0)
    assert caps.tolist() == [1.0, 5.0]

    logprobs = current()
    behaviour = shifted(logprobs, STALE_SHIFT)
    loss, stats = example_loss(
        logprobs, behaviour, proximal_logprobs=logprobs.detach(), behaviour_weight_cap=caps
    )
    loss.backward()
    assert logprobs.grad is not None
    for row in range(2):
        for col in range(5):
            weight = min(math.exp(-STALE_SHIFT[row][col]), caps[row].item())
            expected = -weight * ADVANTAGES[row] / TOKENS if MASK[row][col] else 0.0
            assert logprobs.grad[row, col].item() == pytest.approx(expected, abs=1e-7)
    # the two tokens the advice made likelier (w = e) count as on-policy ones (w = 1)
    assert stats.behaviour_capped == pytest.approx(2 / TOKENS)
    assert loss.item() == pytest.approx((-4 + 1 / math.e + 1 + 1 / math.e) / TOKENS, abs=1e-6)
