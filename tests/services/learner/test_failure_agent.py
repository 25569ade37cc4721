"""The co-evolving failure agent on the real SmolLM2-135M with LoRA: a second adapter
trained by DPO on both agents' failures, the target trained on the expert against them
(its hard negatives), each agent's weights its own, and a checkpoint that keeps both."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch

from coevolve.cli.sections import check_failure_agent
from coevolve.services.learner.config import LearnerConfig, LearnerServiceConfig, PreferenceConfig
from coevolve.services.learner.dpo import dpo_loss
from coevolve.services.learner.preference import pair_logprobs, reference_logprobs, step_pairs
from coevolve.services.learner.preference_pairs import (
    PairSide,
    PreferencePair,
    failure_agent_pairs,
)
from coevolve.services.learner.step_metrics import FAILURE_AGENT_METRICS
from coevolve.services.learner.trainer import GrpoLearner
from coevolve.shared.config import ConfigError, Settings
from coevolve.shared.messages import RolloutGroup
from coevolve.shared.policy import LoadedPolicy

from .conftest import GroupFactory, PolicyFactory

TARGET_REWARDS = [1.0, 0.4, 0.0, 0.2]
FAILURE_REWARDS = [0.6, 0.0, 0.6, 0.2]  # the failure agent's: nearer misses


def config(**preference: Any) -> LearnerConfig:
    return LearnerConfig(
        objective="coevolving_dpo",
        preference=PreferenceConfig(failure_agent=True, **preference),
        micro_batch_size=8,
        min_shared_prompt=1,
        lr=2e-3,
    )


def groups(make_group: GroupFactory) -> tuple[RolloutGroup, RolloutGroup]:
    target = make_group(TARGET_REWARDS)
    rolled = make_group(FAILURE_REWARDS, version=1, offset=4)
    return target, msgspec.structs.replace(rolled, agent="failure")


def weights(learner: GrpoLearner) -> list[torch.Tensor]:
    return [p.detach().clone() for p in learner.trainable]


def mean_dpo_loss(learner: GrpoLearner, pairs: list[PreferencePair]) -> float:
    losses = []
    with torch.no_grad():
        for pair in pairs:
            reference, _ = reference_logprobs(learner, pair)
            logps, _, _ = pair_logprobs(learner, learner.model, pair, 0)
            loss, _ = dpo_loss(logps[:1], logps[1:], reference[:1], reference[1:], beta=0.1)
            losses.append(float(loss))
    return sum(losses) / len(losses)


def test_the_target_pairs_the_expert_with_both_agents_failures_and_no_failure_pairs(
    policy: LoadedPolicy, make_group: GroupFactory, experts: dict[str, PairSide]
) -> None:
    learner = GrpoLearner(policy, config())
    target, rolled = groups(make_group)

    pairs = step_pairs(learner, [target, rolled], experts)

    assert {p.kind for p in pairs} == {"expert"}
    rejected = sorted(p.rejected.reward for p in pairs)
    # the target's 3 failures and the failure agent's 4: the latter are the hard negatives
    assert rejected == sorted([0.4, 0.0, 0.2, *FAILURE_REWARDS])


def test_the_failure_agents_pairs_mix_both_agents_failures_of_a_task_by_partial_credit(
    make_group: GroupFactory,
) -> None:
    target, rolled = groups(make_group)
    pairs = failure_agent_pairs([target, rolled])

    assert all(p.chosen.reward > p.rejected.reward for p in pairs)
    across = [
        p for p in pairs if {p.chosen.source[:6], p.rejected.source[:6]} == {"traj-0", "traj-4"}
    ]
    assert across, "no pair set a failure-agent failure against a target failure"
    # widest gaps first, equal rewards never paired
    gaps = [p.chosen.reward - p.rejected.reward for p in pairs]
    assert gaps == sorted(gaps, reverse=True) and min(gaps) > 0
    assert len(failure_agent_pairs([target, rolled], limit=2)) == 4  # 2 per group of the task


def test_a_step_trains_each_agent_on_its_own_pairs_with_its_own_weights(
    policy: LoadedPolicy, make_group: GroupFactory, experts: dict[str, PairSide]
) -> None:
    learner = GrpoLearner(policy, config())
    agent = learner.failure_agent
    assert agent is not None and agent.version == 1
    target, rolled = groups(make_group)
    agent_pairs = failure_agent_pairs([target, rolled], 4)
    with agent.swapped_in(learner):
        before = mean_dpo_loss(learner, agent_pairs)
    target_before = weights(learner)

    metrics = learner.step([target, rolled], experts)

    assert metrics.trained and metrics.failure_agent
    assert (metrics.version, metrics.failure_agent_version) == (1, 2)
    assert metrics.pairs == 7 and metrics.failure_pairs == 0
    assert metrics.failure_agent_pairs == len(agent_pairs) > 0
    assert metrics.failure_agent_groups == 1
    # the step's groups and reward are the target's alone
    assert metrics.groups == 1 and metrics.reward_mean == pytest.approx(sum(TARGET_REWARDS) / 4)
    assert metrics.hard_negative_reward == pytest.approx(sum(FAILURE_REWARDS) / 4)
    assert metrics.target_failure_reward == pytest.approx(0.6 / 3)
    assert set(FAILURE_AGENT_METRICS) <= set(metrics.scalars())
    target_after = weights(learner)
    assert any(not torch.equal(a, b) for a, b in zip(target_before, target_after, strict=True))
    # the failure agent moved on its own pairs, and its weights are not the target's
    with agent.swapped_in(learner):
        assert mean_dpo_loss(learner, agent_pairs) < before - 1e-3
        inside = weights(learner)
    assert any(not torch.equal(a, b) for a, b in zip(inside, target_after, strict=True))
    # swapping back restores the target exactly
    assert all(torch.equal(a, b) for a, b in zip(weights(learner), target_after, strict=True))
    assert agent.export(learner) != learner.export_weights()


def test_a_checkpoint_keeps_the_failure_agent(
    policy_factory: PolicyFactory,
    make_group: GroupFactory,
    experts: dict[str, PairSide],
    tmp_path: Path,
) -> None:
    original = GrpoLearner(policy_factory(), config())
    original.step(list(groups(make_group)), experts)
    path = tmp_path / "learner.pt"
    original.save_checkpoint(path)
    resumed = GrpoLearner(policy_factory(), config())
    resumed.restore_checkpoint(path)

    assert original.failure_agent is not None and resumed.failure_agent is not None
    assert resumed.failure_agent.version == original.failure_agent.version == 2
    assert resumed.failure_agent.export(resumed) == original.failure_agent.export(original)
    assert resumed.export_weights() == original.export_weights()
    saved, restored = (a.failure_agent.optimizer.state_dict() for a in (original, resumed))
    assert saved["state"].keys() == restored["state"].keys()
    for key, state in saved["state"].items():
        assert torch.equal(state["exp_avg"], restored["state"][key]["exp_avg"])


def test_the_failure_agent_needs_coevolving_dpo_one_learner_and_its_jobs() -> None:
    with pytest.raises(ValueError, match="coevolving_dpo"):
        LearnerConfig(objective="eto", preference=PreferenceConfig(failure_agent=True))

    def settings(share: float, trained: bool, world_size: int = 1) -> Settings:
        grpo = {"objective": "coevolving_dpo", "preference": {"failure_agent": trained}}
        return Settings(
            services={
                "learner": {"grpo": grpo, "world_size": world_size},
                "pool_store": {"failure_agent_share": share},
            }
        )

    check_failure_agent(settings(0.25, True))
    check_failure_agent(settings(0.0, False))
    with pytest.raises(ConfigError, match="failure_agent_share is 0"):
        check_failure_agent(settings(0.0, True))
    with pytest.raises(ConfigError, match="failure_agent is off"):
        check_failure_agent(settings(0.25, False))
    with pytest.raises(ConfigError, match="world_size"):
        settings(0.25, True, world_size=2).section("learner", LearnerServiceConfig)
