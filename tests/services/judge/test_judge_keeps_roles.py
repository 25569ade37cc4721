"""A substitution child keeps its values' roles: the new value takes the old value's place
in the request, not another party's (``shared/value_roles.py``); the judge's
``keeps_roles``, the abstractor's edit and the judge benchmark's ``role_swap`` negatives,
on a real BFCL message turn in a real environment."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import msgspec
import pytest

from coevolve.bench.judge import (
    deterministic_pass,
    deterministic_stages,
    labelled_set,
    role_swap,
    value_pool,
)
from coevolve.services.abstractor.call_units import CallUnit
from coevolve.services.abstractor.edits import edit_unit_problems, edited_request
from coevolve.services.explorer.substitution import substitution_rounds
from coevolve.services.judge.checks import check_keeps_roles, semantic_checks
from coevolve.shared.envs import make_environment
from coevolve.shared.envs.bfcl.tasks import load_tasks, load_turn_tasks
from coevolve.shared.messages import Exploration, FailedCall, Task, ToolCall
from coevolve.shared.value_roles import role_problems, shape, written_values
from tests.services.abstractor.abstraction_harness import abstracted
from tests.support.fake_llm import Answer

# multi_turn_base_111#t2 (MessageAPI, TradingBot): "... I (user id USR001) need to quickly
# communicate with Jane, one of my business partners, ... Send the message '...'?"
# -> send_message(receiver_id='USR002', message=...)
JANE = "multi_turn_base_111#t2"


def turn(task_id: str) -> Task:
    return next(task for task in load_turn_tasks() if task.id == task_id)


def bfcl() -> Any:
    return make_environment("bfcl")


def child(parent: Task, request: str, old: Any, new: Any) -> Task:
    """``parent`` with ``old`` swapped for ``new`` in its calls, asked by ``request``, its
    lineage as the abstractor writes it for a substitution."""
    calls = [
        ToolCall(
            name=call.name,
            arguments={k: new if v == old else v for k, v in call.arguments.items()},
        )
        for call in parent.ground_truth[0]
    ]
    lineage = msgspec.structs.replace(
        parent.lineage, depth=1, parent_request=parent.user_turns[0], replaced=[old, new]
    )
    return msgspec.structs.replace(
        parent,
        id=f"{parent.id}~child",
        origin="synthesized",
        user_turns=[request],
        ground_truth=[calls],
        lineage=lineage,
    )


def test_the_parent_turn_is_what_the_run_swapped() -> None:
    parent = turn(JANE)
    request = parent.user_turns[0]
    assert "I (user id USR001)" in request and "Jane" in request and "USR002" not in request
    assert [c.arguments["receiver_id"] for c in parent.ground_truth[0]] == ["USR002"]
    assert "USR001" in written_values(request) and "Jane" not in written_values(request)
    assert shape("USR001") == shape("USR004") != shape("Jane")


def test_the_new_value_in_the_senders_place_is_refused() -> None:
    """The run's task: USR002 -> USR004 in the call, but the request's USR001 (the
    sender) became USR004."""
    parent = turn(JANE)
    swapped = child(parent, parent.user_turns[0].replace("USR001", "USR004"), "USR002", "USR004")
    result = check_keeps_roles(swapped)
    assert not result.passed
    assert result.reasons[0] == (
        "the request writes USR004 where its parent wrote USR001, but the swap replaced "
        "USR002: the new value names another party"
    )
    failed = {r.name for r in semantic_checks(swapped, bfcl, backend="ngram") if not r.passed}
    assert "keeps_roles" in failed


def test_a_name_replaced_by_the_new_id_keeps_the_roles() -> None:
    parent = turn(JANE)
    sound = child(parent, parent.user_turns[0].replace("Jane", "USR004"), "USR002", "USR004")
    result = check_keeps_roles(sound)
    assert result.passed and result.details == {"substitution": True}
    results = semantic_checks(sound, bfcl, backend="ngram")
    assert next(r for r in results if r.name == "keeps_roles").passed


def test_a_stated_value_swapped_where_it_is_written_keeps_the_roles() -> None:
    parent = turn(JANE)
    message = parent.ground_truth[0][0].arguments["message"]
    stated = msgspec.structs.replace(
        parent, user_turns=[f"I am USR001. Send '{message}' to USR002."]
    )
    sound = child(stated, f"I am USR001. Send '{message}' to USR004.", "USR002", "USR004")
    assert check_keeps_roles(sound).passed
    # the swap made in the calls only: the request still asks for USR002
    unswapped = child(stated, stated.user_turns[0], "USR002", "USR004")
    result = check_keeps_roles(unswapped)
    assert not result.passed
    assert result.reasons == [
        "the request still writes USR002, which its calls no longer pass (they pass "
        "USR004): the swap was made in the calls only"
    ]


def test_a_task_that_is_no_substitution_child_passes() -> None:
    parent = turn(JANE)
    result = check_keeps_roles(parent)
    assert result.passed and result.details == {"substitution": False}
    # the same request under a lineage without the parent's request is not checked
    swapped = child(parent, parent.user_turns[0].replace("USR001", "USR004"), "USR002", "USR004")
    lineage = msgspec.structs.replace(swapped.lineage, parent_request=None)
    assert check_keeps_roles(msgspec.structs.replace(swapped, lineage=lineage)).passed


def test_values_written_alike_but_kept_are_no_role_swap() -> None:
    calls = [ToolCall(name="send_message", arguments={"receiver_id": "USR004"})]
    parent = "As USR001, message USR002 about 150 shares of NVDA."
    swapped = parent.replace("USR001", "USR004")
    assert role_problems(parent, swapped, "USR002", "USR004", calls)
    # the sender, the amount and the symbol stay; only the receiver changed
    sound = parent.replace("USR002", "USR004")
    assert not role_problems(parent, sound, "USR002", "USR004", calls)


def edit_unit(parent: Task, new: str) -> CallUnit:
    calls = [
        ToolCall(name=c.name, arguments={**c.arguments, "receiver_id": new})
        for c in parent.ground_truth[0]
    ]
    return CallUnit(calls, ["{}"], True, replaced=["USR002", new])


def test_the_abstractor_refuses_an_edit_that_swaps_roles() -> None:
    parent = turn(JANE)
    request = parent.user_turns[0]
    unit = edit_unit(parent, "USR004")
    swapped = edited_request(request, "USR001", "USR004")
    problems = edit_unit_problems(unit, swapped, "USR001", request)
    assert problems and "USR001" in problems[0] and "another party" in problems[0]
    assert edit_unit_problems(unit, swapped, "USR001") == []  # without the parent: as before
    sound = edited_request(request, "Jane", "USR004")
    assert edit_unit_problems(unit, sound, "Jane", request) == []


class FirstTheSender:
    """Names the sender's id first (what the run's abstractor chose), then "Jane"."""

    def __init__(self) -> None:
        self.answers: list[str] = []

    def __call__(self, role: str, request: dict[str, Any]) -> Answer:
        offered = request["response_format"]["json_schema"]["schema"]["properties"]["words"]
        words = "USR001" if "USR001" in offered["enum"] else "Jane"
        self.answers.append(words)
        return Answer(json.dumps({"words": words}))


@pytest.mark.anyio
async def test_the_abstractor_asks_again_after_a_role_swapping_edit(tmp_path: Path) -> None:
    parent = turn(JANE)
    made = substitution_rounds(parent, lambda: make_environment(parent.environment), 5)
    rounds = [r for r in made if r.replaced and r.replaced[0] == "USR002"][:1]
    assert rounds and rounds[0].request is None and rounds[0].replaced
    old, new = rounds[0].replaced
    failed = [FailedCall(expected=call, problem="missed") for call in parent.ground_truth[0]]
    explored = Exploration(
        id=f"exploration-{parent.id}",
        mode="guided",
        task=parent,
        rounds=rounds,
        failed_calls=failed,
    )
    brain = FirstTheSender()
    result, _ = await abstracted(tmp_path, brain, explored)
    assert brain.answers[:2] == ["USR001", "Jane"]
    [candidate] = result.candidates
    task = candidate.task
    assert task.user_turns[0] == parent.user_turns[0].replace("Jane", str(new))
    assert "USR001" in task.user_turns[0]
    assert task.lineage.parent_request == parent.user_turns[0]
    assert task.lineage.replaced == [old, new]
    assert check_keeps_roles(task).passed


def test_the_benchs_role_swap_negative_is_refused() -> None:
    parent = msgspec.structs.replace(
        turn(JANE), user_turns=["I am USR001. Please send 'Hello there' to USR002."]
    )
    parent = msgspec.structs.replace(
        parent,
        ground_truth=[
            [
                ToolCall(
                    name="send_message",
                    arguments={"receiver_id": "USR002", "message": "Hello there"},
                )
            ]
        ],
    )
    assert check_keeps_roles(parent).passed
    negative = role_swap(parent, value_pool(load_tasks("multi_turn_base")), random.Random(0))
    assert negative is not None and negative.kind == "role_swap"
    old, new = negative.task.lineage.replaced or []
    assert old == "USR002" and shape(new) == "A9" and new not in ("USR001", "USR002")
    assert negative.task.lineage.parent_request == parent.user_turns[0]
    assert negative.task.user_turns == [f"I am {new}. Please send 'Hello there' to USR002."]
    assert negative.task.ground_truth[0][0].arguments["receiver_id"] == new
    assert not check_keeps_roles(negative.task).passed
    outcome = deterministic_stages(negative, "ngram")
    assert outcome.passed["keeps_roles"] is False and not deterministic_pass(outcome)


def test_the_labelled_set_holds_role_swaps_that_keeps_roles_refuses() -> None:
    items, _ = labelled_set(8, seed=54)  # a sample with two turns that write two user ids
    swaps = [i for i in items if i.kind == "role_swap"]
    assert len(swaps) == 2
    positives = {i.task.id: i.task for i in items if i.positive}
    for item in swaps:
        assert not check_keeps_roles(item.task).passed, item.note
        assert check_keeps_roles(positives[item.source_id]).passed
        outcome = deterministic_stages(item, "ngram")
        assert outcome.passed["replay"] and outcome.passed["keeps_roles"] is False
