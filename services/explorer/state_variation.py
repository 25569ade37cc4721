"""Variant turns by state variation: the parent turn asked again on another initial state.

Substitution swaps a value the user gives; the state stays the parent's, so a policy that
learnt the parent's answer by heart (the price it returned, the order id it made) still
answers its variants. Here the state's own values change instead: the numbers the calls
read (a balance, a fuel level, a price, a tire pressure) are scaled, and identifiers (user
ids, order ids, card numbers) are renamed, consistently wherever the configuration holds
them. The parent's calls are replayed from the start of the conversation (its earlier
turns too) on the varied state with the real environment:

- an identifier a call passes follows its rename, in the calls and in every request;
- a number a call passes follows the varied value where the turn's request states it
  (the request is then rewritten the same way); a value a call took from an earlier
  result is read again from the variant's own result at the same place;
- a change that could alter a turn's answer is not made: one that changes what a call of
  a conditional request ("if it is reachable, ...") or anything before it returns, or a
  call passing a number worked out by hand (45 gallons to fill the tank, 10 shares' worth
  of a price) or anything before it;
- every call must run without an error, the last turn's calls must do something else than
  the parent's (another result or another change of state), and no request may write a
  value that changed where it stood, nor one only a call of its turn returns;
- a variant whose turn is the parent's, its request and its calls, is none: the policy
  would be asked the parent's turn again for the parent's calls (in run 41, 16 of 26
  children were argument-free lookups asked again on another state).

No LLM is asked: a variant costs a few replays of the turn.
"""

from __future__ import annotations

import copy
import json
import random
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from coevolve.services.explorer.composition import returned_values_stated
from coevolve.services.explorer.exploration import HISTORY_CHARS, clipped
from coevolve.services.explorer.state_values import (
    Knob,
    Number,
    NumberKnob,
    Path,
    Variation,
    default_state,
    drawn,
    id_texts,
    is_number,
    knobs_of,
    leaves,
    renamed_text,
    varied_config,
    with_number,
    writes_number,
)
from coevolve.services.explorer.substitution import contains_value, parsed_result
from coevolve.shared.argument_values import is_salient, scalars
from coevolve.shared.envs import Environment, state_of
from coevolve.shared.envs.bfcl.tasks import prior_ground_truth
from coevolve.shared.messages import (
    ChatMessage,
    ExplorationRound,
    InteractionStep,
    Task,
    ToolCall,
)
from coevolve.shared.value_roles import mention

# "if" that asks for nothing on a condition ("if that helps, my id is ...")
COURTESY = re.compile(
    r"\b(?:even|as) if\b|\bif (?:that|it|this) helps\b|\bif (?:you )?need(?:ed)?\b"
    r"|\bif (?:you )?(?:could|would|can|don't mind|possible)\b",
    re.IGNORECASE,
)
# a request whose calls the state decides: changing what they read may change the answer
CONDITION = re.compile(
    r"\b(?:if|unless|in case|provided that|as long as|otherwise|should (?:any|it|they|the))\b",
    re.IGNORECASE,
)
# a request choosing among what the state holds by a quantity ("the order with a
# substantial value", "the cheapest"): the quantities of that collection stay the parent's
SELECTION = re.compile(
    r"\b(?:highest|lowest|largest|smallest|biggest|cheapest|best|worst|most|least|top"
    r"|substantial|maximum|minimum|greatest)\b",
    re.IGNORECASE,
)
END_OF_TURN = "Done."
# draws of a knob whose draw made a call fail; of several knobs at once
DRAWS_PER_KNOB = 3
COMBINATION_TRIES = 4
ABSENT = "<absent>"


# --------------------------------------------------------------------------- turns, replay


@dataclass(frozen=True)
class Turn:
    request: str
    calls: tuple[ToolCall, ...]


def turns_of(task: Task) -> list[Turn]:
    """The conversation a one-turn task continues, its own turn last."""
    prior = list(task.env_config.get("prior_turns") or [])
    truth = prior_ground_truth(task.env_config)
    earlier = [Turn(text, tuple(calls)) for text, calls in zip(prior, truth, strict=True)]
    return [*earlier, Turn(task.user_turns[0], tuple(task.ground_truth[0]))]


def replay_task(task: Task, initial_state: Mapping[str, Any], turns: Sequence[Turn]) -> Task:
    """``task`` from the first turn of its conversation: every turn answered call by call."""
    config = {
        key: value
        for key, value in task.env_config.items()
        if key not in ("prior_turns", "prior_ground_truth", "turn")
    }
    if "turn" in task.env_config:
        config.update(turn=0, prior_turns=[], prior_ground_truth=[])
    return msgspec.structs.replace(
        task,
        user_turns=[turn.request for turn in turns],
        ground_truth=[list(turn.calls) for turn in turns],
        initial_state=dict(initial_state),
        env_config=config,
    )


Change = tuple[Path, Any, Any]


def state_changes(before: Mapping[str, Any], after: Mapping[str, Any]) -> tuple[Change, ...]:
    """(path, before, after) of every value one call changed."""
    old, new = dict(leaves(before)), dict(leaves(after))
    changed = [(path, old.get(path, ABSENT), value) for path, value in new.items()]
    gone = [(path, value, ABSENT) for path, value in old.items() if path not in new]
    return tuple(change for change in [*changed, *gone] if change[1] != change[2])


@dataclass(frozen=True)
class Run:
    """The calls of every turn as run from the start: per call, the call made, whether it
    ran, its observation and what it changed in the state."""

    calls: list[ToolCall]
    ok: list[bool]
    observations: list[str]
    changes: list[tuple[Change, ...]]
    last_turn_state: dict[str, Any]  # where the last turn starts

    def effects(self, start: int = 0, end: int | None = None) -> list[tuple[str, Any]]:
        return list(zip(self.observations, self.changes, strict=True))[start:end]


Follow = Callable[[int, ToolCall, Sequence[Any]], ToolCall]


def run_turns(
    task: Task,
    initial_state: Mapping[str, Any],
    turns: Sequence[Turn],
    make_env: Callable[[], Environment],
    follow: Follow | None = None,
) -> Run | None:
    """Every call of ``turns`` from ``initial_state``, a turn closed before the next one
    opens; ``follow`` (turn index, call, parsed results so far) gives the call to make.
    None without a state to compare."""
    environment = make_env()
    calls: list[ToolCall] = []
    ok: list[bool] = []
    observations: list[str] = []
    changes: list[tuple[Change, ...]] = []
    try:
        environment.reset(replay_task(task, initial_state, turns))
        before = state_of(environment)
        turn_state = before
        for number, turn in enumerate(turns):
            if number:
                environment.step(END_OF_TURN)
                turn_state = before = state_of(environment)
            for call in turn.calls:
                parsed = [parsed_result(text) for text in observations]
                made = follow(number, call, parsed) if follow else call
                ran, text = environment.execute(made)
                after = state_of(environment)
                if before is None or after is None:
                    return None
                calls.append(made)
                ok.append(ran)
                observations.append(text)
                changes.append(state_changes(before, after))
                before = after
    finally:
        environment.close()
    return Run(calls, ok, observations, changes, dict(turn_state or {}))


# --------------------------------------------------------------------------- following


def value_paths(node: Any, value: Any, path: Path = ()) -> Iterator[Path]:
    for where, held in leaves(node, path):
        if not isinstance(held, bool) and held is not None and held == value:
            yield where


def value_at(node: Any, path: Path) -> Any:
    for step in path:
        in_list = isinstance(node, list) and isinstance(step, int) and step < len(node)
        if not in_list and not (isinstance(node, Mapping) and step in node):
            return None
        node = node[step]
    return None if isinstance(node, Mapping | list) else node


def read_again(value: Any, parent: Sequence[Any], variant: Sequence[Any]) -> Any:
    """Where the parent's earlier results held ``value``, what the variant's hold there;
    ``value`` when none did."""
    for result, variant_result in zip(parent, variant, strict=False):
        for path in value_paths(result, value):
            found = value_at(variant_result, path)
            if found is not None:
                return found
    return value


def writes_value(text: str, value: Any) -> bool:
    if is_number(value):
        return writes_number(text, value)
    return mention(value).search(text) is not None


@dataclass(frozen=True)
class Following:
    """How one turn's calls follow a variation: identifiers always; the numbers its
    request states (old, new); values earlier calls returned, from the variant's results."""

    request: str
    renames: Mapping[str, str]
    numbers: Sequence[tuple[Number, Number]]
    parent: Sequence[Any] = ()  # the parent's parsed results before the call

    def value(self, value: Any, variant: Sequence[Any]) -> Any:
        if isinstance(value, Mapping):
            return {key: self.value(item, variant) for key, item in value.items()}
        if isinstance(value, list):
            return [self.value(item, variant) for item in value]
        new = self.changed(value)
        if new != value or type(new) is not type(value):
            return new
        if is_salient(value) and not writes_value(self.request, value):
            return read_again(value, self.parent, variant)
        return value

    def changed(self, value: Any) -> Any:
        if isinstance(value, str):
            value = renamed_text(value, self.renames)
            for old, new in self.numbers:
                value = with_number(value, old, new)
            return value
        if not is_number(value):
            return value
        if isinstance(value, int) and str(value) in self.renames:
            return int(self.renames[str(value)])
        for old, new in self.numbers:
            if value == old:
                return int(new) if isinstance(value, int) and float(new).is_integer() else new
        return value


def passes(calls: Sequence[ToolCall], value: Number) -> bool:
    """Whether ``calls`` pass ``value``, as an argument or written in a text argument."""
    for call in calls:
        for held in scalars(call.arguments):
            if isinstance(held, str) and writes_number(held, value):
                return True
            if is_number(held) and held == value:
                return True
    return False


def stated_numbers(turn: Turn, variation: Variation) -> list[tuple[Number, Number]] | None:
    """(old, new) of the changed numbers ``turn``'s request writes and its calls pass;
    None when two changed numbers were written alike (which one the request means is
    unknown)."""
    stated = [
        (old, new)
        for _, old, new in variation.numbers
        if writes_number(turn.request, old) and passes(turn.calls, old)
    ]
    olds = [old for old, _ in stated]
    return stated if len(set(olds)) == len(olds) else None


def rewritten_request(request: str, following: Following) -> str:
    request = renamed_text(request, following.renames)
    for old, new in following.numbers:
        request = with_number(request, old, new)
    return request


# --------------------------------------------------------------------------- guards


def conditional_request(request: str) -> bool:
    """Whether ``request`` asks for something on a condition the state may decide."""
    return CONDITION.search(COURTESY.sub(" ", request)) is not None


def worked_out(call: ToolCall, request: str, earlier: Sequence[Any], ids: set[str]) -> bool:
    """Whether ``call`` passes a number its request does not write, no earlier call
    returned and that is no identifier: worked out (45 gallons to fill the tank)."""
    for value in scalars(call.arguments):
        if not is_number(value) or not is_salient(value) or str(value) in ids:
            continue
        if writes_number(request, value):
            continue
        if not any(contains_value(result, value) for result in earlier):
            return True
    return False


def guarded_until(turns: Sequence[Turn], parent: Run, ids: set[str]) -> int:
    """The position of the last call whose result and change a variant must keep (every
    call before it too): the last of a conditional turn, or one passing a worked-out
    number. -1: none."""
    parsed = [parsed_result(text) for text in parent.observations]
    guard, start = -1, 0
    for turn in turns:
        end = start + len(turn.calls)
        if conditional_request(turn.request):
            guard = max(guard, end - 1)
        for position in range(start, end):
            if worked_out(parent.calls[position], turn.request, parsed[:position], ids):
                guard = max(guard, position)
        start = end
    return guard


def containers(node: Any, path: Path = ()) -> Iterator[tuple[Path, Any]]:
    """(path, node) of every object and list in ``node``, itself first."""
    if isinstance(node, Mapping | list):
        yield path, node
        items = node.items() if isinstance(node, Mapping) else enumerate(node)
        for key, child in items:
            yield from containers(child, (*path, key))


def _member_of(collection: Any, text: str) -> bool:
    """Whether ``text`` names one member of a collection of several: a key of an object
    of several, or a field of one record of a list of several."""
    if len(collection) < 2:
        return False
    if isinstance(collection, Mapping):
        return text in (str(key) for key in collection)
    records = [item for item in collection if isinstance(item, Mapping)]
    return any(text in (str(value) for value in record.values()) for record in records)


def chosen_collections(config: Mapping[str, Any], turns: Sequence[Turn]) -> list[Path]:
    """The collections a turn picked a member of by a quantity (``SELECTION``), passing
    its key although its request does not write it."""
    found: list[Path] = []
    for turn in turns:
        if not SELECTION.search(turn.request):
            continue
        for call in turn.calls:
            for value in scalars(call.arguments):
                if not is_salient(value) or writes_value(turn.request, value):
                    continue
                found += [p for p, node in containers(config) if _member_of(node, str(value))]
    return found


def changed_returns(parent: Run, variant: Run) -> list[tuple[int, Any]]:
    """(call position, value) of each salient value a parent's call returned where the
    variant's same call returned another."""
    found: list[tuple[int, Any]] = []
    for position, (text, variant_text) in enumerate(
        zip(parent.observations, variant.observations, strict=True)
    ):
        result, variant_result = parsed_result(text), parsed_result(variant_text)
        for path, value in leaves(result):
            if is_salient(value) and value_at(variant_result, path) != value:
                found.append((position, value))
    return found


def stale(turns: Sequence[Turn], variant: Run, changed: Sequence[tuple[int, Any]]) -> bool:
    """Whether a request or a call still writes a value an earlier call returned that the
    variant's call no longer returns (a message quoting the old price)."""
    start = 0
    for turn in turns:
        before = [value for position, value in changed if position < start]
        if any(writes_value(turn.request, value) for value in before):
            return True
        for position in range(start, start + len(turn.calls)):
            earlier = [value for at, value in changed if at < position]
            for held in scalars(variant.calls[position].arguments):
                text = held if isinstance(held, str) else None
                if any(
                    (text is not None and writes_value(text, value)) or held == value
                    for value in earlier
                    if not isinstance(held, bool)
                ):
                    return True
        start += len(turn.calls)
    return False


# --------------------------------------------------------------------------- variants


@dataclass(frozen=True)
class StateVariant:
    """A variant: ``start`` is the parent task on the varied state (its request made by
    code, no ground truth: where the variant's exploration starts), ``round`` its calls,
    request and observations, ``variation`` what changed."""

    start: Task
    round: ExplorationRound
    variation: Variation
    effects: list[tuple[str, Any]] = field(repr=False, default_factory=list)


@dataclass
class Parent:
    """The parent turn, replayed, and what a variant of it must keep."""

    task: Task
    config: dict[str, Any]  # the initial configuration, its classes' defaults written out
    turns: list[Turn]
    make_env: Callable[[], Environment]
    run: Run
    guard: int
    taken: set[str]  # identifier-like words anywhere: a new id may be none of them
    fixed: list[Path] = field(default_factory=list)  # collections whose numbers stay

    def knobs(self) -> list[Knob]:
        """What may change: every knob but the numbers of collections a turn chose from."""
        return [
            knob
            for knob in knobs_of(self.config)
            if not isinstance(knob, NumberKnob)
            or not any(knob.path[: len(path)] == path for path in self.fixed)
        ]

    @property
    def current(self) -> int:
        return len(self.run.calls) - len(self.turns[-1].calls)


def followings(parent: Parent, variation: Variation) -> list[Following] | None:
    renames = dict(variation.renames)
    made: list[Following] = []
    for turn in parent.turns:
        numbers = stated_numbers(turn, variation)
        if numbers is None:
            return None
        made.append(Following(turn.request, renames, numbers))
    return made


def variant_run(parent: Parent, variation: Variation) -> tuple[Run, list[Turn]] | None:
    """The parent's turns replayed on the varied state, and their requests rewritten."""
    following = followings(parent, variation)
    if following is None:
        return None
    parsed = [parsed_result(text) for text in parent.run.observations]

    def follow(turn: int, call: ToolCall, variant: Sequence[Any]) -> ToolCall:
        rule = following[turn]
        context = Following(rule.request, rule.renames, rule.numbers, parsed[: len(variant)])
        return ToolCall(name=call.name, arguments=context.value(call.arguments, variant))

    state = varied_config(parent.config, variation)
    run = run_turns(parent.task, state, parent.turns, parent.make_env, follow)
    if run is None:
        return None
    turns: list[Turn] = []
    start = 0
    for turn, rule in zip(parent.turns, following, strict=True):
        end = start + len(turn.calls)
        turns.append(Turn(rewritten_request(turn.request, rule), tuple(run.calls[start:end])))
        start = end
    return run, turns


# why a variation gives no variant: a call failed (another draw may pass), a call it must
# keep changed, the turn does what the parent's did, a request cannot be kept true, the
# turn's request and calls are the parent's
FAILED, KEPT, SAME, UNTRUE, REPEATED = "failed", "kept", "same", "untrue", "repeated"


def rejection(parent: Parent, run: Run, turns: Sequence[Turn], variation: Variation) -> str:
    """Why the variant's replay is no variant (see above); "" when it is one."""
    current = parent.current
    if run.ok != parent.run.ok or not all(run.ok[current:]):
        return FAILED
    if parent.run.effects(0, parent.guard + 1) != run.effects(0, parent.guard + 1):
        return KEPT
    if parent.run.effects(current) == run.effects(current):
        return SAME
    if turns[-1] == parent.turns[-1]:
        return REPEATED
    olds = [old for _, old, _ in variation.numbers]
    if any(writes_number(turn.request, old) for turn in turns for old in olds):
        return UNTRUE  # a request writes a changed number it could not rewrite
    if stale(turns, run, changed_returns(parent.run, run)):
        return UNTRUE
    request, calls = turns[-1].request, list(turns[-1].calls)
    start_text = json.dumps(run.last_turn_state, default=str)
    if returned_values_stated(request, calls, run.observations[current:], start_text):
        return UNTRUE
    return ""


def varied_task(parent: Parent, variation: Variation, turns: Sequence[Turn]) -> Task:
    """The parent task on the varied state, its conversation and its turn rewritten."""
    task = parent.task
    config = dict(task.env_config)
    if len(turns) > 1:
        config["prior_turns"] = [turn.request for turn in turns[:-1]]
        config["prior_ground_truth"] = [
            [msgspec.to_builtins(call) for call in turn.calls] for turn in turns[:-1]
        ]
    return msgspec.structs.replace(
        task,
        initial_state=varied_config(parent.config, variation),
        env_config=config,
        user_turns=[turns[-1].request],
        ground_truth=[list(turns[-1].calls)],
    )


def replayed_turn(
    task: Task, make_env: Callable[[], Environment]
) -> tuple[list[ChatMessage], list[str]] | None:
    """The conversation ``task`` starts with and its calls' observations, as the judge
    will replay it; None when a call fails."""
    environment = make_env()
    try:
        messages = environment.reset(task)
        history = clipped([m for m in messages if m.role != "system"], HISTORY_CHARS)
        observations: list[str] = []
        for call in task.ground_truth[0]:
            ok, text = environment.execute(call)
            if not ok:
                return None
            observations.append(text)
        return history, observations
    finally:
        environment.close()


def variant_of(parent: Parent, variation: Variation) -> tuple[StateVariant | None, str]:
    """The variant ``variation`` makes, or why it makes none (``rejection``)."""
    made = variant_run(parent, variation)
    if made is None:
        return None, UNTRUE
    reason = rejection(parent, *made, variation)
    if reason:
        return None, reason
    run, turns = made
    task = varied_task(parent, variation, turns)
    replayed = replayed_turn(task, parent.make_env)
    if replayed is None or replayed[1] != run.observations[parent.current :]:
        return None, FAILED
    history, observations = replayed
    steps = [
        InteractionStep(history=list(history), action=call, observation=text)
        for call, text in zip(task.ground_truth[0], observations, strict=True)
    ]
    round_ = ExplorationRound(steps=steps, request=task.user_turns[0], varied_state=True)
    start = msgspec.structs.replace(task, ground_truth=[])
    return StateVariant(start, round_, variation, run.effects(parent.current)), ""


def loaded_config(task: Task, make_env: Callable[[], Environment]) -> dict[str, Any]:
    """The task's initial configuration with the defaults its classes load written out
    (an order id the defaults hold is renamed there too), when the environment starts in
    the same state from it; else the configuration as it is."""
    config: dict[str, Any] = copy.deepcopy(dict(task.initial_state))
    for class_name in task.env_config.get("involved_classes") or []:
        defaults = default_state(class_name)
        if defaults:
            config[class_name] = {**defaults, **dict(config.get(class_name) or {})}
    loaded = msgspec.structs.replace(task, initial_state=config, user_turns=[], ground_truth=[])
    own = msgspec.structs.replace(task, user_turns=[], ground_truth=[])
    states = []
    for start in (own, loaded):
        environment = make_env()
        try:
            environment.reset(start)
            states.append(state_of(environment))
        finally:
            environment.close()
    return config if states[0] == states[1] else copy.deepcopy(dict(task.initial_state))


def parent_of(task: Task, make_env: Callable[[], Environment]) -> Parent | None:
    """The parent turn replayed from the start of its conversation; None when it is no
    one-turn task with calls, or its own calls fail."""
    if len(task.user_turns) != 1 or len(task.ground_truth) != 1 or not task.ground_truth[0]:
        return None
    config = loaded_config(task, make_env)
    turns = turns_of(task)
    run = run_turns(task, config, turns, make_env)
    current = len(run.calls) - len(turns[-1].calls) if run else 0
    if run is None or not all(run.ok[current:]):
        return None
    ids = set(id_texts(config))
    texts = [turn.request for turn in turns] + [str(v) for v in scalars(config)]
    texts += [json.dumps(call.arguments) for turn in turns for call in turn.calls]
    texts += [str(key) for path, _ in leaves(config) for key in path]
    taken = {word for text in texts for word in re.findall(r"[\w-]+", text)}
    guard = guarded_until(turns, run, ids)
    fixed = chosen_collections(config, turns)
    return Parent(task, config, turns, make_env, run, guard, taken, fixed)


def _distinct(variant: StateVariant, made: Sequence[StateVariant]) -> bool:
    return all(variant.effects != other.effects for other in made)


def single_variants(
    parent: Parent, knobs: Sequence[Knob], rng: random.Random
) -> list[tuple[Knob, StateVariant]]:
    """Each knob that gives a variant on its own, with it; a knob whose draw made a call
    fail is drawn again, up to ``DRAWS_PER_KNOB`` times."""
    found: list[tuple[Knob, StateVariant]] = []
    for knob in knobs:
        for _ in range(DRAWS_PER_KNOB):
            variation = drawn([knob], rng, parent.taken)
            variant, reason = variant_of(parent, variation) if variation else (None, FAILED)
            if variant is not None:
                found.append((knob, variant))
            if reason != FAILED:
                break
    return found


def combined_variants(
    parent: Parent, knobs: Sequence[Knob], rng: random.Random
) -> list[StateVariant]:
    """Variants changing several knobs at once: all of them, then random subsets."""
    made: list[StateVariant] = []
    for attempt in range(COMBINATION_TRIES if len(knobs) > 1 else 0):
        chosen = knobs if attempt == 0 else rng.sample(list(knobs), rng.randint(2, len(knobs)))
        variation = drawn(chosen, rng, parent.taken)
        variant = variant_of(parent, variation)[0] if variation else None
        if variant is not None:
            made.append(variant)
    return made


def state_variants(
    task: Task, make_env: Callable[[], Environment], limit: int, seed: str = ""
) -> list[StateVariant]:
    """At most ``limit`` variants of ``task`` on other initial states, drawn by ``seed``
    (default: the task's id): the knobs that each give a variant alone are found, then
    varied together; variants whose calls differ from the parent's come first (the policy
    must read the state to make them), then those changing more knobs. Blocking (run it
    in a worker thread)."""
    parent = parent_of(task, make_env) if limit > 0 else None
    if parent is None:
        return []
    rng = random.Random(seed or task.id)
    singles = single_variants(parent, parent.knobs(), rng)
    candidates = combined_variants(parent, [knob for knob, _ in singles], rng)
    candidates += [variant for _, variant in singles]
    parent_calls = list(parent.turns[-1].calls)
    candidates.sort(key=lambda v: [s.action for s in v.round.steps] == parent_calls)
    made: list[StateVariant] = []
    for variant in candidates:
        if len(made) < limit and _distinct(variant, made):
            made.append(variant)
    return made


def state_variation_rounds(
    task: Task, make_env: Callable[[], Environment], limit: int, seed: str = ""
) -> list[tuple[Task, list[ExplorationRound]]]:
    """(start, rounds) of each variant, as ``composed_rounds_for`` gives them: each its own
    exploration, as each starts on its own state. Blocking (run it in a worker thread)."""
    return [(v.start, [v.round]) for v in state_variants(task, make_env, limit, seed)]
