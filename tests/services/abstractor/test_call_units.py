"""Which calls a candidate asks for, chosen by code from an exploration log, on the real
BFCL file system (multi_turn_base_2: one folder, ``documents``)."""

from __future__ import annotations

from coevolve.services.abstractor.call_units import call_units, without_repeats
from coevolve.shared.envs import Environment, make_environment
from coevolve.shared.messages import Exploration, ToolCall
from tests.dataloop.dataloop_harness import logged_exploration

LS = ToolCall(name="ls", arguments={})
PWD = ToolCall(name="pwd", arguments={})
MAKE = ToolCall(name="mkdir", arguments={"dir_name": "drafts"})
CD = ToolCall(name="cd", arguments={"folder": "documents"})
TOUCH = ToolCall(name="touch", arguments={"file_name": "plan.txt"})
MISSING = ToolCall(name="cd", arguments={"folder": "no_such_folder"})


def bfcl() -> Environment:
    return make_environment("bfcl")


def exploration(*rounds: list[tuple[ToolCall, bool]]) -> Exploration:
    return logged_exploration(rounds)


def test_the_unit_is_the_state_change_without_the_lookups_and_failures() -> None:
    log = exploration([(LS, True), (MAKE, True), (MISSING, False), (LS, True), (PWD, True)])
    [unit] = call_units(log, bfcl, max_units=2)
    assert unit.calls == [MAKE] and unit.changes_state
    assert len(unit.observations) == 1


def test_a_call_a_later_call_depends_on_stays() -> None:
    # without cd, touch makes plan.txt in another folder: a different final state
    [unit] = call_units(exploration([(CD, True), (LS, True), (TOUCH, True)]), bfcl, max_units=2)
    assert unit.calls == [CD, TOUCH]


def test_a_round_that_changes_nothing_is_a_question_of_its_last_answered_call() -> None:
    [unit] = call_units(exploration([(LS, True), (PWD, True)]), bfcl, max_units=2)
    assert unit.calls == [PWD] and not unit.changes_state
    assert "current_working_directory" in unit.observations[0]


def test_rounds_give_one_unit_each_without_repeats_up_to_the_limit() -> None:
    same = [(MAKE, True)]
    log = exploration(same, same, [(CD, True), (TOUCH, True)], [(PWD, True)])
    units = call_units(log, bfcl, max_units=2)
    assert [u.calls for u in units] == [[MAKE], [CD, TOUCH]]
    assert call_units(exploration([(MISSING, False)]), bfcl, max_units=2) == []


def test_a_call_right_after_an_identical_one_is_dropped_even_when_it_changes_state() -> None:
    buy = ToolCall(name="place_order", arguments={"symbol": "AAPL", "amount": 10})
    sell = ToolCall(name="place_order", arguments={"symbol": "AAPL", "amount": -10})
    assert without_repeats([buy, buy, sell, buy]) == [buy, sell, buy]
    assert without_repeats([]) == []
