"""The learner scores each trajectory under the distribution it was sampled from.

Real SmolLM2-135M, real engine samples: at the trajectory's own temperature (mixed in one
group), and truncated distributions (top_p, top_k, greedy) refused and counted.
"""

from __future__ import annotations

import logging

import msgspec
import pytest
import torch

from coevolve.services.learner.config import LearnerConfig
from coevolve.services.learner.grpo import SharedPrefix
from coevolve.services.learner.trainer import GrpoLearner, pad_batch
from coevolve.shared.envs import make_environment
from coevolve.shared.envs.bfcl.tasks import seed_tasks
from coevolve.shared.episodes import run_group
from coevolve.shared.messages import RolloutGroup, Trajectory
from coevolve.shared.policy import LoadedPolicy, SamplingParams, TransformersEngine
from coevolve.shared.policy.logprobs import sequence_logprobs

from .conftest import TEMPERATURE, GroupFactory, Sampled

OTHER_TEMPERATURE = 0.7


def config(**overrides: object) -> LearnerConfig:
    return msgspec.convert(
        {"micro_batch_size": 8, "min_shared_prompt": 1, **overrides}, LearnerConfig
    )


def test_the_learner_has_no_temperature_of_its_own() -> None:
    with pytest.raises(msgspec.ValidationError, match="temperature"):
        msgspec.convert({"temperature": TEMPERATURE}, LearnerConfig)


def test_each_trajectory_is_scored_at_the_temperature_it_was_sampled_at(
    policy: LoadedPolicy, make_group: GroupFactory, sampled: Sampled
) -> None:
    params = SamplingParams(max_new_tokens=5, temperature=OTHER_TEMPERATURE, seed=1)
    cooler = TransformersEngine(policy).generate([sampled.prompt] * 2, params)
    group = make_group([1.0, 0.0])  # sampled at TEMPERATURE
    group.trajectories += [
        sampled.trajectory(cooler[0], 0.0, "cool-0"),
        sampled.trajectory(cooler[1], 1.0, "cool-1"),
    ]
    assert [t.temperature for t in group.trajectories] == [TEMPERATURE] * 2 + [0.7] * 2
    learner = GrpoLearner(policy, config())  # no temperature anywhere in the learner's config

    batch = learner.build_samples([group])
    assert batch.malformed == 0 and batch.truncated == 0
    samples = batch.groups[0]
    assert [s.temperature for s in samples] == [TEMPERATURE] * 2 + [0.7] * 2
    # scored together (one micro-batch, one shared prompt), each row at its temperature
    prompt_length = learner.group_layout(samples).prompt_length
    assert prompt_length == len(sampled.prompt)
    prompt = torch.tensor(sampled.prompt)
    with torch.no_grad():
        prefix = SharedPrefix(policy.model, prompt, 1.0, requires_grad=False)
        padded = pad_batch([s.after(prompt_length) for s in samples], 0, torch.device("cpu"))
        together, _ = learner.policy_logprobs(padded, prefix)
        for row, t in enumerate(group.trajectories):
            ids = torch.tensor([t.token_ids])
            mask = torch.tensor([t.loss_mask], dtype=torch.bool)
            direct, _ = sequence_logprobs(
                policy.model, ids, torch.ones_like(ids), t.temperature, positions=mask
            )
            generated = direct[0][mask[0]]
            assert torch.allclose(together[row, : int(mask.sum())], generated, atol=1e-4)
            assert torch.allclose(generated, torch.tensor(t.logprobs)[mask[0]], atol=1e-3)
            at_one, _ = sequence_logprobs(policy.model, ids, torch.ones_like(ids), positions=mask)
            assert not torch.allclose(at_one[0][mask[0]], generated, atol=1e-2)

    metrics = learner.step([group])
    assert metrics.trained and metrics.malformed == 0 and metrics.trajectories == 4
    # behaviour and learner log-probs agree token by token: weights and ratios are 1
    assert metrics.behaviour_weight_mean == pytest.approx(1.0, abs=2e-3)
    assert metrics.behaviour_weight_max == pytest.approx(1.0, abs=5e-3)
    assert metrics.ratio_mean == pytest.approx(1.0, abs=1e-6)
    assert metrics.kl == pytest.approx(0.0, abs=1e-4)


def test_truncated_sampling_is_refused_and_counted(
    policy: LoadedPolicy, make_group: GroupFactory, caplog: pytest.LogCaptureFixture
) -> None:
    nucleus = make_group([1.0, 0.0, 1.0, 0.0])
    nucleus.trajectories[0].top_p = 0.9
    nucleus.trajectories[3].top_k = 20
    greedy = make_group([0.0, 1.0], offset=4)
    for t in greedy.trajectories:
        t.temperature = 0.0
    learner = GrpoLearner(policy, config())

    with caplog.at_level(logging.ERROR, logger="coevolve.services.learner.trainer"):
        metrics = learner.step([nucleus, greedy])
        again = learner.step([make_group([1.0, 0.0], version=1, offset=6), nucleus])

    assert metrics.refused_truncated == 4 and metrics.malformed == 0
    assert metrics.trajectories == 2 and metrics.trained
    assert again.refused_truncated == 2 and again.trajectories == 4
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1  # loud once, not once per trajectory
    assert "top_p=0.9" in errors[0].getMessage()
    assert "refused_truncated" in errors[0].getMessage()


def test_rollout_records_its_truncation_and_the_learner_refuses_it(
    policy: LoadedPolicy,
) -> None:
    task = next(t for t in seed_tasks() if t.id == "multi_turn_base_100")
    engine = TransformersEngine(policy)

    def sample(top_p: float) -> list[Trajectory]:
        params = SamplingParams(max_new_tokens=2, temperature=TEMPERATURE, top_p=top_p, seed=3)
        return run_group(engine, lambda: make_environment("bfcl"), task, 2, params, max_steps=1)

    full, nucleus = sample(1.0), sample(0.9)
    assert [(t.top_p, t.top_k, t.temperature) for t in full] == [(1.0, None, TEMPERATURE)] * 2
    assert [t.top_p for t in nucleus] == [0.9, 0.9]

    learner = GrpoLearner(policy, config(drop_uniform_groups=False))
    group = RolloutGroup(task_id=task.id, origin="seed", policy_version=0, trajectories=nucleus)
    metrics = learner.step([group])
    assert metrics.refused_truncated == 2 and not metrics.trained
