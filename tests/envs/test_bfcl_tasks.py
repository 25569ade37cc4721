"""Tasks from BFCL entries; the deterministic train/eval split; the seed pool."""

from __future__ import annotations

import hashlib
import json

import pytest
from bfcl_eval.constants.category_mapping import VERSION_PREFIX

from coevolve.shared.envs.bfcl.catalog import DATA_DIR
from coevolve.shared.envs.bfcl.tasks import (
    MULTI_TURN_CATEGORIES,
    SUITES,
    UnknownCategoryError,
    eval_queries,
    load_tasks,
    scenario_number,
    seed_tasks,
    split_of,
    split_tasks,
    suite_tasks,
)


@pytest.mark.parametrize("category", MULTI_TURN_CATEGORIES)
def test_every_entry_becomes_a_task(category: str) -> None:
    path = DATA_DIR / f"{VERSION_PREFIX}_{category}.json"
    entries = [json.loads(line) for line in path.read_text().splitlines() if line]
    tasks = load_tasks(category)
    assert [t.id for t in tasks] == [e["id"] for e in entries]
    for task, entry in zip(tasks, entries, strict=True):
        assert task.environment == "bfcl"
        assert len(task.user_turns) == len(entry["question"]) == len(task.ground_truth)
        assert task.initial_state == entry.get("initial_config", {})
        assert task.env_config["involved_classes"] == entry["involved_classes"]
        assert task.env_config["long_context"] == (category == "multi_turn_long_context")


def test_miss_func_tasks_carry_their_holdout_functions() -> None:
    tasks = load_tasks("multi_turn_miss_func")
    for task in tasks:
        missed = task.env_config["missed_function"]
        assert missed, task.id
        for turn in missed:
            # the turn that reveals functions has no user text of its own
            assert task.user_turns[int(turn)] == ""


def test_tasks_do_not_share_mutable_state_with_the_loader() -> None:
    first = load_tasks("multi_turn_base")[0]
    first.initial_state.clear()
    assert load_tasks("multi_turn_base")[0].initial_state


def test_split_is_deterministic_by_scenario_hash() -> None:
    for entry_id in ("multi_turn_base_0", "multi_turn_long_context_17", "multi_turn_miss_param_5"):
        digest = hashlib.sha256(f"coevolve-bfcl-split-v1:{scenario_number(entry_id)}".encode())
        assert split_of(entry_id) == ("train" if digest.digest()[0] % 2 == 0 else "eval")


def test_split_halves_are_disjoint_complete_and_balanced() -> None:
    tasks = load_tasks("multi_turn_base")
    train, evaluation = split_tasks(tasks)
    assert {t.id for t in train}.isdisjoint({t.id for t in evaluation})
    assert len(train) + len(evaluation) == len(tasks)
    assert 0.4 <= len(train) / len(tasks) <= 0.6
    again_train, _ = split_tasks(load_tasks("multi_turn_base"))
    assert [t.id for t in again_train] == [t.id for t in train]


def test_all_variants_of_a_scenario_fall_on_the_same_side() -> None:
    sides: dict[int, set[str]] = {}
    for category in MULTI_TURN_CATEGORIES:
        for task in load_tasks(category):
            sides.setdefault(scenario_number(task.id), set()).add(split_of(task.id))
    assert all(len(side) == 1 for side in sides.values())


def test_seed_tasks_are_the_train_half_of_base_with_origin_seed() -> None:
    seeds = seed_tasks()
    train, evaluation = split_tasks(load_tasks("multi_turn_base"))
    assert [t.id for t in seeds] == [t.id for t in train]
    assert all(t.origin == "seed" for t in seeds)
    eval_ids = {t.id for t in evaluation}
    assert not any(t.id in eval_ids for t in seeds)


def test_eval_queries_are_exactly_the_eval_entries_user_turns() -> None:
    expected = {
        turn.strip()
        for category in MULTI_TURN_CATEGORIES
        for task in split_tasks(load_tasks(category))[1]
        for turn in task.user_turns
        if turn.strip()
    }
    queries = eval_queries()
    assert set(queries) == expected
    assert len(queries) == len(set(queries))


def test_suites_and_splits() -> None:
    assert set(SUITES.values()) == set(MULTI_TURN_CATEGORIES)
    assert len(suite_tasks("bfcl-multi-turn-base", "all")) == 200
    train = suite_tasks("bfcl-multi-turn-miss-func", "train")
    assert all(split_of(t.id) == "train" for t in train)
    with pytest.raises(UnknownCategoryError):
        suite_tasks("bfcl-single-turn")
    with pytest.raises(ValueError, match="split"):
        suite_tasks("bfcl-multi-turn-base", "test")
