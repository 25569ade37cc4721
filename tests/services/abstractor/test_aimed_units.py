"""Call units aimed at the failure, on the real BFCL file system (multi_turn_base_2).

An exploration that says what the policy got wrong in the parent turn (``failed_calls``)
gives only units that call one of those functions, and keeps the call of that function
even where leaving it out would change no state.
"""

from __future__ import annotations

import msgspec

from coevolve.services.abstractor.call_units import call_units, feeds_later_call
from coevolve.services.abstractor.completion import unstated_values
from coevolve.services.abstractor.prompts import RequestDraft, request_problems
from coevolve.shared.envs import Environment, make_environment
from coevolve.shared.messages import Exploration, FailedCall, ToolCall
from tests.dataloop.dataloop_harness import logged_exploration

LS = ToolCall(name="ls", arguments={})
PWD = ToolCall(name="pwd", arguments={})
MAKE = ToolCall(name="mkdir", arguments={"dir_name": "drafts"})
CD = ToolCall(name="cd", arguments={"folder": "documents"})
TOUCH = ToolCall(name="touch", arguments={"file_name": "plan.txt"})


def bfcl() -> Environment:
    return make_environment("bfcl")


def aimed(targets: list[ToolCall], *rounds: list[tuple[ToolCall, bool]]) -> Exploration:
    log = logged_exploration(rounds)
    failed = [FailedCall(expected=call, problem="missed") for call in targets]
    return msgspec.structs.replace(log, failed_calls=failed)


def test_a_round_without_a_target_call_gives_no_unit() -> None:
    log = aimed([LS], [(MAKE, True)], [(CD, True), (TOUCH, True)])
    assert call_units(log, bfcl, max_units=2) == []
    # the same rounds without a target: units as before
    assert [u.calls for u in call_units(aimed([], [(MAKE, True)]), bfcl, 2)] == [[MAKE]]


def test_the_target_call_stays_beside_the_state_change() -> None:
    # ls changes nothing, so without a target it is left out (test_call_units.py)
    [unit] = call_units(aimed([LS], [(LS, True), (MAKE, True)]), bfcl, max_units=2)
    assert unit.calls == [LS, MAKE] and unit.changes_state


def test_a_round_that_only_asks_is_a_question_of_its_target_call() -> None:
    [unit] = call_units(aimed([LS], [(LS, True), (PWD, True)]), bfcl, max_units=2)
    assert unit.calls == [LS] and not unit.changes_state


def test_a_lookup_whose_result_a_later_call_passes_feeds_it() -> None:
    lookup = ToolCall(name="get_zipcode_based_on_city", arguments={"city": "Rivermist"})
    distance = ToolCall(name="estimate_distance", arguments={"cityA": "83214", "cityB": "74532"})
    observations = ['{"zipcode": "83214"}', '{"distance": 750.0}']
    assert feeds_later_call(0, [lookup, distance], observations)
    assert not feeds_later_call(0, [lookup, distance], ['{"zipcode": "00000"}', ""])


def test_values_a_request_leaves_unsaid_are_named() -> None:
    send = ToolCall(
        name="send_message", arguments={"receiver_id": "USR005", "message": "See you at noon"}
    )
    assert unstated_values("Tell my colleague I'll see them at noon.", [send], [""]) == [
        ("receiver_id", "USR005"),
        ("message", "See you at noon"),
    ]
    said = "Send 'See you at noon' to USR005."
    assert unstated_values(said, [send], [""]) == []
    # a value the conversation already gave needs no repeating
    assert (
        unstated_values("Send it to them: See you at noon.", [send], [""], "my friend USR005") == []
    )


def test_a_template_request_is_asked_for_again() -> None:
    known = {"delete_message", "message_login", "send_message"}
    for template in (
        "delete message: Delete the latest message sent to a receiver",
        "Remove my last message. Details: receiver id 'USR005'.",
    ):
        problems = request_problems(RequestDraft("d", template), known, ["delete_message"])
        assert any(p.startswith("a template, not what a user says") for p in problems)
    spoken = RequestDraft("d", "Please delete the last message I sent to USR005.")
    assert request_problems(spoken, known, ["delete_message"]) == []
