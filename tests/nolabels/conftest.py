"""The committed D0 (built by `coevolve discover` on BFCL's focused world) and the labelled
text a run with no labels must never train on."""

from __future__ import annotations

from functools import cache
from pathlib import Path

import pytest

from coevolve.shared.envs.bfcl.tasks import (
    MULTI_TURN_CATEGORIES,
    labelled_turns,
    load_tasks,
    normalized_turn,
)
from coevolve.shared.messages import Task, ToolCall

ROOT = Path(__file__).resolve().parents[2]
COMMITTED_D0 = ROOT / "docs" / "results" / "d0-20261129.json"


def call_key(calls: list[ToolCall]) -> tuple[tuple[str, str], ...]:
    return tuple((call.name, repr(sorted(call.arguments.items()))) for call in calls)


@cache
def labelled_call_sequences(min_calls: int = 2) -> set[tuple[tuple[str, str], ...]]:
    """Every ground-truth turn of BFCL's multi-turn entries with at least ``min_calls``
    calls (a one-call turn such as ``ls()`` may be found again by exploring)."""
    return {
        call_key(turn)
        for category in MULTI_TURN_CATEGORIES
        for task in load_tasks(category)
        for turn in task.ground_truth
        if len(turn) >= min_calls
    }


def carries_labels(task: Task) -> list[str]:
    """What of BFCL's labels ``task`` carries (empty: nothing)."""
    found = [turn for turn in task.user_turns if normalized_turn(turn) in labelled_turns()]
    sequences = labelled_call_sequences()
    found += [str(turn) for turn in task.ground_truth if call_key(turn) in sequences]
    found += [
        str(task.env_config[k])
        for k in ("prior_turns", "prior_ground_truth")
        if k in task.env_config
    ]
    return found


@pytest.fixture
def committed_d0() -> Path:
    return COMMITTED_D0
