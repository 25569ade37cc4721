"""The learner's objective by configuration: eto and coevolving_dpo steps on the real
SmolLM2-135M with LoRA, GRPO unchanged by default, and checkpoints that keep the
objective they were trained with."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch

from coevolve.services.learner import trainer as trainer_module
from coevolve.services.learner.config import LearnerConfig, LearnerServiceConfig, PreferenceConfig
from coevolve.services.learner.dpo import dpo_loss
from coevolve.services.learner.grpo import grpo_loss
from coevolve.services.learner.preference import (
    accumulate_pair,
    accumulate_task_pairs,
    expert_tokens,
    pair_logprobs,
    reference_logprobs,
    step_pairs,
    task_batches,
)
from coevolve.services.learner.preference_pairs import PairSide
from coevolve.services.learner.step_metrics import PREFERENCE_METRICS
from coevolve.services.learner.trainer import GrpoLearner, ObjectiveMismatch, pad_batch
from coevolve.shared.config import ConfigError, Settings
from coevolve.shared.messages import RolloutGroup
from coevolve.shared.policy import LoadedPolicy
from coevolve.shared.policy.logprobs import sequence_logprobs

from .conftest import GroupFactory, PolicyFactory

REWARDS = [1.0, 0.4, 0.0, 0.2]  # one solved, three failures with partial credit


def config(objective: str = "eto", **overrides: Any) -> LearnerConfig:
    settings: dict[str, Any] = {"micro_batch_size": 8, "min_shared_prompt": 1, "lr": 2e-3}
    return LearnerConfig(objective=objective, **{**settings, **overrides})  # type: ignore[arg-type]


def pairs_loss(
    learner: GrpoLearner, groups: list[RolloutGroup], experts: dict[str, PairSide]
) -> float:
    """The mean DPO term on the pairs the learner makes of ``groups``, now."""
    losses = []
    with torch.no_grad():
        for pair in step_pairs(learner, groups, experts):
            reference, _ = reference_logprobs(learner, pair)
            logps, _, _ = pair_logprobs(learner, learner.model, pair, 0)
            loss, _ = dpo_loss(
                logps[:1],
                logps[1:],
                reference[:1],
                reference[1:],
                beta=learner.config.preference.beta,
            )
            losses.append(float(loss))
    return sum(losses) / len(losses)


def test_an_eto_step_lowers_the_dpo_loss_on_its_pairs(
    policy: LoadedPolicy, make_group: GroupFactory, experts: dict[str, PairSide]
) -> None:
    group = make_group(REWARDS)
    learner = GrpoLearner(policy, config())
    metrics = learner.step([group], experts)

    assert metrics.trained and metrics.preference and (metrics.step, metrics.version) == (1, 1)
    assert (metrics.pairs, metrics.failure_pairs, metrics.trajectories) == (3, 0, 3)
    # before the update the policy is its reference (a fresh adapter): every margin is 0
    assert metrics.preference_loss == pytest.approx(math.log(2), abs=1e-5)
    assert metrics.sft_loss > 0.5  # the untrained model does not know the answer
    after = pairs_loss(learner, [group], experts)
    assert after < metrics.preference_loss - 1e-3
    scalars = learner.step([group], experts).scalars()
    assert scalars["preference_accuracy"] == 1.0 and scalars["preference_margin"] > 0


def test_coevolving_dpo_adds_failures_ordered_by_partial_credit(
    policy: LoadedPolicy, make_group: GroupFactory, experts: dict[str, PairSide]
) -> None:
    learner = GrpoLearner(policy, config("coevolving_dpo"))
    group = make_group(REWARDS)
    pairs = step_pairs(learner, [group], experts)
    failures = [p for p in pairs if p.kind == "failure"]
    assert [(p.chosen.reward, p.rejected.reward) for p in failures] == [
        (0.4, 0.0),
        (0.4, 0.2),
        (0.2, 0.0),
    ]
    metrics = learner.step([group], experts)
    assert metrics.trained and (metrics.pairs, metrics.failure_pairs) == (6, 3)
    # without a failure there is nothing to prefer: no update, no new version
    solved = make_group([1.0, 1.0])
    assert not learner.step([solved], experts).trained and learner.version == 1


def direct_grpo_gradient_norm(learner: GrpoLearner, group: RolloutGroup) -> float:
    """The norm of the gradient of GRPO's loss on the group's samples, written out with
    ``grpo_loss`` (one batch, no shared prompt; on-policy, so the loss itself is ~0)."""
    [samples] = learner.build_samples([group]).groups
    padded = pad_batch(samples, learner.pad_id, torch.device("cpu"))
    logprobs, _ = sequence_logprobs(
        learner.model, padded.ids, padded.attention, padded.temperatures, positions=padded.loss_mask
    )
    loss, _ = grpo_loss(
        logprobs,
        padded.behaviour,
        None,
        padded.advantages,
        padded.loss_mask,
        learner.config.clip_eps_low,
        learner.config.clip_eps_high,
        proximal_logprobs=logprobs.detach(),
        behaviour_weight_cap=learner.config.behaviour_weight_cap,
    )
    loss.backward()
    norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in learner.trainable]))
    learner.optimizer.zero_grad(set_to_none=True)
    return float(norm)


def test_objective_grpo_is_grpo_as_before(
    policy_factory: PolicyFactory,
    make_group: GroupFactory,
    experts: dict[str, PairSide],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def refused(*_: object) -> None:
        raise AssertionError("a GRPO step built preference pairs")

    monkeypatch.setattr(trainer_module, "preference_step", refused)
    group = make_group(REWARDS)
    assert LearnerConfig().objective == "grpo"
    plain = GrpoLearner(policy_factory(), config("grpo"))
    expected = direct_grpo_gradient_norm(plain, group)
    first = plain.step([group])
    # experts and preference settings are ignored under GRPO
    other = PreferenceConfig(beta=0.5, sft_coef=3.0)
    chosen = GrpoLearner(policy_factory(), config("grpo", preference=other))
    second = chosen.step([group], experts)

    assert first.grad_norm == pytest.approx(expected, rel=1e-3)
    assert (first.loss, first.kl, first.grad_norm) == (second.loss, second.kl, second.grad_norm)
    weights = zip(plain.trainable, chosen.trainable, strict=True)
    assert all(torch.equal(a, b) for a, b in weights)
    assert not first.preference and not set(PREFERENCE_METRICS) & set(first.scalars())


def test_the_objective_is_validated() -> None:
    with pytest.raises(ValueError, match="objective"):
        LearnerConfig(objective="dpo")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="beta"):
        PreferenceConfig(beta=0.0)
    with pytest.raises(ValueError, match="sft_coef"):
        PreferenceConfig(sft_coef=-1.0)
    with pytest.raises(ValueError, match="failure_pairs_per_group"):
        PreferenceConfig(failure_pairs_per_group=-1)

    def section(grpo: dict[str, Any]) -> LearnerServiceConfig:
        settings = Settings(services={"learner": {"grpo": grpo}})
        return settings.section("learner", LearnerServiceConfig)

    chosen = section({"objective": "coevolving_dpo", "preference": {"beta": 0.5}})
    assert (chosen.grpo.objective, chosen.grpo.preference.beta) == ("coevolving_dpo", 0.5)
    assert section({}).grpo.objective == "grpo"
    for wrong in (
        {"objective": "ppo"},
        {"preference": {"rpo_alpha": 1.0}},
        {"preference": {"beta": -1}},
    ):
        with pytest.raises(ConfigError):
            section(wrong)
    assert msgspec.json.decode(msgspec.json.encode(chosen.grpo), type=LearnerConfig) == chosen.grpo


def test_an_eto_learner_resumes_exactly_and_refuses_another_objective(
    policy_factory: PolicyFactory,
    make_group: GroupFactory,
    experts: dict[str, PairSide],
    tmp_path: Path,
) -> None:
    first, second = make_group(REWARDS), make_group([0.0, 0.4, 1.0, 0.2], offset=4)
    original = GrpoLearner(policy_factory(), config())
    original.step([first], experts)
    path = tmp_path / "learner.pt"
    original.save_checkpoint(path)
    saved_optimizer = original.optimizer.state_dict()
    expected = original.step([second], experts)

    restored = GrpoLearner(policy_factory(), config())
    restored.restore_checkpoint(path)
    assert (restored.step_count, restored.version) == (1, 1)
    state = restored.optimizer.state_dict()["state"]
    assert set(state) == set(saved_optimizer["state"]) and state
    actual = restored.step([second], experts)
    assert (actual.loss, actual.step, actual.version) == (expected.loss, 2, 2)
    after = zip(restored.trainable, original.trainable, strict=True)
    assert all(torch.equal(a, b) for a, b in after)

    grpo = GrpoLearner(policy_factory(), config("grpo"))
    before = [p.detach().clone() for p in grpo.trainable]
    with pytest.raises(
        ObjectiveMismatch, match=r"trained with objective 'eto'.*objective is 'grpo'"
    ):
        grpo.restore_checkpoint(path)
    unchanged = zip(grpo.trainable, before, strict=True)
    assert all(torch.equal(a, b) for a, b in unchanged) and grpo.step_count == 0


def test_a_checkpoint_without_an_objective_is_grpos(
    policy_factory: PolicyFactory, make_group: GroupFactory, tmp_path: Path
) -> None:
    learner = GrpoLearner(policy_factory(), config("grpo"))
    learner.step([make_group(REWARDS)])
    path = tmp_path / "learner.pt"
    learner.save_checkpoint(path)
    payload = torch.load(path, weights_only=True)
    assert payload["extra"].pop("objective") == "grpo"
    torch.save(payload, path)  # as written before objectives were recorded

    GrpoLearner(policy_factory(), config("grpo")).restore_checkpoint(path)
    with pytest.raises(ObjectiveMismatch, match="coevolving_dpo"):
        GrpoLearner(policy_factory(), config("coevolving_dpo")).restore_checkpoint(path)


@pytest.mark.parametrize("micro_batch_size", [8, 2])  # all sides at once; in runs of 2
def test_a_tasks_pairs_together_give_the_gradient_of_the_pairs_one_by_one(
    policy: LoadedPolicy,
    make_group: GroupFactory,
    experts: dict[str, PairSide],
    micro_batch_size: int,
) -> None:
    learner = GrpoLearner(policy, config("coevolving_dpo", micro_batch_size=micro_batch_size))
    learner.model.train(False)
    # move off the reference first, so that margins and gradients are not trivial
    learner.step([make_group(REWARDS)], experts)
    pairs = list(
        enumerate(step_pairs(learner, [make_group([0.0, 0.4, 1.0, 0.2], offset=4)], experts))
    )
    assert len(pairs) == 6  # 3 expert pairs sharing one expert side, 3 failure pairs
    count, supervised = float(len(pairs)), float(expert_tokens(pairs))

    def gradient(together: bool) -> list[torch.Tensor]:
        references: dict[int, torch.Tensor] = {}
        if together:
            (batch,) = task_batches(pairs)
            stats, _ = accumulate_task_pairs(learner, batch, references, count, supervised)
            assert stats is not None and stats.pairs == 6
        else:
            for index, pair in pairs:
                references[index], _ = reference_logprobs(learner, pair)
                accumulate_pair(learner, pair, references[index], count, supervised)
        grads = [p.grad.detach().clone() for p in learner.trainable]
        learner.optimizer.zero_grad(set_to_none=True)
        return grads

    one_by_one, together = gradient(False), gradient(True)
    for a, b in zip(one_by_one, together, strict=True):
        assert torch.allclose(a, b, rtol=2e-2, atol=1e-5)
    assert any(a.abs().sum() > 0 for a in together)
