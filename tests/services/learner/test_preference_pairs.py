"""Preference pairs: the expert (replayed ground truth, as the warm start builds it) against
each failure, and failures against each other by partial credit."""

from __future__ import annotations

import pytest

from coevolve.services.learner import preference_pairs
from coevolve.services.learner.config import WarmStartConfig
from coevolve.services.learner.preference_pairs import (
    EXPERT,
    ExpertCache,
    PairSide,
    PreferencePair,
    expert_pairs,
    expert_sides,
    failure_pairs,
)
from coevolve.services.learner.sft import build_examples, supervised_mask
from coevolve.shared.envs.bfcl.tasks import seed_tasks
from coevolve.shared.messages import ChatMessage, RolloutGroup, Task
from coevolve.shared.policy import LoadedPolicy
from tests.support.messages import stepped_trajectory

USER = [ChatMessage(role="user", content="Go to documents.")]
CALL = [ChatMessage(role="assistant", content="cd"), ChatMessage(role="tool", content="ok")]
EXPERT_SIDE = PairSide([7] * 8, [0, 0, 0, 1, 1, 0, 1, 1], 1.0, EXPERT)


def group(*rewards: float, task_id: str = "t") -> RolloutGroup:
    trajectories = [
        stepped_trajectory(f"{task_id}-{i}", task_id, USER, [CALL], reward=r)
        for i, r in enumerate(rewards)
    ]
    return RolloutGroup(task_id=task_id, origin="seed", policy_version=0, trajectories=trajectories)


def ranked(pairs: list[PreferencePair]) -> list[tuple[float, float]]:
    return [(p.chosen.reward, p.rejected.reward) for p in pairs]


def test_failures_are_ordered_by_partial_credit() -> None:
    rewards = (1.0, 0.2, 0.4, 0.0, 0.2)
    pairs = failure_pairs(group(*rewards))
    # solved trajectories are no failure; equal partial credit makes no pair
    # the widest gap first, then the group's order
    assert ranked(pairs) == [(0.4, 0.0), (0.4, 0.2), (0.2, 0.0), (0.4, 0.2), (0.2, 0.0)]
    assert all(p.kind == "failure" and p.chosen.reward > p.rejected.reward for p in pairs)
    assert {p.chosen.source for p in pairs if p.chosen.reward == 0.4} == {"t-2"}
    assert ranked(failure_pairs(group(*rewards), limit=2)) == [(0.4, 0.0), (0.4, 0.2)]
    assert failure_pairs(group(0.2, 0.2, 1.0)) == []


def test_the_expert_is_paired_with_each_failure_only() -> None:
    pairs = expert_pairs(group(1.0, 0.4, 0.0), EXPERT_SIDE)
    assert [(p.chosen.source, p.rejected.source) for p in pairs] == [
        (EXPERT, "t-1"),
        (EXPERT, "t-2"),
    ]
    assert all(p.kind == "expert" for p in pairs)
    assert expert_pairs(group(1.0, 1.0), EXPERT_SIDE) == []  # no failure, no pair
    assert expert_pairs(group(0.0, 0.4), None) == []  # no ground truth, no pair


def test_a_failure_keeps_the_agents_tokens_as_its_mask() -> None:
    [pair] = expert_pairs(group(0.0), EXPERT_SIDE)
    trajectory = group(0.0).trajectories[0]
    assert pair.rejected.loss_mask == trajectory.loss_mask
    assert pair.rejected.token_ids == trajectory.token_ids
    # a trajectory that cannot be scored is not paired
    broken = group(0.0, 0.4)
    broken.trajectories[0].loss_mask = [0] * len(broken.trajectories[0].token_ids)
    assert [p.rejected.source for p in expert_pairs(broken, EXPERT_SIDE)] == ["t-1"]


def test_each_objective_takes_its_pairs() -> None:
    groups = [group(0.0, 0.4, 1.0), group(0.0, 0.2, task_id="no-expert")]
    experts = {"t": EXPERT_SIDE}
    eto = preference_pairs.preference_pairs(groups, experts, "eto")
    assert [(p.task_id, p.kind) for p in eto] == [("t", "expert"), ("t", "expert")]
    both = preference_pairs.preference_pairs(groups, experts, "coevolving_dpo")
    assert [(p.task_id, p.kind) for p in both] == [
        ("t", "expert"),
        ("t", "expert"),
        ("t", "failure"),
        ("no-expert", "failure"),
    ]
    with pytest.raises(ValueError, match="grpo"):
        preference_pairs.preference_pairs(groups, experts, "grpo")


def test_a_pair_cut_before_an_agent_token_is_dropped() -> None:
    [pair] = expert_pairs(group(0.0), EXPERT_SIDE)
    cut = pair.cut(4)
    assert cut is not None and cut.chosen.token_ids == [7] * 4 and cut.chosen.agent_tokens == 1
    assert pair.cut(3) is None
    assert pair.cut(None) is pair


@pytest.fixture(scope="module")
def tasks() -> list[Task]:
    return seed_tasks()[:2]


def test_the_expert_is_the_warm_starts_example(policy: LoadedPolicy, tasks: list[Task]) -> None:
    """Same tokenizer, chat template, tools prompt and replayed tool results as the SFT
    warm start: the expert side is its example, the mask its assistant labels."""
    config = WarmStartConfig(max_target_tokens=None)
    sides = expert_sides(policy, tasks, config)
    examples, skipped, _ = build_examples(policy, tasks)
    assert skipped == 0 and set(sides) == {t.id for t in tasks}
    for example in examples:
        side = sides[example.task_id]
        assert side.token_ids == example.input_ids
        assert side.loss_mask == supervised_mask(example)
        assert (side.reward, side.source) == (1.0, EXPERT)


def test_experts_are_built_once_and_a_task_without_one_is_remembered(
    policy: LoadedPolicy, tasks: list[Task], monkeypatch: pytest.MonkeyPatch
) -> None:
    built: list[str] = []
    real = preference_pairs.expert_sides

    def counted(policy: LoadedPolicy, wanted: list[Task], config: WarmStartConfig) -> object:
        built.extend(t.id for t in wanted)
        return real(policy, wanted, config)

    monkeypatch.setattr(preference_pairs, "expert_sides", counted)
    unlabelled = Task(id="no-labels", environment="bfcl", user_turns=["Explore."])
    cache = ExpertCache(policy, WarmStartConfig(max_target_tokens=None), size=2)
    first = cache.for_tasks([tasks[0], unlabelled, tasks[0]])
    assert set(first) == {tasks[0].id}
    assert cache.for_tasks([unlabelled, tasks[0]]) == first
    assert built == [tasks[0].id, "no-labels"]
    cache.for_tasks([tasks[1]])  # over the size: the oldest is forgotten
    assert cache.missing([tasks[0].id, "no-labels", tasks[1].id]) == [tasks[0].id]
