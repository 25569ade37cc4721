"""The abstractor repairs a draft against its exploration log."""

from __future__ import annotations

import json

import msgspec

from coevolve.services.abstractor.log_repairs import with_prerequisites, without_failed_calls
from coevolve.services.judge.replay import replay_candidate
from coevolve.shared.envs import Environment, make_environment
from coevolve.shared.envs.bfcl.tasks import suite_tasks
from coevolve.shared.messages import (
    Exploration,
    ExplorationRound,
    InteractionStep,
    Task,
    ToolCall,
)

# a per-turn task whose travel state is already logged in; logging in again makes a new token
BOOKING = "multi_turn_base_153#t3"
LOGIN = ToolCall(
    name="authenticate_travel",
    arguments={
        "client_id": "client_520",
        "client_secret": "rise_to_sky",
        "refresh_token": "token990125",
        "grant_type": "read_write",
        "user_first_name": "Michael",
        "user_last_name": "Thompson",
    },
)


def bfcl() -> Environment:
    return make_environment("bfcl")


def explored(task: Task) -> tuple[Exploration, ToolCall]:
    """A real exploration: log in, then book with the new token; and the booking call."""
    environment = make_environment("bfcl")
    environment.reset(task)
    ok, logged_in = environment.execute(LOGIN)
    assert ok
    booking = msgspec.structs.replace(
        task.ground_truth[0][0],
        arguments={
            **task.ground_truth[0][0].arguments,
            "access_token": json.loads(logged_in)["access_token"],
        },
    )
    ok, booked = environment.execute(booking)
    assert ok, booked
    environment.close()
    steps = [
        InteractionStep(history=[], action=LOGIN, observation=logged_in),
        InteractionStep(history=[], action=booking, observation=booked),
    ]
    exploration = Exploration(
        id="expl", mode="guided", task=task, rounds=[ExplorationRound(steps=steps)]
    )
    return exploration, booking


def test_the_login_that_made_the_token_is_put_back_before_the_booking() -> None:
    task = {t.id: t for t in suite_tasks("bfcl-turns-base", "train")}[BOOKING]
    exploration, booking = explored(task)
    draft = msgspec.structs.replace(task, ground_truth=[[booking]])

    # the new token is unknown from the start state
    assert not replay_candidate(draft, bfcl).criteria["replay_succeeded"]

    repaired, inserted = with_prerequisites(draft, exploration)
    assert inserted == 1
    assert repaired.ground_truth == [[LOGIN, booking]]
    assert replay_candidate(repaired, bfcl).criteria["replay_succeeded"]
    # a task that already logs in gets nothing twice
    assert with_prerequisites(repaired, exploration) == (repaired, 0)


def test_a_call_that_only_failed_in_the_log_is_dropped() -> None:
    task = {t.id: t for t in suite_tasks("bfcl-turns-base", "train")}[BOOKING]
    exploration, booking = explored(task)
    wrong = ToolCall(name="cancel_booking", arguments={"access_token": "x", "booking_id": "nope"})
    environment = bfcl()
    environment.reset(task)
    ok, refused = environment.execute(wrong)
    environment.close()
    assert not ok
    failing = InteractionStep(history=[], action=wrong, observation=refused, ok=False)
    exploration.rounds[0].steps.append(failing)

    draft = msgspec.structs.replace(task, ground_truth=[[booking, wrong], [wrong]])
    repaired, dropped = without_failed_calls(draft, exploration)
    # the second turn keeps its only call: a turn is never emptied
    assert (repaired.ground_truth, dropped) == ([[booking], [wrong]], 1)
    exploration.rounds[0].steps.append(InteractionStep(history=[], action=wrong, observation="{}"))
    assert without_failed_calls(draft, exploration) == (draft, 0)  # it also succeeded once
