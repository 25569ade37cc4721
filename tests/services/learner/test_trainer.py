"""GrpoLearner on the real SmolLM2-135M with LoRA, fed groups the real engine sampled."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from coevolve.services.learner.config import LearnerConfig
from coevolve.services.learner.memory import saved_for_backward
from coevolve.services.learner.trainer import GrpoLearner, Sample, pad_batch
from coevolve.shared.messages import RolloutGroup
from coevolve.shared.policy import LoadedPolicy, import_weights
from coevolve.shared.policy.logprobs import sequence_logprobs

from .conftest import SAMPLES, TEMPERATURE, GroupFactory, PolicyFactory
from .gradients import accumulated_gradient, assert_same_gradient


def config(**overrides: Any) -> LearnerConfig:
    settings = {"micro_batch_size": 8, "min_shared_prompt": 1}
    return LearnerConfig(**{**settings, **overrides})


def generated_logprob_sums(policy: LoadedPolicy, group: RolloutGroup) -> list[float]:
    """Summed log-prob of each trajectory's generated tokens (one batched forward pass)."""
    ids = torch.tensor([t.token_ids for t in group.trajectories])  # same lengths: no padding
    mask = torch.tensor([t.loss_mask for t in group.trajectories], dtype=torch.bool)
    with torch.no_grad():
        logprobs, _ = sequence_logprobs(
            policy.model, ids, torch.ones_like(ids), TEMPERATURE, positions=mask
        )
    return logprobs.sum(dim=1).tolist()


def test_learner_logprobs_match_the_engines_behaviour_logprobs(
    policy: LoadedPolicy, make_group: GroupFactory
) -> None:
    group = make_group([1.0] * SAMPLES)
    samples = [Sample(t.token_ids, t.logprobs, t.loss_mask, 0.0) for t in group.trajectories]
    ids, attention, mask, behaviour, *_ = pad_batch(samples, pad_id=0, device=torch.device("cpu"))
    with torch.no_grad():
        logprobs, entropies = sequence_logprobs(
            policy.model, ids, attention, TEMPERATURE, positions=mask
        )
    assert torch.allclose(logprobs[mask], behaviour[mask], atol=1e-3)
    assert torch.all(logprobs[~mask] == 0.0)
    assert entropies is not None and torch.all(entropies[mask] > 0)
    # at another temperature the same tokens score differently: the learner must match it
    with torch.no_grad():
        hotter, _ = sequence_logprobs(policy.model, ids, attention, 1.0, positions=mask)
    assert not torch.allclose(hotter[mask], behaviour[mask], atol=1e-3)


def test_step_moves_probability_towards_rewarded_trajectories(
    policy: LoadedPolicy, make_group: GroupFactory, tmp_path: Path
) -> None:
    group = make_group([1.0, 0.0, 1.0, 0.0])
    before = generated_logprob_sums(policy, group)
    learner = GrpoLearner(policy, config(lr=2e-3, kl_beta=0.01), log_dir=tmp_path / "tb")
    metrics = learner.step([group])
    learner.close()

    assert metrics.trained and metrics.step == 1 and metrics.version == 1
    assert learner.version == 1
    assert metrics.reward_mean == pytest.approx(0.5)
    # on-policy data, LoRA starts as the identity: ratio 1, nothing clipped, KL 0
    assert metrics.ratio_mean == pytest.approx(1.0, abs=2e-3)
    assert metrics.clip_fraction == 0.0
    assert metrics.kl == pytest.approx(0.0, abs=1e-4)
    assert metrics.entropy > 0
    assert metrics.trained_tokens == sum(sum(t.loss_mask) for t in group.trajectories)
    # the shared prompt runs once, then each trajectory's continuation
    prompt = len(group.trajectories[0].token_ids) - len(sampled_completion(group, 0))
    assert metrics.tokens == prompt + sum(
        len(sampled_completion(group, i)) for i in range(len(group.trajectories))
    )
    assert metrics.tokens_per_s > 0 and metrics.grad_norm > 0

    after = generated_logprob_sums(policy, group)
    for reward, old, new in zip(group.rewards(), before, after, strict=True):
        if reward > 0.5:
            assert new > old
        else:
            assert new < old

    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    for name in ("reward_mean", "kl", "clip_fraction", "entropy", "staleness_mean", "tokens_per_s"):
        assert f"learner/{name}" in tags
    assert events.Scalars("learner/reward_mean")[0].value == pytest.approx(0.5)
    # the loaded policy alone is hundreds of MB resident
    assert events.Scalars("learner/peak_rss_gb")[0].value > 0.1


def test_reference_is_the_untouched_base_model(
    policy: LoadedPolicy, make_group: GroupFactory
) -> None:
    group = make_group([1.0, 0.0, 0.0, 1.0])
    reference_before = reference_logprob_sums(policy, group)
    learner = GrpoLearner(policy, config(lr=5e-3, kl_beta=0.1))
    first = learner.step([group])
    second = learner.step([make_group([0.0, 1.0, 1.0, 0.0], version=1, offset=4)])
    assert first.kl == pytest.approx(0.0, abs=1e-4)
    assert second.kl > 1e-4  # the policy moved away from the reference
    assert reference_logprob_sums(policy, group) == reference_before
    assert generated_logprob_sums(policy, group) != reference_before


def reference_logprob_sums(policy: LoadedPolicy, group: RolloutGroup) -> list[float]:
    with policy.reference():
        return generated_logprob_sums(policy, group)


def test_stale_uniform_and_malformed_groups_are_counted(
    policy: LoadedPolicy, make_group: GroupFactory, caplog: pytest.LogCaptureFixture
) -> None:
    learner = GrpoLearner(policy, config(max_staleness=1))
    learner.version = 5
    fresh = make_group([1.0, 0.0], version=5)
    one_behind = make_group([0.0, 1.0], version=4, offset=2)
    stale = make_group([1.0, 0.0], version=3, offset=4)
    uniform = make_group([1.0, 1.0], version=5, offset=6)
    broken = make_group([1.0, 0.0], version=5, offset=8)
    broken.trajectories[0].logprobs = broken.trajectories[0].logprobs[:-1]

    metrics = learner.step([fresh, one_behind, stale, uniform, broken])
    assert metrics.dropped_stale == 1
    assert metrics.uniform_groups == 1
    assert metrics.malformed == 1
    assert metrics.groups == 4
    assert metrics.trajectories == 5
    assert metrics.staleness_max == 1
    assert metrics.staleness_mean == pytest.approx(1 / 4)
    assert metrics.version == 6

    caplog.clear()
    with caplog.at_level(logging.INFO, logger="coevolve.services.learner.trainer"):
        nothing = learner.step([stale, uniform])
    assert not nothing.trained
    assert nothing.dropped_stale == 1 and nothing.uniform_groups == 1
    assert learner.version == 6 and learner.step_count == 1
    # its log line says no update was made instead of repeating step 1's number
    assert [r.getMessage() for r in caplog.records] == [
        "no update at v6: 2 groups (1 uniform, 1 stale), 0 malformed, 0 refused"
    ]


def sampled_completion(group: RolloutGroup, index: int) -> list[int]:
    trajectory = group.trajectories[index]
    return [t for t, m in zip(trajectory.token_ids, trajectory.loss_mask, strict=True) if m]


def trained_learner(policy: LoadedPolicy, make_group: GroupFactory) -> GrpoLearner:
    learner = GrpoLearner(policy, config(kl_beta=0.1, lr=1e-3))
    learner.step([make_group([0.0, 1.0, 1.0], offset=6)])  # so LoRA B != 0 and KL > 0
    return learner


def test_shared_prompt_and_micro_batches_give_the_full_batch_gradient(
    policy: LoadedPolicy, make_group: GroupFactory
) -> None:
    groups = [make_group([1.0, 0.0, 0.5]), make_group([0.0, 1.0], offset=3)]
    learner = trained_learner(policy, make_group)

    whole = accumulated_gradient(learner, groups, micro_batch_size=5, share_prompt=False)
    split = accumulated_gradient(learner, groups, micro_batch_size=2, share_prompt=True)
    assert_same_gradient(whole, split)


def test_exported_weights_give_a_rollout_policy_identical_logits(
    policy: LoadedPolicy, policy_factory: PolicyFactory, make_group: GroupFactory
) -> None:
    learner = GrpoLearner(policy, config(lr=1e-2))
    group = make_group([1.0, 0.0])
    learner.step([group])
    rollout_policy = policy_factory()
    ids = torch.tensor([group.trajectories[0].token_ids])
    with torch.no_grad():
        trained = policy.model(input_ids=ids).logits
        assert not torch.equal(rollout_policy.model(input_ids=ids).logits, trained)
        import_weights(rollout_policy.model, learner.export_weights())
        assert torch.equal(rollout_policy.model(input_ids=ids).logits, trained)


def test_an_overflowing_ratio_skips_the_update_instead_of_corrupting_weights(
    policy: LoadedPolicy, make_group: GroupFactory
) -> None:
    learner = GrpoLearner(policy, config(behaviour_weight_cap=None))  # uncapped: it overflows
    group = make_group([1.0, 0.0])
    loser = group.trajectories[1]  # negative advantage: -r*A grows without bound
    loser.logprobs = [-500.0 if m else 0.0 for m in loser.loss_mask]
    before = [p.detach().clone() for p in learner.trainable]

    metrics = learner.step([group])

    assert not metrics.trained and learner.version == 0
    assert all(torch.equal(a, b) for a, b in zip(before, learner.trainable, strict=True))
    assert all(p.grad is None for p in learner.trainable)


def test_groups_over_the_activation_budget_give_the_same_gradient_checkpointed(
    policy: LoadedPolicy, make_group: GroupFactory
) -> None:
    groups = [make_group([1.0, 0.0, 0.5]), make_group([0.0, 1.0], offset=3)]
    learner = trained_learner(policy, make_group)
    base = policy.model.get_base_model()

    with saved_for_backward() as stored_bytes:
        stored = accumulated_gradient(learner, groups, activation_tokens=None)
    # every group is over a 1-token budget
    with saved_for_backward() as checkpointed_bytes:
        checkpointed = accumulated_gradient(learner, groups, activation_tokens=1)
    assert checkpointed_bytes[0] < stored_bytes[0] / 3  # the layers' activations were not kept
    assert not base.is_activation_checkpointing  # switched off again after the group
    assert_same_gradient(stored, checkpointed)


def test_a_group_is_held_as_padded_micro_batches(
    policy: LoadedPolicy, make_group: GroupFactory
) -> None:
    learner = GrpoLearner(policy, config(micro_batch_size=2))
    group = learner.build_samples([make_group([1.0, 0.0, 0.5])]).groups[0]
    group[0].token_ids = group[0].token_ids + [0] * 50  # one continuation much longer
    longest = max(len(s.token_ids) for s in group)

    assert learner.held_tokens(group, 0) == [0, 2 * longest]
    assert learner.held_tokens(group, 10) == [10, 2 * (longest - 10)]


def test_a_group_over_the_budget_in_micro_batches_still_shares_its_prompt(
    policy: LoadedPolicy, make_group: GroupFactory
) -> None:
    group = make_group([1.0, 0.0, 0.5])
    learner = trained_learner(policy, make_group)
    learner.config = msgspec.structs.replace(learner.config, micro_batch_size=2)
    samples = learner.build_samples([group]).groups[0]
    prompt = learner.group_layout(samples).prompt_length
    longest_tail = max(len(s.token_ids) for s in samples) - prompt
    assert prompt > 0 and longest_tail > 0
    # room for the prompt and one continuation, not two
    budget = prompt + longest_tail

    learner.config = msgspec.structs.replace(learner.config, activation_tokens=budget)
    assert learner.group_layout(samples) == (prompt, 1, False, None)
    # less: the prompt's graph is run again in chunks in backward
    learner.config = msgspec.structs.replace(learner.config, activation_tokens=budget - 1)
    layout = learner.group_layout(samples)
    assert (layout.prompt_length, layout.checkpointed, layout.prompt_chunk) == (
        prompt,
        False,
        budget - 1,
    )
    # one continuation alone over the budget: whole sequences, checkpointed
    learner.config = msgspec.structs.replace(learner.config, activation_tokens=longest_tail - 1)
    assert learner.group_layout(samples) == (0, 1, True, None)

    stored = accumulated_gradient(learner, [group], activation_tokens=None)
    one_by_one = accumulated_gradient(learner, [group], activation_tokens=budget)
    assert_same_gradient(stored, one_by_one)


def test_an_origins_advantages_are_scaled_by_its_factor(
    policy: LoadedPolicy, make_group: GroupFactory
) -> None:
    rewards = [1.0, 0.0, 0.5]
    seed = make_group(rewards)
    synthesized = msgspec.structs.replace(make_group(rewards), origin="synthesized")
    unscaled = GrpoLearner(policy, config()).build_samples([seed]).groups[0]
    learner = GrpoLearner(policy, config(origin_advantage_scale={"synthesized": 0.5}))
    [seed_samples, synthesized_samples] = learner.build_samples([seed, synthesized]).groups

    seed_advantages = [s.advantage for s in seed_samples]
    assert seed_advantages == [s.advantage for s in unscaled]  # other origins: unchanged
    assert max(seed_advantages) > 0
    assert [s.advantage for s in synthesized_samples] == pytest.approx(
        [0.5 * a for a in seed_advantages]
    )
