"""Composed turns: validated turns that start on one state, joined into one longer turn.

A third of the held-out turns need two or more calls, while the variants of a failed turn
keep its calls, mostly one. Joining validated turns gives multi-call turns whose every
part a user asked (reverse task recombination, as APIGen-MT does; BUTTON composes atomic
tasks the same way). The failed turn (or a variant of it) is always one of the parts:

- the turn before it, then it: the failed turn's calls often take what the earlier
  turn's calls returned, so the join is a chain with the failed function in it;
- where no earlier turn is known (a run with no labels), another task of the pool that
  starts where the failed turn starts (D0's lookups become first links), before it or
  after it, a chain first where one exists.

The requests are joined as their users wrote them. Every call must run from the start,
and a request may not state a value that only an earlier call returned (a user does not
know the price a lookup will say). No LLM is asked: a composition costs a few
environment steps.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from coevolve.services.explorer.exploration import HISTORY_CHARS, clipped
from coevolve.services.explorer.substitution import contains_value, parsed_result
from coevolve.shared.argument_values import salient_values
from coevolve.shared.envs import Environment, state_of
from coevolve.shared.envs.bfcl.tasks import turn_task_id
from coevolve.shared.messages import ExplorationRound, InteractionStep, Task, ToolCall
from coevolve.shared.value_roles import mention


@dataclass(frozen=True)
class Atom:
    """One validated turn: its task, its request and its calls."""

    task_id: str
    request: str
    calls: tuple[ToolCall, ...]


def atom_of(task: Task) -> Atom | None:
    """The task as an atom: one user turn with calls, itself not composed."""
    if len(task.user_turns) != 1 or len(task.ground_truth) != 1 or not task.ground_truth[0]:
        return None
    if task.lineage.composed_from:
        return None
    return Atom(task.id, task.user_turns[0], tuple(task.ground_truth[0]))


def joined_request(atoms: Sequence[Atom]) -> str:
    """The atoms' requests in order, each closed as a sentence ("... the gallon amount"
    would run into the next request)."""
    return " ".join(_closed(atom.request.strip()) for atom in atoms)


def _closed(sentence: str) -> str:
    return sentence if sentence.endswith((".", "?", "!")) else f"{sentence}."


def returned_values_stated(
    request: str, calls: Sequence[ToolCall], observations: Sequence[str], start_text: str
) -> list[Any]:
    """Values a call passes that the request writes out although an earlier call returned
    them and the start state does not hold them: only that call could have told them."""
    parsed = [parsed_result(text) for text in observations]
    found: list[Any] = []
    for position, call in enumerate(calls):
        for _, _, value in salient_values([call]):
            if isinstance(value, bool) or not isinstance(value, str | int | float):
                continue
            if not mention(value).search(request) or str(value) in start_text:
                continue
            if any(contains_value(result, value) for result in parsed[:position]):
                found.append(value)
    return found


def is_chain(calls: Sequence[ToolCall], observations: Sequence[str], first_part: int) -> bool:
    """Whether a call after the first ``first_part`` calls passes a value that one of those
    returned."""
    parsed = [parsed_result(text) for text in observations[:first_part]]
    return any(
        any(contains_value(result, value) for result in parsed)
        for _, _, value in salient_values(list(calls[first_part:]))
        if not isinstance(value, bool) and isinstance(value, str | int | float)
    )


@dataclass(frozen=True)
class Composed:
    round: ExplorationRound
    chain: bool


def compose(
    start: Task, atoms: Sequence[Atom], make_env: Callable[[], Environment]
) -> Composed | None:
    """The atoms' calls in order from ``start``'s state as one turn, with their requests
    joined; None when a call fails or the joined request states a value only an earlier
    call returned. Blocking (run it in a worker thread)."""
    calls = [call for atom in atoms for call in atom.calls]
    request = joined_request(atoms)
    environment = make_env()
    try:
        history = clipped(
            [m for m in environment.reset(start) if m.role != "system"], HISTORY_CHARS
        )
        start_text = json.dumps(state_of(environment), default=str)
        observations: list[str] = []
        for call in calls:
            ok, text = environment.execute(call)
            if not ok:
                return None
            observations.append(text)
    finally:
        environment.close()
    if returned_values_stated(request, calls, observations, start_text):
        return None
    steps = [
        InteractionStep(history=list(history), action=call, observation=text)
        for call, text in zip(calls, observations, strict=True)
    ]
    joined = ExplorationRound(
        steps=steps, request=request, composed_from=[atom.task_id for atom in atoms]
    )
    return Composed(joined, is_chain(calls, observations, len(atoms[0].calls)))


def previous_turn(task: Task) -> tuple[Task, Atom] | None:
    """For a turn of a labelled multi-turn conversation: the state the turn before it
    started from (as a task with that turn's request and calls, under ``task``'s id: the
    composed task's parent is the failed turn) and that turn as an atom; None for a first
    turn, an unlabelled task, or an environment without earlier turns."""
    config = task.env_config
    prior_turns = list(config.get("prior_turns") or [])
    prior_truth = list(config.get("prior_ground_truth") or [])
    if config.get("grain") != "turn" or not prior_turns or len(prior_turns) != len(prior_truth):
        return None
    calls = msgspec.convert(prior_truth[-1], list[ToolCall])
    if not calls:
        return None
    earlier = {
        **config,
        "turn": int(config.get("turn", len(prior_turns))) - 1,
        "prior_turns": prior_turns[:-1],
        "prior_ground_truth": prior_truth[:-1],
    }
    start = msgspec.structs.replace(
        task, user_turns=[prior_turns[-1]], ground_truth=[calls], env_config=earlier
    )
    earlier_id = turn_task_id(task.source_entry or task.id, earlier["turn"])
    return start, Atom(earlier_id, prior_turns[-1], tuple(calls))


def functions_of(atom: Atom) -> frozenset[str]:
    return frozenset(call.name for call in atom.calls)


def orders(failed: Sequence[Atom], others: Sequence[Atom]) -> Iterator[tuple[Atom, ...]]:
    """Pairs to try, each with one part of the failed turn: another atom before it, then
    after it, over the failed-turn atoms in turn. An atom whose functions the failed
    turn's calls already make, or the other way round, is not joined: asking the same
    thing twice is no longer turn."""
    for other in others:
        for atom in failed:
            if functions_of(other) <= functions_of(atom) or functions_of(atom) <= functions_of(
                other
            ):
                continue
            yield (other, atom)
            yield (atom, other)


def composed_rounds(
    start: Task,
    pairs: Iterator[tuple[Atom, ...]],
    make_env: Callable[[], Environment],
    limit: int,
    tries: int = 24,
) -> list[ExplorationRound]:
    """At most ``limit`` composed rounds from ``pairs`` (at most ``tries`` tried), chains
    first. Blocking."""
    made: list[Composed] = []
    for attempt, pair in enumerate(pairs):
        if attempt >= tries or sum(c.chain for c in made) >= limit:
            break
        composed = compose(start, pair, make_env)
        if composed is not None and all(composed.round.steps != c.round.steps for c in made):
            made.append(composed)
    made.sort(key=lambda composed: not composed.chain)
    return [composed.round for composed in made[:limit]]
