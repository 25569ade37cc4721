"""The hard-negatives benchmark: its pairing on fixed groups."""

from __future__ import annotations

import pytest

from coevolve.bench import hard_negatives
from coevolve.cli.bench import BENCHMARKS
from coevolve.shared.messages import Agent, RolloutGroup
from tests.support.messages import untokenized_trajectory


def group(task_id: str, rewards: list[float], agent: Agent = "target") -> RolloutGroup:
    return RolloutGroup(
        task_id=task_id,
        origin="seed",
        policy_version=1,
        agent=agent,
        trajectories=[
            untokenized_trajectory(f"{agent}-{task_id}-{i}", task_id, reward=r)
            for i, r in enumerate(rewards)
        ],
    )


def test_each_failure_of_the_failure_agent_meets_the_targets_mean_failure() -> None:
    assert "hard_negatives" in BENCHMARKS
    target = [group("a", [1.0, 0.2, 0.0]), group("b", [1.0, 1.0])]
    failure = [group("a", [0.4, 1.0, 0.3], "failure"), group("b", [0.1], "failure")]

    pairs = hard_negatives.pairs_of(3, target, failure)

    # the solved episode of the failure agent is no failure; task b, which the target
    # solved every time, has no failure to be set against
    assert [(p.task_id, p.failure_agent, p.target) for p in pairs] == [
        ("a", 0.4, pytest.approx(0.1)),
        ("a", 0.3, pytest.approx(0.1)),
    ]
    assert {p.round for p in pairs} == {3}
    found = hard_negatives.summary(pairs)
    assert found is not None
    assert found["pairs"] == 2 and found["tasks"] == 1
    assert found["gap"] == pytest.approx(0.25)
    assert found["gap_low"] <= found["gap"] <= found["gap_high"]
    assert hard_negatives.summary([]) is None
