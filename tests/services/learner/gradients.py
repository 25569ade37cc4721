"""The learner's accumulated gradient, flat, for tests that compare two ways to compute it."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
import torch

from coevolve.services.learner.trainer import GrpoLearner
from coevolve.shared.messages import RolloutGroup


def taken_gradient(learner: GrpoLearner) -> torch.Tensor:
    """The trainable parameters' gradient as one flat tensor; cleared afterwards."""
    flat = torch.cat([p.grad.flatten() for p in learner.trainable if p.grad is not None])
    learner.optimizer.zero_grad(set_to_none=True)
    return flat


def accumulated_gradient(
    learner: GrpoLearner, groups: list[RolloutGroup], **overrides: Any
) -> tuple[torch.Tensor, float]:
    """The flat gradient and summed loss of ``groups`` under the learner's config with
    ``overrides``; the gradient is cleared afterwards."""
    learner.config = msgspec.structs.replace(learner.config, **overrides)
    stats, _ = learner.accumulate_gradients(learner.build_samples(groups).groups)
    return taken_gradient(learner), sum(s.loss * s.tokens for s in stats)


def assert_same_gradient(
    expected: tuple[torch.Tensor, float], got: tuple[torch.Tensor, float]
) -> None:
    """``got`` is the nonzero ``expected`` gradient and loss, up to float rounding."""
    gradient, loss = expected
    assert gradient.abs().sum() > 0
    assert got[1] == pytest.approx(loss, rel=1e-4)
    assert float((gradient - got[0]).norm() / gradient.norm()) < 1e-4
