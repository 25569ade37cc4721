"""Requests of substitution rounds (``explorer/substitution.py``): made by code where the
parent's request states the value, else the parent's request with the words the
abstractor role says name it replaced; over real BFCL turns, a real pool file and a
scripted LLM on loopback (the real 0.5B: ``tests/llm/test_llm_real_server.py``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from coevolve.services.abstractor.edits import NO_WORDS, edited_request, naming_spans
from coevolve.services.explorer.substitution import substitution_rounds
from coevolve.shared.envs import make_environment
from coevolve.shared.envs.bfcl.tasks import load_turn_tasks
from coevolve.shared.messages import Exploration, FailedCall, Task
from tests.services.abstractor.abstraction_harness import abstracted
from tests.support.fake_llm import Answer

pytestmark = pytest.mark.anyio


def turn(task_id: str) -> Task:
    return next(task for task in load_turn_tasks() if task.id == task_id)


def substituted(task: Task) -> Exploration:
    rounds = substitution_rounds(task, lambda: make_environment(task.environment), 3)
    failed = [FailedCall(expected=call, problem="missed") for call in task.ground_truth[0]]
    return Exploration(
        id=f"exploration-{task.id}", mode="guided", task=task, rounds=rounds, failed_calls=failed
    )


class WordsBrain:
    """Answers the abstractor's question of which words name the value with ``words``."""

    def __init__(self, words: str) -> None:
        self.words = words
        self.offered: list[list[str]] = []

    def __call__(self, role: str, request: dict[str, Any]) -> Answer:
        schema = request["response_format"]["json_schema"]["schema"]
        self.offered.append(schema["properties"]["words"]["enum"])
        return Answer(json.dumps({"words": self.words}))


async def test_a_stated_value_gives_the_request_without_asking_the_llm(tmp_path: Path) -> None:
    parent = turn("multi_turn_base_72#t3")  # "... my user id is 'USR005'."
    explored = substituted(parent)
    stated = [r for r in explored.rounds if r.request is not None]
    assert stated
    result, fake = await abstracted(tmp_path, WordsBrain(NO_WORDS), explored)
    made = {c.task.user_turns[0] for c in result.candidates}
    assert {r.request for r in stated} <= made
    assert sum(fake.calls.values()) == len(explored.rounds) - len(stated)
    for candidate in result.candidates:
        assert candidate.task.env_config == parent.env_config  # the parent's conversation
        assert [c.name for c in candidate.task.ground_truth[0]] == [
            c.name for c in parent.ground_truth[0]
        ]


async def test_a_value_named_in_words_is_replaced_where_the_llm_points(tmp_path: Path) -> None:
    parent = turn("multi_turn_base_113#t0")  # "... include Quasar Ltd.'s stock ..."
    explored = substituted(parent)
    assert explored.rounds and all(r.request is None for r in explored.rounds)
    brain = WordsBrain("Quasar Ltd.")
    result, _ = await abstracted(tmp_path, brain, explored)
    assert brain.offered and all("Quasar Ltd." in offered for offered in brain.offered)
    assert result.candidates
    for candidate in result.candidates:
        [added] = [c for c in candidate.task.ground_truth[0] if c.name == "add_to_watchlist"]
        new = added.arguments["stock"]
        assert new != "QUAS"
        assert candidate.task.user_turns[0] == parent.user_turns[0].replace("Quasar Ltd.", new)


async def test_no_words_naming_the_value_gives_no_candidate(tmp_path: Path) -> None:
    explored = substituted(turn("multi_turn_base_113#t0"))
    result, _ = await abstracted(tmp_path, WordsBrain(NO_WORDS), explored)
    assert result.candidates == []
    assert {reason for reason, _ in result.dropped} == {"malformed_request"}


def test_names_are_offered_outside_quotes_and_without_a_sentences_first_word() -> None:
    request = (
        "Lastly, would it be possible to notify my financial adviser Michael about this "
        "trade? Please send a message to her saying '100 shares of GOOG purchased'."
    )
    assert naming_spans(request) == ["Michael"]
    assert naming_spans("Buy 50 shares of 'Apple' now.") == ["Apple"]  # a quoted name
    assert naming_spans("Integrate Zeta Corp’s stock") == ["Zeta Corp", "Integrate Zeta Corp"]
    assert edited_request("Add Zeta Corp’s stock, Zeta Corp!", "Zeta Corp", "ALPH") == (
        "Add ALPH’s stock, ALPH!"
    )


def test_words_written_inside_the_calls_are_not_offered() -> None:
    parent = turn("multi_turn_base_95#t3")  # "... from Rivermist to San Francisco to ... Emma"
    offered = naming_spans(parent.user_turns[0], parent.ground_truth[0])
    assert "Emma" in offered
    assert "Rivermist" not in offered and "San Francisco" not in offered
