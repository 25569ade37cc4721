"""Composed turns on the real BFCL classes: joined turns replay, chains keep the failed
function, and no joined request states a value only an earlier call returned."""

from __future__ import annotations

from pathlib import Path

import msgspec

from coevolve.services.abstractor.call_units import call_units
from coevolve.services.explorer.composition import (
    Atom,
    atom_of,
    compose,
    composed_rounds,
    joined_request,
    orders,
    previous_turn,
    returned_values_stated,
)
from coevolve.services.explorer.handler import exploration_message
from coevolve.shared.envs import Environment, make_environment
from coevolve.shared.envs.bfcl.tasks import (
    FOCUS_CLASSES,
    config_without_conversation,
    seed_pool,
)
from coevolve.shared.messages import Task, ToolCall
from coevolve.shared.task_sets import load_d0

D0_FILE = Path(__file__).parents[3] / "docs" / "results" / "d0-20261129.json"


def _bfcl() -> Environment:
    return make_environment("bfcl")


def _turn(task_id: str) -> Task:
    (task,) = [t for t in seed_pool(classes=FOCUS_CLASSES) if t.id == task_id]
    return task


def test_the_turn_before_and_the_failed_turn_join_into_a_chain_that_replays() -> None:
    parent = _turn("multi_turn_base_67#t1")  # distance between two cities, by zip code
    earlier = previous_turn(parent)
    assert earlier is not None
    start, first = earlier
    assert first.task_id == "multi_turn_base_67#t0"
    assert start.env_config["turn"] == 0 and start.env_config["prior_turns"] == []
    failed = atom_of(parent)
    assert failed is not None
    composed = compose(start, [first, failed], _bfcl)
    assert composed is not None and composed.chain
    calls = [step.action for step in composed.round.steps]
    assert calls == [*first.calls, *failed.calls]
    assert composed.round.request == joined_request([first, failed])
    assert joined_request(
        [Atom("a", "Use 2 decimal digits", ()), Atom("b", "Estimate the distance.", ())]
    ) == ("Use 2 decimal digits. Estimate the distance.")
    assert composed.round.composed_from == [first.task_id, parent.id]
    # the abstractor keeps the composed round as it is, and it replays from the start
    exploration = exploration_message(
        "exploration-1", "guided", start, [composed.round], context=None, signal=None
    )
    (unit,) = call_units(exploration, _bfcl, max_units=4)
    assert unit.calls == calls and unit.request == composed.round.request
    assert unit.composed_from == (first.task_id, parent.id)
    # every zip code and distance the calls pass came from an earlier call, unsaid
    start_env = _bfcl()
    start_env.reset(start)
    observations = [start_env.execute(call)[1] for call in calls]
    start_env.close()
    assert returned_values_stated(composed.round.request, calls, observations, "{}") == []


def test_a_request_that_states_what_only_a_call_returned_is_not_composed() -> None:
    parent = _turn("multi_turn_base_67#t1")
    earlier = previous_turn(parent)
    assert earlier is not None
    start, first = earlier
    failed = atom_of(parent)
    assert failed is not None
    composed = compose(start, [first, failed], _bfcl)
    assert composed is not None
    distance_call = next(
        step.action for step in composed.round.steps if step.action.name == "estimate_distance"
    )
    zip_code = distance_call.arguments["cityA"]
    # a user who names the zip code the lookup is about to return
    knowing = Atom(
        failed.task_id,
        f"How far is it from {zip_code} to the other city?",
        (distance_call,),
    )
    lookup = Atom(first.task_id, first.request, (composed.round.steps[0].action,))
    assert compose(start, [lookup, knowing], _bfcl) is None


def test_a_call_that_fails_from_the_start_is_not_composed() -> None:
    parent = _turn("multi_turn_base_67#t1")
    failed = atom_of(parent)
    assert failed is not None
    broken = Atom("x", "Sell my shares.", (ToolCall(name="no_such_function", arguments={}),))
    assert compose(parent, [failed, broken], _bfcl) is None


def test_discovered_lookups_become_first_links_with_no_labels() -> None:
    d0 = load_d0(D0_FILE).tasks
    (add,) = [
        t
        for t in d0
        if t.ground_truth[0][0].name == "add_to_watchlist"
        and "NVDA" in t.user_turns[0]
        and "ZETA" not in t.user_turns[0]
    ]
    failed = atom_of(add)
    assert failed is not None
    others = [
        atom
        for task in d0
        if task.id != add.id
        and config_without_conversation(task.env_config)
        == config_without_conversation(add.env_config)
        if (atom := atom_of(task)) is not None
    ]
    rounds = composed_rounds(add, orders([failed], others), _bfcl, limit=2)
    assert rounds
    for joined in rounds:
        names = [step.action.name for step in joined.steps]
        assert "add_to_watchlist" in names and len(names) >= 2
        assert joined.composed_from is not None and add.id in joined.composed_from
    # the same function on both sides is no composition
    twice = msgspec.structs.replace(add, id="again")
    again = atom_of(twice)
    assert again is not None
    assert list(orders([failed], [again])) == []
