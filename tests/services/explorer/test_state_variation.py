"""Variant turns on other initial states, on real BFCL train turns and their real classes."""

from __future__ import annotations

import json
import random
from functools import cache

import pytest

from coevolve.services.abstractor.call_units import call_units
from coevolve.services.abstractor.prompts import RequestDraft, unit_task
from coevolve.services.explorer.composition import returned_values_stated
from coevolve.services.explorer.state_values import (
    IdKnob,
    NumberKnob,
    Variation,
    bounds_of,
    drawn,
    drawn_ids,
    drawn_number,
    renamed_text,
    with_number,
)
from coevolve.services.explorer.state_variation import (
    FAILED,
    REPEATED,
    StateVariant,
    parent_of,
    state_variants,
    state_variation_rounds,
    variant_of,
)
from coevolve.services.judge.replay import replay_candidate
from coevolve.shared.envs import Environment, make_environment, state_of
from coevolve.shared.envs.bfcl.tasks import FOCUS_CLASSES, suite_tasks
from coevolve.shared.messages import Exploration, Task

# train turns of the focused world: an order at the market price (a lookup, then an
# order), a message quoting a price to ids the request states, a login and a message
TURNS = (
    "multi_turn_base_118#t2",
    "multi_turn_base_101#t1",
    "multi_turn_base_51#t3",
    "multi_turn_base_143#t3",
)


@cache
def train_turns() -> dict[str, Task]:
    return {t.id: t for t in suite_tasks("bfcl-turns-base", "train", FOCUS_CLASSES)}


def turn(task_id: str) -> Task:
    return train_turns()[task_id]


def make_env() -> Environment:
    return make_environment("bfcl")


def variants_of(task: Task, limit: int = 2, seed: str = "") -> list[StateVariant]:
    return state_variants(task, make_env, limit, seed)


def start_state(task: Task) -> dict:
    environment = make_env()
    try:
        environment.reset(task)
        state = state_of(environment)
        assert state is not None
        return state
    finally:
        environment.close()


def as_task(variant: StateVariant) -> Task:
    """The variant as the abstractor makes its candidate: its calls as they are, its
    request made by code, from its start."""
    exploration = Exploration(
        id="exploration-1", mode="guided", task=variant.start, rounds=[variant.round]
    )
    [unit] = call_units(exploration, make_env, 4)
    assert unit.request == variant.round.request
    assert unit.calls == [step.action for step in variant.round.steps]
    draft = RequestDraft(description=unit.request, request=unit.request)
    return unit_task(draft, unit, exploration, 0)


@pytest.mark.parametrize("task_id", TURNS)
def test_variants_replay_on_another_state_with_the_parents_functions(task_id: str) -> None:
    parent = turn(task_id)
    variants = variants_of(parent)
    assert variants, task_id
    for variant in variants:
        calls = [step.action for step in variant.round.steps]
        assert [c.name for c in calls] == [c.name for c in parent.ground_truth[0]]
        assert all(step.ok for step in variant.round.steps)
        assert variant.start.id == parent.id and variant.start.ground_truth == []
        assert variant.round.varied_state and not variant.round.composed_from
        assert start_state(variant.start) != start_state(parent)
        # the judge's replay: every call runs and the task scores 1.0 against itself
        candidate = as_task(variant)
        assert candidate.initial_state == variant.start.initial_state
        check = replay_candidate(candidate, make_env)
        assert check.passed, check.problems()
        # the request states no value only a call of its turn returns
        observations = [step.observation for step in variant.round.steps]
        start_text = json.dumps(start_state(variant.start), default=str)
        request = variant.round.request
        assert request is not None
        assert returned_values_stated(request, calls, observations, start_text) == []


def test_a_value_an_earlier_call_returned_is_read_from_the_varied_state() -> None:
    parent = turn("multi_turn_base_118#t2")  # 100 shares of AAPL at the current market price
    variants = variants_of(parent, 4)
    assert any(v.round.steps[1].action.arguments["price"] != 227.16 for v in variants)
    for variant in variants:
        lookup, order = variant.round.steps
        assert order.action.arguments["price"] == json.loads(lookup.observation)["price"]
        assert variant.round.request == parent.user_turns[0]  # it states no changed value


def test_identifiers_are_renamed_everywhere_and_in_the_request() -> None:
    parent = turn("multi_turn_base_51#t3")  # "... (user id USR002) ... my user id is USR001."
    for variant in variants_of(parent, 3):
        renames = dict(variant.variation.renames)
        assert {"USR001", "USR002"} <= set(renames)
        login, message = (step.action for step in variant.round.steps)
        assert login.arguments["user_id"] == renames["USR001"]
        assert message.arguments["receiver_id"] == renames["USR002"]
        request = variant.round.request or ""
        assert renames["USR001"] in request and renames["USR002"] in request
        assert "USR001" not in request and "USR002" not in request
        state_text = json.dumps(variant.start.initial_state)
        assert not any(f'"{old}"' in state_text for old in renames)
        # renamed together, the ids keep their shape and their order
        news = [renames[old] for old in sorted(renames)]
        assert news == sorted(news) and all(n[:3] == "USR" and len(n) == 6 for n in news)


def test_a_number_the_request_states_follows_in_the_request_and_the_message() -> None:
    parent = turn("multi_turn_base_101#t1")  # "... 'The latest stock price of XTC is $150.75.'"
    variants = variants_of(parent, 4)
    assert variants
    for variant in variants:
        price = variant.start.initial_state["TradingBot"]["stocks"]["XTC"]["price"]
        message = variant.round.steps[0].action.arguments["message"]
        assert message == f"The latest stock price of XTC is ${price}."
        assert (variant.round.request or "").count(f"${price}.") == 1
        if price != 150.75:
            assert "150.75" not in (variant.round.request or "") + message


def test_a_variant_whose_replay_fails_is_dropped() -> None:
    parent = turn("multi_turn_base_120#t0")  # buys 100 AAPL at the market price
    replayed = parent_of(parent, make_env)
    assert replayed is not None
    dear = Variation(numbers=((("TradingBot", "stocks", "AAPL", "price"), 227.16, 900.0),))
    assert variant_of(replayed, dear) == (None, FAILED)  # insufficient funds
    for variant in variants_of(parent, 4):
        assert variant.start.initial_state["TradingBot"]["stocks"]["AAPL"]["price"] <= 250


def test_what_decides_a_worked_out_or_conditional_turn_is_kept() -> None:
    # "fill the fuel tank to completely full": 45 gallons were worked out from the level
    full = turn("multi_turn_base_71#t2")
    # "if it is reachable, set navigation ...": the fuel level decides the answer
    conditional = turn("multi_turn_base_66#t0")
    for parent in (full, conditional):
        level = parent.initial_state["VehicleControlAPI"]["fuelLevel"]
        for variant in variants_of(parent, 4):
            assert variant.start.initial_state["VehicleControlAPI"]["fuelLevel"] == level


def test_a_choice_by_a_quantity_keeps_the_quantities_it_chose_by() -> None:
    parent = turn("multi_turn_base_143#t1")  # the order "with a substantial order value"
    replayed = parent_of(parent, make_env)
    assert replayed is not None and ("TradingBot", "orders") in replayed.fixed
    variants = variants_of(parent, 4)
    assert variants
    for variant in variants:
        assert all(path[:2] != ("TradingBot", "orders") for path, _, _ in variant.variation.numbers)


def test_a_turn_whose_calls_read_nothing_that_varies_gives_no_variant() -> None:
    assert variants_of(turn("multi_turn_base_51#t0")) == []  # lock every door


@pytest.mark.parametrize(
    "task_id", ["multi_turn_base_107#t4", "multi_turn_base_101#t2", "multi_turn_base_72#t2"]
)
def test_a_variant_asking_the_parents_turn_again_for_its_calls_is_dropped(task_id: str) -> None:
    # an argument-free lookup (the account, the messages sent, the tires) on another state: the
    # policy would see the parent's requests and be asked for the parent's calls
    parent = parent_of(turn(task_id), make_env)
    assert parent is not None
    rng = random.Random(0)
    variations = [drawn([knob], rng, parent.taken) for knob in parent.knobs()]
    reasons = {variant_of(parent, v)[1] for v in variations if v is not None}
    assert REPEATED in reasons
    assert variants_of(turn(task_id), 3) == []


def test_variants_are_deterministic_for_a_seed() -> None:
    parent = turn("multi_turn_base_118#t2")

    def made(seed: str) -> list[tuple[dict, list]]:
        return [(v.start.initial_state, v.round.steps) for v in variants_of(parent, 2, seed)]

    assert made("signal-1") == made("signal-1")
    assert made("signal-1") != made("signal-2")


def test_rounds_come_as_composition_gives_them() -> None:
    parent = turn("multi_turn_base_118#t2")
    pairs = state_variation_rounds(parent, make_env, 2, seed="signal-1")
    assert pairs and all(len(rounds) == 1 for _, rounds in pairs)
    variants = variants_of(parent, 2, "signal-1")
    assert [(v.start, [v.round]) for v in variants] == pairs
    assert state_variation_rounds(parent, make_env, 0) == []


def test_numbers_and_identifiers_are_drawn_alike() -> None:
    rng = random.Random(0)
    voltage = NumberKnob(("VehicleControlAPI", "batteryVoltage"), 12.6)
    assert bounds_of(voltage.path) == (10.0, 14.0)
    for _ in range(20):
        new = drawn_number(voltage, rng)
        assert new is None or (isinstance(new, float) and 10.0 <= new <= 14.0)
    count = drawn_number(NumberKnob(("TradingBot", "orders", "1", "amount"), 50), rng)
    assert count is None or isinstance(count, int)
    orders = drawn_ids(IdKnob(("12345", "12446")).ids, rng, set())
    assert orders is not None and all(len(o) == 5 and o.isdigit() for o in orders)
    assert int(orders[1]) - int(orders[0]) == 101
    code = drawn_ids(["BD732D1888B94DAA"], rng, set())
    assert code is not None and len(code[0]) == 16 and code[0] != "BD732D1888B94DAA"


def test_values_are_rewritten_as_whole_tokens_as_they_were_written() -> None:
    assert with_number("an extra $10,000 and 10000.", 10000.0, 12500.0) == (
        "an extra $12,500 and 12500."
    )
    assert with_number("at $150.75 or 150.755", 150.75, 197.27) == "at $197.27 or 150.755"
    assert with_number("$150.75 and 1,150 and 150.", 150.0, 112.0) == "$150.75 and 1,150 and 112."
    renames = {"USR001": "USR002", "USR002": "USR003"}
    assert renamed_text("USR001 to USR002, not USR0012", renames) == (
        "USR002 to USR003, not USR0012"
    )
