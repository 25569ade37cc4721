"""The hard-negatives benchmark: its pairing on fixed groups, and one real run."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from coevolve.bench import hard_negatives
from coevolve.cli.bench import BENCHMARKS
from coevolve.shared.messages import Agent, RolloutGroup
from tests.support.cache import CACHE_DIR
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


@pytest.mark.slow
def test_a_real_run_samples_both_agents_and_counts_pairs_after_the_first_update(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Real model, llama.cpp engine, BFCL turns and the failure agent's DPO steps: the
    rounds before its first update all train it and give the control; the result on disk
    is the one returned."""
    monkeypatch.setenv("COEVOLVE_RUN_DIR", str(CACHE_DIR))
    setup = dataclasses.replace(hard_negatives.QUICK, max_rounds=2, max_new_tokens=16)

    result = hard_negatives.run(quick=True, setup=setup, out=tmp_path)

    assert json.loads((tmp_path / "result.json").read_text()) == result
    rounds = result["rounds"]
    assert [r["round"] for r in rounds] == list(range(1, len(rounds) + 1))
    assert 1 <= len(rounds) <= 2 and rounds[0]["failure_agent_step"]
    for r in rounds:
        assert 0.0 <= r["target_solved"] <= 1.0 and 0.0 <= r["failure_agent_solved"] <= 1.0
        if not r["failure_agent_trained"]:
            assert r["failure_agent_step"]
        # the target stays the warm start; only the failure agent's version moves
        assert r["target_version"] == rounds[0]["target_version"]
    control_rounds = {r["round"] for r in rounds if not r["failure_agent_trained"]}
    counted = {"control": 0, "measured": 0}
    for pair in result["pairs"]:
        counted["control" if pair["round"] in control_rounds else "measured"] += 1
    for name in counted:
        found = result[name]
        assert (found["pairs"] if found else 0) == counted[name]
    assert result["reached_min_pairs"] == (counted["measured"] >= 1)
