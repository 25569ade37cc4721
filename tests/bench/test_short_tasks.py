"""The short MathAPI tasks are real BFCL tasks: their ground truth scores 1.0 by replay."""

from __future__ import annotations

from coevolve.bench.short_tasks import (
    OFFERED,
    build_tasks,
    make_task,
    replay_score,
    train_and_heldout,
)
from coevolve.schedules.lockstep import TaskCycle
from coevolve.shared.envs import make_environment


def test_every_built_task_replays_to_full_score() -> None:
    tasks = build_tasks(12, seed=3, prefix="t")
    assert len(tasks) == 12
    assert all(replay_score(task) == 1.0 for task in tasks)
    assert {task.ground_truth[0][0].name for task in tasks} == set(OFFERED)


def test_a_wrong_answer_scores_zero() -> None:
    task = make_task("wrong", "What is 2 plus 3?", "add", {"a": 2, "b": 3})
    env = make_environment("bfcl")
    env.reset(task)
    env.step('<tool_call>{"name": "add", "arguments": {"a": 2, "b": 4}}</tool_call>')
    env.step("Done.")
    assert env.score() == 0.0


def test_only_the_offered_functions_are_rendered() -> None:
    task = build_tasks(1, seed=0, prefix="t")[0]
    env = make_environment("bfcl")
    env.reset(task)
    names = {tool["function"]["name"] for tool in env.tools()}
    assert names == set(OFFERED)


def test_train_and_heldout_questions_are_disjoint() -> None:
    train, heldout = train_and_heldout(16, 16)
    assert len(train) == 16 and len(heldout) == 16
    assert not {t.user_turns[0] for t in train} & {t.user_turns[0] for t in heldout}
    assert not {t.id for t in train} & {t.id for t in heldout}


def test_task_cycle_draws_every_task_once_before_any_twice() -> None:
    tasks = build_tasks(5, seed=1, prefix="c")
    cycle = TaskCycle(tasks, seed=2)
    first_round = [t.id for t in cycle(5)]
    assert sorted(first_round) == sorted(t.id for t in tasks)
    assert len(cycle(7)) == 7
