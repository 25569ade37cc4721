"""Variant turns by substitution: the parent turn again, with one value its request states
replaced by another value the state holds, in the calls and in the request alike.

A 0.5B abstractor asked to write a request for explored calls wrote a user's request in
1 of 11 accepted tasks of run 28; the rest read as function descriptions, logs or code.
The parent's request was written by people. Where it states a value its calls pass
(``'USR005'``, ``Rivermist``) and the state holds others of its kind, swapping the value
in both keeps the request a person's and the calls the parent's, with the same functions
in the same order: the turn the policy failed, asked again about another value. A value
a later call takes from an earlier call's result (a zip code, then a distance) is read
again from the variant's own result at the same place, so chains stay chains. Every
call must run without an error, or the variant is not made.

No LLM is asked: a round costs a few environment steps.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from coevolve.services.explorer.exploration import HISTORY_CHARS, clipped
from coevolve.services.explorer.variants import alternatives
from coevolve.shared.argument_values import salient_values
from coevolve.shared.envs import Environment, state_of
from coevolve.shared.envs.protocol import argument_values_of
from coevolve.shared.messages import ExplorationRound, InteractionStep, Task, ToolCall
from coevolve.shared.value_roles import mention, shape

# A request whose calls depend on a condition the state decides ("if its price is above
# 300, add it"): swapping the value may flip the condition, and the calls would no longer
# be the answer. Such parents give no substitution.
CONDITION = re.compile(r"\b(if|unless|whether|in case|provided)\b", re.IGNORECASE)
COMPARISON = re.compile(
    r"\b(than|above|below|exceeds?|under|over|at least|at most|higher|lower|promising)\b",
    re.IGNORECASE,
)
# a number the user states (an amount, a price, a temperature) varies by these factors,
# rounded as it was written; the environment refuses what the state cannot take
NUMBER_FACTORS = (0.8, 1.2, 0.5, 1.5, 2.0)

Path = tuple[str | int, ...]


@dataclass(frozen=True)
class Substitution:
    old: Any
    new: Any


def stated_values(request: str, calls: Sequence[ToolCall]) -> list[Any]:
    """The salient values of ``calls`` that ``request`` writes out as they are passed."""
    return [
        value
        for _, _, value in salient_values(calls)
        if isinstance(value, str | int | float) and mention(value).search(request)
    ]


def conditional(request: str) -> bool:
    """Whether ``request`` asks for its calls only under a condition on a quantity."""
    return bool(CONDITION.search(request) and COMPARISON.search(request))


def other_numbers(value: int | float) -> list[int | float]:
    """Nearby amounts for a stated number, rounded as it was written."""
    found: list[int | float] = []
    for factor in NUMBER_FACTORS:
        other: int | float = (
            round(value * factor) if isinstance(value, int) else round(value * factor, 2)
        )
        if other > 1 and other != value and other not in found:
            found.append(other)
    return found


def other_values(
    state: Mapping[str, Any] | None,
    value: Any,
    avoid: Sequence[Any],
    known: Sequence[Any] = (),
) -> list[Any]:
    """Values to put in ``value``'s place: others of its kind and shape that the state
    holds; else, for a string, others the environment knows its parameter takes
    (``known``: a city ``get_zipcode_based_on_city`` knows lives in its code, not in a
    state), for a number, nearby numbers; none of ``avoid`` (the parent's other values:
    logging in as the user the message goes to is no variant)."""
    found = [other for other in alternatives(state, value, [value]) if shape(other) == shape(value)]
    if not found and isinstance(value, str):
        found = [other for other in known if other != value]
    if not found and isinstance(value, int | float) and not isinstance(value, bool):
        found = list(other_numbers(value))
    return [other for other in found if other not in avoid]


def substituted(value: Any, old: Any, new: Any) -> Any:
    """``value`` (an argument, lists and objects searched) with every ``old`` scalar ``new``."""
    if isinstance(value, Mapping):
        return {key: substituted(item, old, new) for key, item in value.items()}
    if isinstance(value, list):
        return [substituted(item, old, new) for item in value]
    if type(value) is type(old) and value == old:
        return new
    return value


def substituted_request(request: str, old: Any, new: Any) -> str:
    return mention(old).sub(lambda _: str(new), request)


def parsed_result(observation: str) -> Any:
    try:
        return json.loads(observation)
    except ValueError:
        return None


def _paths(node: Any, value: Any, path: Path = ()) -> Iterator[Path]:
    if isinstance(node, Mapping):
        for key, item in node.items():
            yield from _paths(item, value, (*path, str(key)))
    elif isinstance(node, list):
        for position, item in enumerate(node):
            yield from _paths(item, value, (*path, position))
    elif not isinstance(node, bool) and node == value:
        yield path


def contains_value(node: Any, value: Any) -> bool:
    return next(_paths(node, value), None) is not None


def _at(node: Any, path: Path) -> Any:
    for step in path:
        in_list = isinstance(step, int) and isinstance(node, list) and step < len(node)
        if in_list or (isinstance(node, Mapping) and step in node):
            node = node[step]
        else:
            return None
    return node


def _derived(
    value: Any, results: Sequence[Any], variant_results: Sequence[Any]
) -> tuple[bool, Any]:
    """Whether an earlier call returned ``value`` (in the parent's replay), and then what
    the variant's same call returned at the same place."""
    for result, variant_result in zip(results, variant_results, strict=True):
        for path in _paths(result, value):
            found = _at(variant_result, path)
            if found is not None:
                return True, found
    return False, None


def _run(environment: Environment, task: Task, calls: Sequence[ToolCall]) -> tuple[list[str], bool]:
    environment.reset(task)
    observations: list[str] = []
    for call in calls:
        ok, text = environment.execute(call)
        observations.append(text)
        if not ok:
            return observations, False
    return observations, True


def variant_calls(
    parent_calls: Sequence[ToolCall],
    parent_observations: Sequence[str],
    substitution: Substitution,
    execute: Callable[[ToolCall], tuple[bool, str]],
) -> tuple[list[ToolCall], list[str]] | None:
    """The parent's calls with ``substitution`` made, run one by one through ``execute``
    from the parent's start state; a value an earlier call returned is taken from the
    variant's result instead. None when a call fails or nothing changes."""
    parsed = [parsed_result(text) for text in parent_observations]
    calls: list[ToolCall] = []
    observations: list[str] = []
    variant_parsed: list[Any] = []
    for position, call in enumerate(parent_calls):
        arguments: dict[str, Any] = {}
        for parameter, value in call.arguments.items():
            new_value = substituted(value, substitution.old, substitution.new)
            if new_value == value and value != substitution.old:
                found, derived = _derived(value, parsed[:position], variant_parsed)
                if found:
                    new_value = derived
            arguments[parameter] = new_value
        variant = ToolCall(name=call.name, arguments=arguments)
        ok, text = execute(variant)
        if not ok:
            return None
        calls.append(variant)
        observations.append(text)
        variant_parsed.append(parsed_result(text))
    if calls == list(parent_calls):
        return None
    return calls, observations


def passed_values(calls: Sequence[ToolCall]) -> list[Any]:
    return [value for _, _, value in salient_values(calls)]


def _request_tokens(request: str) -> list[str]:
    """The request's quoted strings and id-like words: a new value the request already
    names (the user's own id) would make a muddled variant."""
    quoted = re.findall(r"'([^']+)'|\"([^\"]+)\"", request)
    return [a or b for a, b in quoted] + re.findall(r"\b[A-Z][A-Z0-9]{2,}\b", request)


def _first_shape(other: str, value: Any) -> bool:
    """Whether the first words of both are written alike (a city for a city, ``USR003``
    for ``USR005``; not ``USR003`` for a message id)."""
    return shape(other.split()[0]) == shape(str(value).split()[0])


def is_name(value: str) -> bool:
    """A name or an address, not a code (a zip code goes with the city the request also
    says) nor a sentence (a message to send)."""
    sentence = len(value.split()) > 6 or value.endswith((".", "?", "!"))
    return any(c.isalpha() for c in value) and not sentence


def unexplained_numbers(
    request: str, calls: Sequence[ToolCall], observations: Sequence[str]
) -> list[tuple[int, Any]]:
    """(call position, number) of each number a call passes that the request does not
    write and no earlier call returned as it is: worked out (10.04 gallons rounded to 10),
    which a variant cannot work out again."""
    parsed = [parsed_result(text) for text in observations]
    found: list[tuple[int, Any]] = []
    for position, call in enumerate(calls):
        for _, _, value in salient_values([call]):
            if not isinstance(value, int | float) or isinstance(value, bool):
                continue
            stated = mention(value).search(request) is not None
            returned = any(contains_value(result, value) for result in parsed[:position])
            if not stated and not returned:
                found.append((position, value))
    return found


def entangled(
    value: Any, request: str, calls: Sequence[ToolCall], observations: Sequence[str]
) -> bool:
    """Whether swapping ``value`` alone would leave the turn inconsistent: it is written
    inside another argument (a message quoting the city), the request names a part of it
    elsewhere (an address in Berkeley, "this spot in Berkeley"), or a call after the
    first that passes it passes a number worked out from earlier results."""
    text = str(value)
    for _, _, other in salient_values(calls):
        if isinstance(other, str) and other != text and text in other:
            return True
    parts = [word.strip(",.") for word in text.split()]
    if len(parts) > 1:
        outside = mention(value).sub(" ", request)
        if any(len(part) >= 4 and part[0].isupper() and part in outside for part in parts):
            return True
    passing = [i for i, call in enumerate(calls) if value in passed_values([call])]
    first = passing[0] if passing else len(calls)
    return any(
        position > first and number != value
        for position, number in unexplained_numbers(request, calls, observations)
    )


def given_arguments(
    calls: Sequence[ToolCall], observations: Sequence[str]
) -> list[tuple[str, str, Any]]:
    """(function, parameter, value) of each salient value of ``calls`` that no earlier
    call returned, where it is first passed: what the user gave (in the request, in
    words, or earlier in the conversation)."""
    parsed = [parsed_result(text) for text in observations]
    given: list[tuple[str, str, Any]] = []
    for position, call in enumerate(calls):
        for _, parameter, value in salient_values([call]):
            returned = any(contains_value(result, value) for result in parsed[:position])
            fresh = all(value != seen for _, _, seen in given)
            if not returned and isinstance(value, str | int | float) and fresh:
                given.append((call.name, parameter, value))
    return given


def substitutions(
    task: Task,
    state: Mapping[str, Any] | None,
    observations: Sequence[str],
    seed: str,
    known: Callable[[str, str], Sequence[Any]] = lambda function, parameter: (),
) -> list[Substitution]:
    """(given value, another value for it) pairs of the parent turn: values its request
    states first (the request is then made by code), then values it says in other words;
    interleaved over the values and shuffled within each by ``seed``, so the first few
    vary different values. [] for a conditional request or a task of more than one turn."""
    if len(task.user_turns) != 1 or len(task.ground_truth) != 1:
        return []
    request, calls = task.user_turns[0], task.ground_truth[0]
    if conditional(request):
        return []
    rng = random.Random(seed)
    passed = [*passed_values(calls), *_request_tokens(request)]
    stated = stated_values(request, calls)
    given = given_arguments(calls, observations)
    # a number the request does not state is mostly worked out (40 gallons in total is
    # 30 to add; a distance an earlier turn returned): another one would contradict it
    ordered = [item for item in given if item[2] in stated] + [
        item for item in given if item[2] not in stated and isinstance(item[2], str)
    ]
    per_value: list[list[Substitution]] = []
    for function, parameter, value in ordered:
        if entangled(value, request, calls, observations):
            continue
        usable = [
            other
            for other in known(function, parameter)
            if isinstance(other, str) and is_name(other) and _first_shape(other, value)
        ]
        others = other_values(state, value, passed, usable)
        rng.shuffle(others)
        per_value.append([Substitution(value, other) for other in others])
    interleaved: list[Substitution] = []
    for rank in range(max((len(options) for options in per_value), default=0)):
        interleaved.extend(options[rank] for options in per_value if rank < len(options))
    return sorted(interleaved, key=lambda sub: sub.old not in stated)


def substitution_rounds(
    task: Task,
    make_env: Callable[[], Environment],
    limit: int,
    seed: str = "",
    known_values: bool = True,
) -> list[ExplorationRound]:
    """At most ``limit`` rounds, each the parent turn's calls with one substitution made
    (``ExplorationRound.replaced``); where the request states the old value, its request
    made the same way (``ExplorationRound.request``), else the abstractor's LLM edits the
    parent's request. Blocking (run it in a worker thread)."""
    if limit <= 0 or not task.ground_truth:
        return []
    environment = make_env()
    try:
        history = clipped([m for m in environment.reset(task) if m.role != "system"], HISTORY_CHARS)
        state = state_of(environment)
        parent_calls = task.ground_truth[0]
        parent_observations, ok = _run(environment, task, parent_calls)
        if not ok:
            return []
        request = task.user_turns[0]
        rounds: list[ExplorationRound] = []

        def known(function: str, parameter: str) -> list[Any]:
            if not known_values:
                return []
            return argument_values_of(environment, function, parameter)

        ordered = substitutions(task, state, parent_observations, seed or task.id, known)
        for substitution in ordered:
            if len(rounds) >= limit:
                break
            environment.reset(task)
            made = variant_calls(
                parent_calls, parent_observations, substitution, environment.execute
            )
            if made is None:
                continue
            calls, observations = made
            steps = [
                InteractionStep(history=list(history), action=call, observation=text)
                for call, text in zip(calls, observations, strict=True)
            ]
            old, new = substitution.old, substitution.new
            stated = mention(old).search(request) is not None
            rounds.append(
                ExplorationRound(
                    steps=steps,
                    request=substituted_request(request, old, new) if stated else None,
                    replaced=[old, new],
                )
            )
        return rounds
    finally:
        environment.close()
