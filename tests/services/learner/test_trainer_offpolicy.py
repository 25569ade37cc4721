"""The decoupled objective in the learner: stale groups train, several updates per batch.

Real SmolLM2-135M with LoRA and real engine samples; staleness is synthetic and known:
the behaviour log-probs are the sampled ones shifted by a fixed amount.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from coevolve.services.learner.config import LearnerConfig
from coevolve.services.learner.trainer import GrpoLearner
from coevolve.shared.messages import RolloutGroup
from coevolve.shared.policy import LoadedPolicy
from coevolve.shared.policy.logprobs import sequence_logprobs

from .conftest import GroupFactory
from .gradients import taken_gradient


def config(**overrides: Any) -> LearnerConfig:
    settings = {"micro_batch_size": 8, "min_shared_prompt": 1, "kl_beta": 0.0}
    return msgspec.convert({**settings, **overrides}, LearnerConfig)


def generated_logprob_sums(policy: LoadedPolicy, group: RolloutGroup) -> list[float]:
    """Summed log-prob of each trajectory's generated tokens at its sampling temperature."""
    ids = torch.tensor([t.token_ids for t in group.trajectories])  # same lengths: no padding
    mask = torch.tensor([t.loss_mask for t in group.trajectories], dtype=torch.bool)
    temperatures = torch.tensor([t.temperature for t in group.trajectories])
    with torch.no_grad():
        logprobs, _ = sequence_logprobs(
            policy.model, ids, torch.ones_like(ids), temperatures, positions=mask
        )
    return logprobs.sum(dim=1).tolist()


def make_stale(group: RolloutGroup, shift: float) -> None:
    """Behaviour log-probs as if an older policy had sampled the group: rewarded
    trajectories were ``shift`` less likely under it per token, the others ``shift`` more.
    Plain PPO would clip every generated token (ratio e^shift with A>0, e^-shift with A<0)."""
    for t in group.trajectories:
        sign = -1.0 if t.reward > 0.5 else 1.0
        t.logprobs = [
            lp + sign * shift if m else lp for lp, m in zip(t.logprobs, t.loss_mask, strict=True)
        ]


def test_a_stale_group_still_carries_gradient(
    policy: LoadedPolicy, make_group: GroupFactory, tmp_path: Path
) -> None:
    group = make_group([1.0, 0.0, 1.0, 0.0])
    before = generated_logprob_sums(policy, group)
    make_stale(group, 1.0)
    learner = GrpoLearner(policy, config(lr=2e-3), log_dir=tmp_path)

    metrics = learner.step([group])
    learner.close()

    assert metrics.trained and metrics.updates == 1 and metrics.grad_norm > 0
    assert metrics.clip_fraction == 0.0  # clipped against the proximal policy: r = 1
    # weights e on the rewarded tokens, 1/e on the others (to the engine's float error)
    winners = sum(sum(t.loss_mask) for t in group.trajectories if t.reward > 0.5)
    expected = (winners * math.e + (metrics.trained_tokens - winners) / math.e) / (
        metrics.trained_tokens
    )
    assert metrics.behaviour_weight_mean == pytest.approx(expected, rel=3e-3)
    assert metrics.behaviour_weight_max == pytest.approx(math.e, rel=5e-3)
    assert metrics.behaviour_capped == 0.0
    after = generated_logprob_sums(policy, group)
    for reward, old, new in zip(group.rewards(), before, after, strict=True):
        assert (new > old) if reward > 0.5 else (new < old)

    events = EventAccumulator(str(tmp_path))
    events.Reload()
    for name in ("behaviour_weight_mean", "behaviour_weight_max", "behaviour_capped"):
        logged = events.Scalars(f"learner/{name}")[0].value
        assert logged == pytest.approx(getattr(metrics, name), rel=1e-5)
    assert "learner/clip_fraction" in events.Tags()["scalars"]


def test_the_cap_bounds_the_loss_of_a_wildly_stale_group(
    policy: LoadedPolicy, make_group: GroupFactory
) -> None:
    group = make_group([1.0, 0.0])
    make_stale(group, 40.0)  # behaviour-to-proximal weights e^40 and e^-40
    learner = GrpoLearner(policy, config(behaviour_weight_cap=3.0))
    advantage = 1.0  # two trajectories, rewards 1 and 0

    metrics = learner.step([group])

    assert metrics.trained and math.isfinite(metrics.grad_norm)
    winners = sum(group.trajectories[0].loss_mask) / metrics.trained_tokens
    assert metrics.behaviour_capped == pytest.approx(winners)
    assert metrics.behaviour_weight_max == pytest.approx(math.exp(40.0), rel=1e-2)
    assert abs(metrics.policy_loss) <= 3.0 * advantage
    assert metrics.policy_loss == pytest.approx(-3.0 * advantage * winners, rel=1e-3)


def snapshot_updates(learner: GrpoLearner) -> list[torch.Tensor]:
    """Record the trainable weights after every optimizer update."""
    snapshots = [torch.cat([p.detach().flatten() for p in learner.trainable])]
    original: Callable[..., Any] = learner.optimizer.step

    def step(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        snapshots.append(torch.cat([p.detach().flatten() for p in learner.trainable]))
        return result

    learner.optimizer.step = step  # type: ignore[method-assign]
    return snapshots


def group_tokens(group: RolloutGroup) -> int:
    """Tokens of one pass over a group: its shared prompt once, then each completion."""
    completions = [sum(t.loss_mask) for t in group.trajectories]
    return len(group.trajectories[0].token_ids) - completions[0] + sum(completions)


def test_several_updates_per_batch_each_change_the_weights(
    policy: LoadedPolicy, make_group: GroupFactory
) -> None:
    groups = [make_group([1.0, 0.0, 1.0]), make_group([0.0, 1.0], offset=3)]
    learner = GrpoLearner(policy, config(lr=2e-3, ppo_epochs=2, mini_batches=2))

    # The no-grad proximal pass reproduces the behaviour log-probs of on-policy data, and
    # the first update's gradient is the one-update path's (proximal = detached current).
    batch = learner.build_samples(groups)
    learner.fill_proximal_logprobs(batch.groups)
    for sample in (s for g in batch.groups for s in g):
        assert sample.proximal_logprobs is not None
        proximal = torch.tensor(sample.proximal_logprobs)
        mask = torch.tensor(sample.loss_mask, dtype=torch.bool)
        assert torch.allclose(
            proximal[mask], torch.tensor(sample.behaviour_logprobs)[mask], atol=1e-3
        )
    learner.accumulate_gradients(batch.groups)
    with_pass = taken_gradient(learner)
    learner.accumulate_gradients(learner.build_samples(groups).groups)
    shortcut = taken_gradient(learner)
    assert shortcut.abs().sum() > 0
    assert float((with_pass - shortcut).norm() / shortcut.norm()) < 1e-5

    snapshots = snapshot_updates(learner)
    metrics = learner.step(groups)

    assert metrics.updates == 4 and len(snapshots) == 5
    assert all(not torch.equal(a, b) for a, b in itertools.pairwise(snapshots))
    assert metrics.version == 1 and metrics.step == 1  # one new policy version per batch
    # the proximal pass, then two epochs of two mini-batches (one group each)
    assert metrics.tokens == 3 * sum(group_tokens(g) for g in groups)
    assert metrics.trained_tokens == sum(sum(t.loss_mask) for g in groups for t in g.trajectories)
    # after the first update π_θ has left π_prox: ratios differ from 1
    assert metrics.ratio_mean != pytest.approx(1.0, abs=1e-6)
    assert metrics.behaviour_weight_mean == pytest.approx(1.0, abs=2e-3)


def test_update_counts_are_validated() -> None:
    for bad in ({"ppo_epochs": 0}, {"mini_batches": 0}, {"behaviour_weight_cap": 0.0}):
        with pytest.raises(msgspec.ValidationError):
            msgspec.convert(bad, LearnerConfig)
