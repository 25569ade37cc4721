"""After the warm start: its policy is the KL reference, and a killed SFT resumes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from coevolve.services.learner.config import LearnerConfig
from coevolve.services.learner.sft import warm_start
from coevolve.services.learner.trainer import GrpoLearner
from coevolve.shared.envs.bfcl.tasks import seed_tasks
from coevolve.shared.messages import Task

from .conftest import GroupFactory, PolicyFactory

MAX_LEN = 136  # the first turn's reply fits; trains in seconds on a CPU


@pytest.fixture(scope="module")
def tasks() -> list[Task]:
    return seed_tasks()[:2]


def short_warm_start(policy_factory: PolicyFactory, tasks: list[Task], **kwargs: object):  # type: ignore[no-untyped-def]
    policy = policy_factory()
    settings: dict[str, object] = {
        "epochs": 1,
        "lr": 2e-3,
        "batch_size": 1,
        "max_len": MAX_LEN,
        "replay": False,
    }
    report = warm_start(policy, tasks, **{**settings, **kwargs})  # type: ignore[arg-type]
    return policy, report


def test_kl_is_zero_at_the_first_grpo_step_after_the_warm_start(
    policy_factory: PolicyFactory, tasks: list[Task], make_group: GroupFactory
) -> None:
    group = make_group([1.0, 0.0, 1.0, 0.0])
    config = LearnerConfig(kl_beta=0.1, micro_batch_size=4, min_shared_prompt=1)

    policy, _ = short_warm_start(policy_factory, tasks)
    learner = GrpoLearner(policy, config)
    learner.freeze_reference()
    assert learner.warm_started
    first = learner.step([group])
    assert first.trained
    assert first.kl == pytest.approx(0.0, abs=1e-7)
    second = learner.step([group])
    assert second.kl > 0.0  # the fresh adapter moved away from the warm-started reference

    # without freezing, the reference is the base model: far from the warm-started policy
    unfrozen, _ = short_warm_start(policy_factory, tasks)
    assert GrpoLearner(unfrozen, config).step([group]).kl > 1e-4


class Killed(RuntimeError):
    pass


def test_a_killed_warm_start_resumes_at_its_epoch_and_batch(
    policy_factory: PolicyFactory, tasks: list[Task], tmp_path: Path
) -> None:
    checkpoint = tmp_path / "warm_start.pt"
    settings: dict[str, object] = {"epochs": 2, "checkpoint": checkpoint}

    def kill_after_three(step: int, total: int, loss: float) -> None:
        if step == 3:
            raise Killed

    with pytest.raises(Killed):
        short_warm_start(policy_factory, tasks, progress=kill_after_three, **settings)
    assert checkpoint.exists()

    seen: list[int] = []
    resumed, report = short_warm_start(
        policy_factory, tasks, progress=lambda step, total, loss: seen.append(step), **settings
    )
    assert seen == [4]  # epoch 2, batch 2: only the step that was not done yet
    assert report.steps == 4 and len(report.losses) == 4

    straight, expected = short_warm_start(policy_factory, tasks, epochs=2)
    assert report.losses == pytest.approx(expected.losses, rel=1e-5)
    for (name, a), (_, b) in zip(
        resumed.model.named_parameters(), straight.model.named_parameters(), strict=True
    ):
        if a.requires_grad:
            assert torch.allclose(a, b, atol=1e-6), name
