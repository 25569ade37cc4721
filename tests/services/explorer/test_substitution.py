"""Variant turns by substitution, on real BFCL turns and their real environment."""

from __future__ import annotations

import json

from coevolve.services.explorer.substitution import (
    conditional,
    given_arguments,
    other_numbers,
    stated_values,
    substituted_request,
    substitution_rounds,
    unexplained_numbers,
)
from coevolve.shared.envs import make_environment
from coevolve.shared.envs.bfcl.tasks import load_turn_tasks
from coevolve.shared.messages import Task, ToolCall
from coevolve.shared.value_roles import shape


def turn(task_id: str) -> Task:
    return next(task for task in load_turn_tasks() if task.id == task_id)


def rounds_of(task: Task, limit: int = 3) -> list:
    return substitution_rounds(task, lambda: make_environment(task.environment), limit)


def test_a_stated_value_is_swapped_in_the_calls_and_the_request_alike() -> None:
    parent = turn("multi_turn_base_72#t3")  # "... my user id is 'USR005'."
    rounds = rounds_of(parent)
    assert rounds
    for round_ in rounds:
        calls = [step.action for step in round_.steps]
        assert [c.name for c in calls] == [c.name for c in parent.ground_truth[0]]
        assert calls != parent.ground_truth[0]
        old, new = round_.replaced
        if round_.request is not None:
            assert round_.request == parent.user_turns[0].replace(str(old), str(new))
            assert str(new) in round_.request and str(old) not in round_.request
        assert all(step.ok for step in round_.steps)


def test_a_value_a_later_call_takes_from_an_earlier_result_is_read_again() -> None:
    # "... ordering 100 shares of AAPL at the current market price?": the order's price
    # is what get_stock_info returned
    parent = turn("multi_turn_base_118#t2")
    assert [c.name for c in parent.ground_truth[0]] == ["get_stock_info", "place_order"]
    rounds = rounds_of(parent)
    assert any(r.replaced and r.replaced[0] == "AAPL" for r in rounds)
    for round_ in rounds:
        info, order = (step.action for step in round_.steps)
        looked_up = json.loads(round_.steps[0].observation)
        assert order.arguments["symbol"] == info.arguments["symbol"]
        assert order.arguments["price"] == looked_up["price"]


def test_a_conditional_request_gives_no_substitution() -> None:
    request = (
        "Based on the insights gathered, if 'AMZN' appears promising, coordinate its "
        "addition to my watchlist. By promising I mean the price is larger than 300."
    )
    assert conditional(request)
    assert not conditional("If that helps, my user id is 'USR005'.")
    parent = turn("multi_turn_base_115#t1")
    assert parent.user_turns[0] == request
    assert rounds_of(parent) == []


def test_values_are_found_as_whole_tokens_and_replaced_so() -> None:
    calls = [ToolCall(name="message_login", arguments={"user_id": "USR005"})]
    assert stated_values("my id is 'USR005'.", calls) == ["USR005"]
    assert stated_values("my id is USR0051", calls) == []
    assert substituted_request("'USR005' and USR005.", "USR005", "USR006") == "'USR006' and USR006."


def test_a_new_value_keeps_the_old_ones_shape_and_numbers_vary_nearby() -> None:
    assert shape("USR005") == shape("USR008") != shape("37e232f7-dcb5-48a2-ba6e-9a12f245ced4")
    assert shape("NVDA") == shape("AAPL")
    assert other_numbers(100) == [80, 120, 50, 150, 200]
    assert all(isinstance(n, float) for n in other_numbers(39.5))


def test_a_value_an_earlier_call_returned_is_not_a_given_one() -> None:
    calls = [
        ToolCall(name="get_zipcode_based_on_city", arguments={"city": "Rivermist"}),
        ToolCall(name="estimate_distance", arguments={"cityA": "83214", "cityB": "74532"}),
    ]
    observations = ['{"zipcode": "83214"}', '{"distance": 750.0}']
    given = [value for _, _, value in given_arguments(calls, observations)]
    assert given == ["Rivermist", "74532"]


def test_no_variant_logs_in_as_the_user_it_writes_to() -> None:
    parent = turn("multi_turn_base_72#t3")  # logs in as USR005, writes to USR007
    for round_ in rounds_of(parent, 12):
        login, message = (step.action for step in round_.steps)
        assert login.arguments["user_id"] != message.arguments["receiver_id"]


def test_a_city_the_environment_knows_only_from_its_labels_varies_only_with_labels() -> None:
    parent = turn("multi_turn_base_71#t0")  # "... the distance between Rivermist and Stonebrook."
    make = lambda: make_environment(parent.environment)  # noqa: E731
    rounds = substitution_rounds(parent, make, 4)
    assert rounds and all(r.replaced[0] in ("Rivermist", "Stonebrook") for r in rounds)
    for round_ in rounds:
        distance = round_.steps[2].action
        zipcodes = [json.loads(step.observation)["zipcode"] for step in round_.steps[:2]]
        # the distance is asked between the variant's own zip codes
        assert [distance.arguments["cityA"], distance.arguments["cityB"]] == zipcodes
        assert zipcodes != ["83214", "74532"]
    assert substitution_rounds(parent, make, 4, known_values=False) == []


def test_a_value_tangled_with_the_rest_of_the_turn_is_not_swapped() -> None:
    # the city is also written inside the message the turn sends
    parent = turn("multi_turn_base_62#t0")
    assert all(r.replaced[0] not in ("Rivermist", "Stonebrook") for r in rounds_of(parent, 12))
    # 30 liters are 7.93 gallons rounded by hand: another amount cannot be worked out
    parent = turn("multi_turn_base_83#t0")
    request, calls = parent.user_turns[0], parent.ground_truth[0]
    assert (1, 7.93) in unexplained_numbers(request, calls, ['{"gallon": 7.925}', "{}"])
    assert all(r.replaced[0] != 30 for r in rounds_of(parent, 12))
    # an address the request names a part of elsewhere ("this spot in Berkeley")
    parent = turn("multi_turn_base_66#t3")
    assert rounds_of(parent, 12) == []
