"""BFCL multi-turn entries as Tasks, the deterministic train/eval split, and the seed pool.

Tasks come at two grains. A whole entry is one task (``multi_turn_base_7``). Each of its
user turns is also a task of its own (``multi_turn_base_7#t3``): ``env_config["grain"]`` is
``"turn"``, ``env_config["turn"]`` the turn's index in the entry, and
``env_config["prior_turns"]`` / ``["prior_ground_truth"]`` the earlier user turns and their
ground-truth calls, which the environment replays at reset to reach the turn's starting
state and the conversation so far. ``user_turns`` and ``ground_truth`` hold that one turn.
Turns whose ground truth is empty are not tasks: BFCL's checkers check nothing on such a
turn, so every answer would score 1 (they stay in later turns' conversations).

The split is by scenario number: ``multi_turn_base_7``, ``multi_turn_miss_func_7``,
``multi_turn_miss_param_7`` and ``multi_turn_long_context_7`` are variants of one scenario
(same questions, same initial state), so all four fall on the same side, and so do their
turns. Which side is decided by a hash of the number, so the split never changes between
runs or machines.
"""

from __future__ import annotations

import copy
import hashlib
import json
import random
from collections.abc import Collection, Mapping
from functools import cache
from typing import Any, Literal

import msgspec
from bfcl_eval.constants.category_mapping import VERSION_PREFIX

from coevolve.shared.envs.bfcl.calls import parse_call_string
from coevolve.shared.envs.bfcl.catalog import DATA_DIR, all_class_names
from coevolve.shared.messages import Task, ToolCall

ENVIRONMENT_NAME = "bfcl"

MULTI_TURN_CATEGORIES: tuple[str, ...] = (
    "multi_turn_base",
    "multi_turn_miss_func",
    "multi_turn_miss_param",
    "multi_turn_long_context",
)

Grain = Literal["entry", "turn"]
TURN_ID_SEPARATOR = "#t"

# `coevolve eval --suite NAME` -> BFCL category; whole entries, then one task per turn.
ENTRY_SUITES: dict[str, str] = {
    "bfcl-multi-turn-base": "multi_turn_base",
    "bfcl-multi-turn-miss-func": "multi_turn_miss_func",
    "bfcl-multi-turn-miss-param": "multi_turn_miss_param",
    "bfcl-multi-turn-long-context": "multi_turn_long_context",
}
TURN_SUITES: dict[str, str] = {
    "bfcl-turns-base": "multi_turn_base",
    "bfcl-turns-miss-func": "multi_turn_miss_func",
    "bfcl-turns-miss-param": "multi_turn_miss_param",
    "bfcl-turns-long-context": "multi_turn_long_context",
}
SUITES: dict[str, str] = {**ENTRY_SUITES, **TURN_SUITES}

# The seed pool's default share of per-turn tasks and of whole entries. Per-turn only: on
# 2 CPU cores a group of 8 whole 5-turn entries held the one rollout worker for over 16
# minutes (a per-turn group: about a minute), so no policy update came in that time.
DEFAULT_SEED_GRAINS: dict[str, float] = {"turns": 1.0, "entries": 0.0}

SPLIT_SALT = "coevolve-bfcl-split-v1"

# The default world: the entries that use only these API classes (124 train and 108 eval
# turns of multi_turn_base). Their tool lists are short and shared, so a run's tasks repeat
# and a 135M policy's warm start solves some of them; the full BFCL world is
# ``pool_store.seed_classes: null`` (docs/environments.md has the measurements).
FOCUS_CLASSES: tuple[str, ...] = ("MessageAPI", "TradingBot", "VehicleControlAPI")


def run_world(services: Mapping[str, Any]) -> list[str] | None:
    """The run's world from its ``services`` settings: ``pool_store.seed_classes``, whose
    section pool-store validates (default: the focused classes; None: every class)."""
    section = services.get("pool_store") or {}
    return section.get("seed_classes", list(FOCUS_CLASSES))


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


def entry_id_of(task_id: str) -> str:
    """``multi_turn_base_7#t3`` -> ``multi_turn_base_7`` (an entry's id is its own)."""
    return task_id.split(TURN_ID_SEPARATOR, 1)[0]


def turn_task_id(entry_id: str, turn: int) -> str:
    return f"{entry_id}{TURN_ID_SEPARATOR}{turn}"


def scenario_number(entry_id: str) -> int:
    """``multi_turn_miss_func_12`` (or its turn ``...#t2``) -> 12 (shared by the variants
    of one scenario)."""
    return int(entry_id_of(entry_id).rsplit("_", 1)[1])


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


def grain_of(task: Task) -> Grain:
    return "turn" if task.env_config.get("grain") == "turn" else "entry"


def turn_tasks(task: Task) -> list[Task]:
    """One task per user turn of a whole-entry ``task`` whose ground truth is not empty."""
    if grain_of(task) == "turn":
        raise ValueError(f"task {task.id} is already one turn")
    if len(task.ground_truth) != len(task.user_turns):
        raise ValueError(
            f"task {task.id}: {len(task.user_turns)} user turns but "
            f"{len(task.ground_truth)} ground-truth turns"
        )
    entry_id = task.source_entry or task.id
    prior_truth = [[msgspec.to_builtins(call) for call in calls] for calls in task.ground_truth]
    tasks = []
    for turn, (text, calls) in enumerate(zip(task.user_turns, task.ground_truth, strict=True)):
        if not calls:
            continue
        env_config = {
            **copy.deepcopy(task.env_config),
            "grain": "turn",
            "turn": turn,
            "prior_turns": list(task.user_turns[:turn]),
            "prior_ground_truth": copy.deepcopy(prior_truth[:turn]),
        }
        tasks.append(
            msgspec.structs.replace(
                task,
                id=turn_task_id(task.id, turn),
                user_turns=[text],
                ground_truth=[list(calls)],
                initial_state=copy.deepcopy(task.initial_state),
                env_config=env_config,
                source_entry=entry_id,
                lineage=copy.deepcopy(task.lineage),
            )
        )
    return tasks


# the configuration keys of a per-turn task that carry its conversation so far
CONVERSATION_KEYS = frozenset({"turn", "prior_turns", "prior_ground_truth"})


def config_without_conversation(env_config: Mapping[str, Any]) -> dict[str, Any]:
    """A task's configuration less its conversation so far: the setting (API classes,
    category) that tasks which may be joined into one turn share."""
    return {key: value for key, value in env_config.items() if key not in CONVERSATION_KEYS}


def prior_ground_truth(env_config: Mapping[str, Any]) -> list[list[ToolCall]]:
    """The earlier turns' ground-truth calls of a per-turn task ([] for a whole entry)."""
    raw = env_config.get("prior_ground_truth") or []
    try:
        return msgspec.convert(raw, list[list[ToolCall]])
    except msgspec.ValidationError as exc:
        raise ValueError(f"env_config.prior_ground_truth: {exc}") from exc


def load_turn_tasks(category: str = "multi_turn_base") -> list[Task]:
    """Every checked user turn of every entry of one category as a task of its own."""
    return [turn for task in load_tasks(category) for turn in turn_tasks(task)]


def check_classes(classes: Collection[str]) -> None:
    """Raise ValueError naming any of ``classes`` that is not a BFCL API class."""
    if not classes:
        raise ValueError("no API classes given (null means every class)")
    unknown = sorted(set(classes) - set(all_class_names()))
    if unknown:
        raise ValueError(f"unknown API classes {unknown}; choose from {all_class_names()}")


def in_world(task: Task, classes: Collection[str] | None) -> bool:
    """Whether every API class ``task`` uses is one of ``classes`` (None: any class)."""
    return classes is None or set(task.env_config.get("involved_classes", ())) <= set(classes)


def split_tasks(tasks: list[Task]) -> tuple[list[Task], list[Task]]:
    """(train, eval), deterministic by scenario number (a turn goes with its entry)."""
    train = [task for task in tasks if split_of(task.source_entry or task.id) == "train"]
    evaluation = [task for task in tasks if split_of(task.source_entry or task.id) == "eval"]
    return train, evaluation


def seed_tasks() -> list[Task]:
    """The train half of multi_turn_base (whole entries): where explorers start."""
    train, _ = split_tasks(load_tasks("multi_turn_base"))
    return train


@cache
def train_argument_values() -> dict[tuple[str, str], tuple[str, ...]]:
    """(function, parameter) -> the strings the train half's ground truth passes there (a
    city that ``get_zipcode_based_on_city`` knows lives in its code, not in any state)."""
    found: dict[tuple[str, str], list[str]] = {}
    for task in seed_tasks():
        for call in (call for turn in task.ground_truth for call in turn):
            for parameter, value in call.arguments.items():
                known = found.setdefault((call.name, parameter), [])
                if isinstance(value, str) and value not in known:
                    known.append(value)
    return {key: tuple(values) for key, values in found.items()}


STATE_ID_SUFFIX = "#state"


def state_tasks(classes: Collection[str] | None = None) -> list[Task]:
    """The initial states of the train split's scenarios (of the entries using only
    ``classes``; None: all) as tasks with nothing to answer: no user turn, no ground
    truth, only the API classes and their initial configuration. Where unguided
    exploration starts when a run uses no labels; identical states appear once."""
    states: dict[str, Task] = {}
    for task in seed_tasks():
        if not in_world(task, classes):
            continue
        env_config = {
            "category": task.env_config["category"],
            "involved_classes": list(task.env_config["involved_classes"]),
            "long_context": False,
            "grain": "turn",
        }
        start = Task(
            id=f"{task.id}{STATE_ID_SUFFIX}",
            environment=ENVIRONMENT_NAME,
            user_turns=[],
            initial_state=copy.deepcopy(task.initial_state),
            env_config=env_config,
            origin="seed",
            source_entry=task.id,
            created_at=0.0,
        )
        states.setdefault(start.content_hash(), start)
    return list(states.values())


def seed_pool(
    grains: Mapping[str, float] | None = None, classes: Collection[str] | None = None
) -> list[Task]:
    """The train half of multi_turn_base as the task pool starts: whole entries and
    per-turn tasks mixed by ``grains`` (shares of ``turns`` and ``entries``, default
    ``DEFAULT_SEED_GRAINS``), of the entries that use only ``classes`` (None: all).

    Everything of the grain that is short of its share is kept; the other grain is thinned
    (a fixed choice, the same on every run) until the shares hold. Per-turn tasks are marked
    ``env_config["grain"] == "turn"`` and ids ``...#tN``, so a sampler can weight them.
    """
    turns_share, entries_share = _grain_shares(grains or DEFAULT_SEED_GRAINS)
    if classes is not None:
        check_classes(classes)
    entries = [task for task in seed_tasks() if in_world(task, classes)]
    turns = [turn for task in entries for turn in turn_tasks(task)]
    if entries_share == 0.0:
        return turns
    if turns_share == 0.0:
        return entries
    wanted_turns = round(len(entries) * turns_share / entries_share)
    if wanted_turns < len(turns):
        turns = _fixed_subset(turns, wanted_turns)
    else:
        entries = _fixed_subset(entries, round(len(turns) * entries_share / turns_share))
    return [*entries, *turns]


def _grain_shares(grains: Mapping[str, float]) -> tuple[float, float]:
    unknown = set(grains) - {"turns", "entries"}
    if unknown:
        raise ValueError(f"seed grains are 'turns' and 'entries', not {sorted(unknown)}")
    turns, entries = float(grains.get("turns", 0.0)), float(grains.get("entries", 0.0))
    if turns < 0 or entries < 0 or turns + entries <= 0:
        raise ValueError(f"seed grain shares must be >= 0 and not all 0, got {dict(grains)}")
    return turns / (turns + entries), entries / (turns + entries)


def _fixed_subset(tasks: list[Task], size: int) -> list[Task]:
    """``size`` of ``tasks`` chosen by a fixed seed, in their original order."""
    keep = set(random.Random(SPLIT_SALT).sample(range(len(tasks)), max(0, size)))
    return [task for index, task in enumerate(tasks) if index in keep]


def suite_tasks(
    suite: str, split: str = "eval", classes: Collection[str] | None = None
) -> list[Task]:
    """The tasks of an eval suite (``bfcl-multi-turn-base``: entries, ``bfcl-turns-base``:
    one per turn): ``all``, ``eval``, ``train``; only entries using ``classes`` when given."""
    if split not in ("all", "eval", "train"):
        raise ValueError(f"split must be 'all', 'eval' or 'train', not {split!r}")
    try:
        category = SUITES[suite]
    except KeyError:
        raise UnknownCategoryError(
            f"unknown suite {suite!r}; choose from {sorted(SUITES)}"
        ) from None
    if classes is not None:
        check_classes(classes)
    tasks = load_turn_tasks(category) if suite in TURN_SUITES else load_tasks(category)
    tasks = [task for task in tasks if in_world(task, classes)]
    if split == "all":
        return tasks
    train, evaluation = split_tasks(tasks)
    return train if split == "train" else evaluation


def normalized_turn(text: str) -> str:
    return " ".join(text.split()).lower()


@cache
def labelled_turns() -> frozenset[str]:
    """Every user turn of every multi-turn entry, both splits (normalized): the labelled
    text a run with no labels must never train on."""
    return frozenset(
        normalized_turn(_user_turn_text(turn))
        for category in MULTI_TURN_CATEGORIES
        for entry, _ in _raw_entries(category)
        for turn in entry["question"]
    )


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
