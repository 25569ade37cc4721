"""BFCL multi-turn entries as Tasks, the deterministic train/eval split, and the seed pool.

The split is by scenario number: ``multi_turn_base_7``, ``multi_turn_miss_func_7``,
``multi_turn_miss_param_7`` and ``multi_turn_long_context_7`` are variants of one scenario
(same questions, same initial state), so all four fall on the same side. Which side is
decided by a hash of the number, so the split never changes between runs or machines.
"""

from __future__ import annotations

import copy
import hashlib
import json
from functools import cache
from typing import Any, Literal

from bfcl_eval.constants.category_mapping import VERSION_PREFIX

from coevolve.shared.envs.bfcl.calls import parse_call_string
from coevolve.shared.envs.bfcl.catalog import DATA_DIR
from coevolve.shared.messages import Task

ENVIRONMENT_NAME = "bfcl"

MULTI_TURN_CATEGORIES: tuple[str, ...] = (
    "multi_turn_base",
    "multi_turn_miss_func",
    "multi_turn_miss_param",
    "multi_turn_long_context",
)

# `coevolve eval --suite NAME` -> BFCL category.
SUITES: dict[str, str] = {
    "bfcl-multi-turn-base": "multi_turn_base",
    "bfcl-multi-turn-miss-func": "multi_turn_miss_func",
    "bfcl-multi-turn-miss-param": "multi_turn_miss_param",
    "bfcl-multi-turn-long-context": "multi_turn_long_context",
}

SPLIT_SALT = "coevolve-bfcl-split-v1"

Split = Literal["train", "eval"]


class UnknownCategoryError(ValueError):
    """Not one of BFCL's multi-turn categories."""


def _read_jsonl(path_name: str, folder: str = "") -> list[dict[str, Any]]:
    path = DATA_DIR / folder / path_name if folder else DATA_DIR / path_name
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line]


@cache
def _raw_entries(category: str) -> tuple[tuple[dict[str, Any], dict[str, Any]], ...]:
    if category not in MULTI_TURN_CATEGORIES:
        raise UnknownCategoryError(
            f"unknown BFCL multi-turn category {category!r}; choose from {MULTI_TURN_CATEGORIES}"
        )
    file_name = f"{VERSION_PREFIX}_{category}.json"
    entries = _read_jsonl(file_name)
    answers = {answer["id"]: answer for answer in _read_jsonl(file_name, "possible_answer")}
    return tuple((entry, answers[entry["id"]]) for entry in entries)


def scenario_number(entry_id: str) -> int:
    """``multi_turn_miss_func_12`` -> 12 (shared by the variants of one scenario)."""
    return int(entry_id.rsplit("_", 1)[1])


def split_of(entry_id: str) -> Split:
    digest = hashlib.sha256(f"{SPLIT_SALT}:{scenario_number(entry_id)}".encode()).digest()
    return "train" if digest[0] % 2 == 0 else "eval"


def _user_turn_text(turn: list[dict[str, Any]]) -> str:
    return "\n".join(message["content"] for message in turn if message.get("role") == "user")


def _task_from_entry(entry: dict[str, Any], answer: dict[str, Any], category: str) -> Task:
    involved = list(entry["involved_classes"])
    ground_truth = [
        [parse_call_string(text, involved) for text in turn] for turn in answer["ground_truth"]
    ]
    env_config: dict[str, Any] = {
        "category": category,
        "involved_classes": involved,
        "long_context": "long_context" in category or "composite" in category,
        "missed_function": {
            str(turn): list(names) for turn, names in entry.get("missed_function", {}).items()
        },
    }
    return Task(
        id=entry["id"],
        environment=ENVIRONMENT_NAME,
        user_turns=[_user_turn_text(turn) for turn in entry["question"]],
        initial_state=copy.deepcopy(entry.get("initial_config", {})),
        ground_truth=ground_truth,
        env_config=env_config,
        origin="seed",
        source_entry=entry["id"],
        created_at=0.0,
    )


def load_tasks(category: str = "multi_turn_base") -> list[Task]:
    """Every entry of one multi-turn category as a Task (fresh objects on every call)."""
    return [_task_from_entry(entry, answer, category) for entry, answer in _raw_entries(category)]


def split_tasks(tasks: list[Task]) -> tuple[list[Task], list[Task]]:
    """(train, eval), deterministic by scenario number."""
    train = [task for task in tasks if split_of(task.source_entry or task.id) == "train"]
    evaluation = [task for task in tasks if split_of(task.source_entry or task.id) == "eval"]
    return train, evaluation


def seed_tasks() -> list[Task]:
    """The train half of multi_turn_base: where the task pool and explorers start."""
    train, _ = split_tasks(load_tasks("multi_turn_base"))
    return train


def suite_tasks(suite: str, split: str = "eval") -> list[Task]:
    """The entries of an eval suite (``bfcl-multi-turn-base`` ...): ``all``, ``eval``, ``train``."""
    if split not in ("all", "eval", "train"):
        raise ValueError(f"split must be 'all', 'eval' or 'train', not {split!r}")
    try:
        category = SUITES[suite]
    except KeyError:
        raise UnknownCategoryError(
            f"unknown suite {suite!r}; choose from {sorted(SUITES)}"
        ) from None
    tasks = load_tasks(category)
    if split == "all":
        return tasks
    train, evaluation = split_tasks(tasks)
    return train if split == "train" else evaluation


def eval_queries() -> list[str]:
    """Every user turn of every eval-split entry of every multi-turn category."""
    queries: list[str] = []
    seen: set[str] = set()
    for category in MULTI_TURN_CATEGORIES:
        for entry, _ in _raw_entries(category):
            if split_of(entry["id"]) != "eval":
                continue
            for turn in entry["question"]:
                text = _user_turn_text(turn).strip()
                if text and text not in seen:
                    seen.add(text)
                    queries.append(text)
    return queries
