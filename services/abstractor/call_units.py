"""The calls a candidate task asks for, chosen by code from the exploration log.

Each round of an exploration starts from the task's initial state. Its calls that
succeeded are replayed in order in a fresh environment, and the minimal sequence is kept:
a call is left out when the replay without it fails no other call and ends in the same
state with the same results (a listing before a change, a call repeated); a call right
after an identical one is dropped before that (``without_repeats``). A login whose
token a later call uses stays: without it that call fails. When nothing changed the state,
the round's last call that returned a result is a question of one call.

Two kinds of call stay although leaving them out changes no state: a call of a *target*
function (one the policy got wrong in the parent turn: the reason the task exists), and
a lookup whose result a later call uses (a later call passes a value the lookup returned
and the request cannot have said: a zip code, then a distance). With targets, a round
whose calls include none of them gives no unit.

The abstractor's LLM then writes the request for exactly these calls, so a request can no
longer ask for a call the exploration never made, or contradict the one it made.

A substitution round (``ExplorationRound.replaced``: the parent turn's calls with one
value replaced) is a unit as it is, none of its calls left out: they are the parent's
answer, asked about another value. So is a composed round
(``ExplorationRound.composed_from``: validated turns joined into one).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence, Set
from dataclasses import dataclass
from typing import Any

from coevolve.shared.argument_values import salient_values
from coevolve.shared.envs import Environment, state_of
from coevolve.shared.failures import target_functions
from coevolve.shared.messages import Exploration, ExplorationRound, Task, ToolCall


@dataclass(frozen=True)
class CallUnit:
    """One candidate's calls, what each returned in the replay, and whether they change
    the environment's state (False: a question answered by one call). A substitution
    round's unit carries the value it replaced (``replaced``: old, new) and, where code
    made it, its request."""

    calls: list[ToolCall]
    observations: list[str]
    changes_state: bool
    replaced: list[Any] | None = None
    request: str | None = None
    composed_from: tuple[str, ...] = ()
    varied_state: bool = False


@dataclass(frozen=True)
class _Replay:
    ok: list[bool]
    observations: list[str]
    state: Mapping[str, Any] | None
    initial_state: Mapping[str, Any] | None


def _replay(task: Task, calls: Sequence[ToolCall], make_env: Callable[[], Environment]) -> _Replay:
    environment = make_env()
    try:
        environment.reset(task)
        initial = state_of(environment)
        outcomes = [environment.execute(call) for call in calls]
        return _Replay(
            ok=[ok for ok, _ in outcomes],
            observations=[text for _, text in outcomes],
            state=state_of(environment),
            initial_state=initial,
        )
    finally:
        environment.close()


def without_repeats(calls: Sequence[ToolCall]) -> list[ToolCall]:
    """``calls`` without a call identical to the one just before it: an explorer that
    repeats itself (placing the same order twice) is not asking for it twice, and a user
    would not either. A repeat that changes nothing is also caught by ``minimal_calls``;
    this one catches a repeat that changes the state again."""
    kept: list[ToolCall] = []
    for call in calls:
        if not kept or call != kept[-1]:
            kept.append(call)
    return kept


def feeds_later_call(position: int, calls: Sequence[ToolCall], observations: Sequence[str]) -> bool:
    """A later call passes a salient value that call ``position`` returned and no call
    before it passed (the later call needs what this one looked up)."""
    returned = observations[position].lower()
    earlier = {repr(value) for _, _, value in salient_values(calls[:position])}
    for _, _, value in salient_values(calls[position + 1 :]):
        text = str(value).lower()
        if repr(value) not in earlier and len(text) >= 2 and text in returned:
            return True
    return False


def minimal_calls(
    task: Task,
    calls: Sequence[ToolCall],
    make_env: Callable[[], Environment],
    replayed: _Replay,
    keep: Set[str] = frozenset(),
) -> tuple[list[ToolCall], _Replay]:
    """``calls`` that replay without an error from ``task``'s initial state (``replayed``:
    their replay), minus each one whose absence changes neither the final state nor
    another call's result, unless it calls a function of ``keep`` or a later call uses
    what it returned."""
    kept = [call for call, ok in zip(calls, replayed.ok, strict=True) if ok]
    if len(kept) < len(calls):
        replayed = _replay(task, kept, make_env)
    if replayed.state is None:
        return kept, replayed  # no state to compare: every call that ran stays
    position = 0
    while position < len(kept):
        if kept[position].name in keep or feeds_later_call(position, kept, replayed.observations):
            position += 1
            continue
        without = [*kept[:position], *kept[position + 1 :]]
        trial = _replay(task, without, make_env)
        others = [*replayed.observations[:position], *replayed.observations[position + 1 :]]
        if all(trial.ok) and trial.state == replayed.state and trial.observations == others:
            kept, replayed = without, trial
        else:
            position += 1
    return kept, replayed


def round_unit(
    task: Task,
    calls: Sequence[ToolCall],
    make_env: Callable[[], Environment],
    targets: Set[str] = frozenset(),
) -> CallUnit | None:
    """The unit of one round's successful calls; None when none of them replays, or, with
    ``targets``, when the unit would call none of them."""
    answered = _replay(task, calls, make_env)
    kept, replayed = minimal_calls(task, calls, make_env, answered, targets)
    changes = replayed.state is None or replayed.state != replayed.initial_state
    aimed = not targets or any(call.name in targets for call in kept)
    if kept and (changes or len(kept) > 1) and aimed:
        return CallUnit(kept, list(replayed.observations), changes_state=changes)
    for call, ok, observation in reversed(
        list(zip(calls, answered.ok, answered.observations, strict=True))
    ):
        if ok and observation.strip() and (not targets or call.name in targets):
            single = _replay(task, [call], make_env)
            if single.ok == [True]:
                return CallUnit([call], list(single.observations), changes_state=False)
    return None


def substitution_unit(
    task: Task, round_: ExplorationRound, make_env: Callable[[], Environment]
) -> CallUnit | None:
    """A substitution or composed round's calls as they are: the parent turn's calls with
    one value replaced, or the joined turns' calls, none left out (they are the turns'
    answers); None when they no longer replay."""
    calls = [step.action for step in round_.steps]
    replayed = _replay(task, calls, make_env)
    if not calls or not all(replayed.ok):
        return None
    changes = replayed.state is None or replayed.state != replayed.initial_state
    return CallUnit(
        calls,
        list(replayed.observations),
        changes_state=changes,
        replaced=round_.replaced,
        request=round_.request,
        composed_from=tuple(round_.composed_from or ()),
        varied_state=round_.varied_state,
    )


def call_units(
    exploration: Exploration, make_env: Callable[[], Environment], max_units: int
) -> list[CallUnit]:
    """At most ``max_units`` units, one per round of ``exploration`` that has one, no two
    with the same calls; each calls a function the policy got wrong in the parent turn
    when the exploration says what it got wrong. Blocking (run it in a worker thread)."""
    targets = frozenset(target_functions(exploration.failed_calls))
    units: list[CallUnit] = []
    for round_ in exploration.rounds:
        if len(units) >= max_units:
            break
        if round_.replaced is not None or round_.composed_from or round_.varied_state:
            unit = substitution_unit(exploration.task, round_, make_env)
            if unit is not None and all(unit.calls != other.calls for other in units):
                units.append(unit)
            continue
        succeeded = without_repeats([step.action for step in round_.steps if step.ok])
        if not succeeded:
            continue
        unit = round_unit(exploration.task, succeeded, make_env, targets)
        if unit is not None and all(unit.calls != other.calls for other in units):
            units.append(unit)
    return units
