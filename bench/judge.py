"""Judge benchmark: how well each stage of the judge tells sound tasks from broken ones.

A labelled set from BFCL's per-turn tasks (``bfcl-turns-base``, train split): positives are
the turns as they are (a user message and its ground-truth calls); negatives are the same
turns with one corruption each, where it applies, made by the function of its name:
``wrong_function``, ``wrong_argument``, ``dropped_call`` and ``other_description``, and the
errors synthesis made in default runs: ``written_as_call``, ``opposite_function``,
``unused_value``, ``about_the_call``, ``template_request`` and ``role_swap``.
``redundant_call`` (a state-changing call made twice in a row, what minimality is for) is
reported on its own, outside the overall reject rate.

Each candidate goes through the judge's stages in its order: replay, minimality,
relevance (``RELEVANCE_CHECKS``), round trip (an LLM solver must reach the same state), the
LLM judge. A row per stage reports the accept rate of positives, the reject rate of
negatives (overall and per corruption) and the seconds per candidate, each stage
including the ones before it. The deterministic stages run on every candidate; the LLM
stages on a fixed sample of the positives and their negatives, on a local llama.cpp
server (the default role model, 1 thread) started here. The intent threshold is fitted on
the train split and checked on the eval split's turns (``heldout``). ``--quick``: 10
positives and their negatives, the LLM stages on 3 of them.
"""

from __future__ import annotations

import asyncio
import random
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import msgspec

from coevolve.bench import tables
from coevolve.services.abstractor.completion import details_clause
from coevolve.services.explorer.substitution import substituted
from coevolve.services.judge.checks import (
    MIN_INTENT_SCORE,
    SEMANTIC_CRITERIA,
    CallTrace,
    call_text,
    check_arguments_named,
    check_description_covered,
    check_intent,
    check_keeps_roles,
    check_minimality,
    check_not_template,
    check_plain_request,
    check_real_values,
    check_same_action,
    tool_description,
    trace_calls,
)
from coevolve.services.judge.replay import replay_candidate
from coevolve.shared.argument_values import scalars
from coevolve.shared.envs import Environment, make_environment, state_of
from coevolve.shared.messages import Task, ToolCall
from coevolve.shared.value_roles import mention, shape, writes, written_values

# each corruption and its column in the tables
CORRUPTIONS: dict[str, str] = {
    "wrong_function": "wrong fn",
    "wrong_argument": "wrong arg",
    "dropped_call": "dropped",
    "other_description": "other desc",
    "written_as_call": "as code",
    "opposite_function": "opposite",
    "unused_value": "unused val",
    "about_the_call": "about call",
    "template_request": "template",
    "role_swap": "role swap",
}
# reported on its own, not in the overall reject rate
EXTRA_CORRUPTIONS: dict[str, str] = {"redundant_call": "(doubled)"}
ALL_CORRUPTIONS = (*CORRUPTIONS, *EXTRA_CORRUPTIONS)
SEED = 11
QUICK_POSITIVES = 10
# new values a role swap tries until its calls run
ROLE_SWAP_TRIES = 5
# The LLM stages cost about 80 s per candidate that reaches them on 2 shared cores (a round
# trip of ~55 s, a judgment of ~25 s, Qwen2.5-Coder-0.5B on 1 thread): a small sample.
QUICK_LLM_POSITIVES = 3
FULL_LLM_POSITIVES = 10
DETERMINISTIC = ("replay", "minimality", "relevance")
# each stage of the table: the checks of its pipeline, in their order
PIPELINES: dict[str, tuple[str, ...]] = {
    "replay": DETERMINISTIC[:1],
    "+minimality": DETERMINISTIC[:2],
    "+relevance": DETERMINISTIC,
    "+round_trip": (*DETERMINISTIC, "round_trip"),
    "+llm_judge": (*DETERMINISTIC, "llm_judge"),
    "+round_trip+llm_judge": (*DETERMINISTIC, "round_trip", "llm_judge"),
}
STAGES = tuple(PIPELINES)


@dataclass(frozen=True)
class Labelled:
    """A candidate task with its label: ``kind`` is ``positive`` or a corruption."""

    task: Task
    kind: str
    source_id: str
    note: str = ""

    @property
    def positive(self) -> bool:
        return self.kind == "positive"


# --------------------------------------------------------------------------- the set


def _make_env() -> Environment:
    return make_environment("bfcl")


def value_pool(tasks: Sequence[Task]) -> dict[tuple[str, str], list[Any]]:
    """(function, parameter) -> the distinct scalar values BFCL's ground truth passes."""
    pool: dict[tuple[str, str], list[Any]] = {}
    for task in tasks:
        for calls in task.ground_truth:
            for call in calls:
                for name, value in call.arguments.items():
                    if isinstance(value, str | int | float):
                        values = pool.setdefault((call.name, name), [])
                        if value not in values:
                            values.append(value)
    return pool


def _class_of(task: Task, function: str) -> str | None:
    from coevolve.shared.envs.bfcl.instances import function_table

    doc = function_table(task.env_config["involved_classes"]).get(function)
    return doc.class_name if doc else None


def _with_calls(task: Task, calls: list[ToolCall], suffix: str) -> Task:
    return msgspec.structs.replace(task, id=f"{task.id}~{suffix}", ground_truth=[calls])


def wrong_function(
    task: Task, pool: dict[tuple[str, str], list[Any]], rng: random.Random
) -> Labelled | None:
    """One call swapped for another function of its class whose required parameters
    can be filled from ``pool`` (or from the replaced call's arguments of the same name)."""
    from coevolve.shared.envs.bfcl.catalog import function_docs

    calls = task.ground_truth[0]
    for position in rng.sample(range(len(calls)), len(calls)):
        original = calls[position]
        class_name = _class_of(task, original.name)
        if class_name is None:
            continue
        used = {c.name for c in calls}
        options = [d for d in function_docs(class_name) if d.name not in used]
        swapped = _swap_in(task, position, options, pool, rng, "wrong_function", "wf")
        if swapped is not None:
            return swapped
    return None


def _swap_in(
    task: Task,
    position: int,
    options: list[Any],
    pool: dict[tuple[str, str], list[Any]],
    rng: random.Random,
    kind: str,
    suffix: str,
) -> Labelled | None:
    """Call ``position`` replaced by the first of ``options`` (function docs, shuffled)
    whose required parameters can be filled; None when none can."""
    calls = task.ground_truth[0]
    original = calls[position]
    rng.shuffle(options)
    for doc in options:
        replacement = _filled_call(doc.name, doc.required, original, pool, rng)
        if replacement is not None:
            swapped = [*calls[:position], replacement, *calls[position + 1 :]]
            note = f"{original.name} -> {doc.name}"
            return Labelled(_with_calls(task, swapped, suffix), kind, task.id, note)
    return None


def _filled_call(
    function: str,
    required: Sequence[str],
    original: ToolCall,
    pool: dict[tuple[str, str], list[Any]],
    rng: random.Random,
) -> ToolCall | None:
    """A call of ``function`` with its required parameters from ``pool`` (or from
    ``original``'s arguments of the same name); None when one cannot be filled."""
    arguments: dict[str, Any] = {}
    for parameter in required:
        values = pool.get((function, parameter))
        if values:
            arguments[parameter] = rng.choice(values)
        elif parameter in original.arguments:
            arguments[parameter] = original.arguments[parameter]
        else:
            return None
    return ToolCall(name=function, arguments=arguments)


def opposite_function(
    task: Task, pool: dict[tuple[str, str], list[Any]], rng: random.Random
) -> Labelled | None:
    """One call swapped for the function of its class that does the opposite action
    (``remove_stock_from_watchlist`` for ``add_to_watchlist``), the request unchanged."""
    from coevolve.shared.envs.bfcl.catalog import function_docs
    from coevolve.shared.wording import OPPOSITE_ACTIONS, name_words

    pairs = [*OPPOSITE_ACTIONS, *((b, a) for a, b in OPPOSITE_ACTIONS)]
    calls = task.ground_truth[0]
    for position in rng.sample(range(len(calls)), len(calls)):
        original = calls[position]
        class_name = _class_of(task, original.name)
        action = name_words(original.name)[:1]
        if class_name is None or not action:
            continue
        opposite_verbs = {verb for these, those in pairs if action[0] in these for verb in those}
        options = [
            d for d in function_docs(class_name) if set(name_words(d.name)[:1]) & opposite_verbs
        ]
        swapped = _swap_in(task, position, options, pool, rng, "opposite_function", "of")
        if swapped is not None:
            return swapped
    return None


def written_as_call(task: Task, trace: CallTrace, rng: random.Random) -> Labelled | None:
    """The request replaced by what synthesis wrote in default runs: a call and its result
    (``get_exchange_rate({...}) -> {...}``), or a function name with a "Details:" clause."""
    if not trace.calls:
        return None
    first = trace.calls[0]
    if rng.random() < 0.5:
        observation = " ".join(first.observation.split())[:80]
        request = f"{call_text(first.call)} -> {observation}"
    else:
        arguments = list(first.call.arguments.items())
        request = f"{first.call.name} {details_clause(arguments)}" if arguments else first.call.name
    corrupted = msgspec.structs.replace(task, id=f"{task.id}~wc", user_turns=[request])
    return Labelled(corrupted, "written_as_call", task.id, request[:60])


def about_the_call(task: Task, trace: CallTrace, rng: random.Random) -> Labelled | None:
    """The request replaced by what synthesis wrote in a default run: a question about the
    call (``What does this call do? Details: ...``), or the request told as what the
    assistant must do."""
    if not trace.calls:
        return None
    first = trace.calls[0]
    if rng.random() < 0.5:
        arguments = list(first.call.arguments.items())
        question = "What does this call do?"
        request = f"{question} {details_clause(arguments)}" if arguments else question
    else:
        request = f"To do this, the assistant needs to act on the request: {task.user_turns[0]}"
    corrupted = msgspec.structs.replace(task, id=f"{task.id}~ac", user_turns=[request])
    return Labelled(corrupted, "about_the_call", task.id, request[:60])


def template_request(task: Task, trace: CallTrace, rng: random.Random) -> Labelled | None:
    """The request replaced by the template default runs accepted, made from the turn's own
    calls: each function's name in words, a colon and its description ("delete message:
    Delete the latest message sent to a receiver."), then, half of the time, a "Details:"
    list of the calls' argument values as the abstractor appends it."""
    from coevolve.shared.wording import name_words

    if not trace.calls:
        return None
    described = {
        str(tool.get("function", tool).get("name", "")): " ".join(tool_description(tool).split())
        for tool in trace.tools
    }
    functions = list(dict.fromkeys(c.call.name for c in trace.calls))
    sentences = []
    for function in functions:
        description = described.get(function, "").strip()
        if description and description[-1] not in ".!?":
            description += "."
        sentences.append(f"{' '.join(name_words(function))}: {description}".strip())
    request = " ".join(sentences)
    arguments = [item for c in trace.calls for item in c.call.arguments.items()]
    if arguments and rng.random() < 0.5:
        request = f"{request} {details_clause(arguments)}"
    corrupted = msgspec.structs.replace(task, id=f"{task.id}~tr", user_turns=[request])
    return Labelled(corrupted, "template_request", task.id, request[:60])


def unused_value(
    task: Task, pool: dict[tuple[str, str], list[Any]], rng: random.Random
) -> Labelled | None:
    """The request with one more sentence naming a string value (another function's
    argument elsewhere in BFCL) that no call uses."""
    used = {str(v) for call in task.ground_truth[0] for v in call.arguments.values()}
    request = task.user_turns[0]
    candidates = sorted(
        {
            value
            for values in pool.values()
            for value in values
            if isinstance(value, str)
            and 3 <= len(value) <= 30
            and value not in used
            and value.lower() not in request.lower()
        }
    )
    if not candidates:
        return None
    value = rng.choice(candidates)
    corrupted = msgspec.structs.replace(
        task, id=f"{task.id}~uv", user_turns=[f"{request.rstrip()} Use '{value}' for it."]
    )
    return Labelled(corrupted, "unused_value", task.id, f"names {value!r}")


def _literals(value: Any) -> list[Any]:
    """The distinct strings and numbers (not booleans) in ``value``, in order."""
    found = [v for v in scalars(value) if isinstance(v, str | int | float)]
    return list(dict.fromkeys(v for v in found if not isinstance(v, bool)))


def _runs(task: Task, calls: Sequence[ToolCall], make_env: Callable[[], Environment]) -> bool:
    """Whether every call runs without an error from the task's start state."""
    environment = make_env()
    try:
        environment.reset(task)
        return all(environment.execute(call)[0] for call in calls)
    finally:
        environment.close()


def role_swap(
    task: Task,
    pool: dict[tuple[str, str], list[Any]],
    rng: random.Random,
    make_env: Callable[[], Environment] = _make_env,
) -> Labelled | None:
    """A substitution child whose new value took another party's place: a string the
    request writes and a call passes (old) swapped in the calls for a new one written
    alike, and in the request another value written alike replaced by the new one; the
    lineage holds the request and the swap, as the abstractor's lineage does. The new
    value is one the turn does not use, and the calls run with it, as a substitution's must:
    tried in turn (``ROLE_SWAP_TRIES``), what the parameter takes in ``pool`` and the
    start state holds first, then what the state holds, then ``pool``. None when the
    request writes no two values of one shape of which a call passes one, or no new
    value runs."""
    request = task.user_turns[0]
    calls = task.ground_truth[0]
    passed = _literals([call.arguments for call in calls])
    written = written_values(request)
    # parties: ids, symbols, names of files and folders (the values an edit replaces)
    pairs = [
        (old, other)
        for old in passed
        if isinstance(old, str) and old in written
        for other in written
        if other != old and shape(other) == shape(old) and writes(request, other)
    ]
    if not pairs:
        return None
    old, other = rng.choice(pairs)
    used = {str(v) for v in passed} | set(written)

    def fits(value: Any) -> bool:
        fresh = str(value) not in used and not writes(request, value)
        return isinstance(value, str) and shape(value) == shape(old) and fresh

    environment = make_env()
    try:
        environment.reset(task)
        state = state_of(environment)
    finally:
        environment.close()
    slots = {
        (call.name, parameter)
        for call in calls
        for parameter, argument in call.arguments.items()
        if old in _literals(argument)
    }
    for_parameter = {v for slot in slots for v in pool.get(slot, []) if fits(v)}
    in_state = {v for v in _literals(state) if fits(v)}
    anywhere = {v for values in pool.values() for v in values if fits(v)}
    options: list[Any] = []
    for tier in (for_parameter & in_state, in_state, for_parameter, anywhere):
        ordered = sorted(tier - set(options), key=str)
        rng.shuffle(ordered)
        options.extend(ordered)

    def swapped(new: Any) -> list[ToolCall]:
        return [ToolCall(name=c.name, arguments=substituted(c.arguments, old, new)) for c in calls]

    tried = options[:ROLE_SWAP_TRIES]
    new = next((value for value in tried if _runs(task, swapped(value), make_env)), None)
    if new is None:
        return None
    lineage = msgspec.structs.replace(task.lineage, parent_request=request, replaced=[old, new])
    written_new = str(new)
    corrupted = msgspec.structs.replace(
        _with_calls(task, swapped(new), "rs"),
        user_turns=[mention(other).sub(lambda _: written_new, request)],
        lineage=lineage,
    )
    note = f"{old!r} -> {new!r} in the calls, {other!r} -> {new!r} in the request"
    return Labelled(corrupted, "role_swap", task.id, note)


def _other_value(value: Any, values: Sequence[Any], rng: random.Random) -> Any | None:
    others = [v for v in values if type(v) is type(value) and v != value]
    if others:
        return rng.choice(others)
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value * 2 + 3
    if isinstance(value, float):
        return round(value * 1.5 + 2.5, 2)
    return None


def wrong_argument(
    task: Task, pool: dict[tuple[str, str], list[Any]], rng: random.Random
) -> Labelled | None:
    """One literal (string or number) argument replaced by another value BFCL passes to
    that parameter (a changed number when it has none)."""
    calls = task.ground_truth[0]
    slots = [
        (position, name)
        for position, call in enumerate(calls)
        for name, value in call.arguments.items()
        if isinstance(value, str | int | float) and not isinstance(value, bool)
    ]
    rng.shuffle(slots)
    for position, name in slots:
        call = calls[position]
        value = call.arguments[name]
        replacement = _other_value(value, pool.get((call.name, name), []), rng)
        if replacement is None:
            continue
        changed = ToolCall(name=call.name, arguments={**call.arguments, name: replacement})
        corrupted = [*calls[:position], changed, *calls[position + 1 :]]
        note = f"{call.name}.{name}: {value!r} -> {replacement!r}"
        return Labelled(_with_calls(task, corrupted, "wa"), "wrong_argument", task.id, note)
    return None


def dropped_call(task: Task, trace: CallTrace, rng: random.Random) -> Labelled | None:
    """One state-changing call of the turn left out."""
    changing = [c for c in trace.calls if c.changed_state]
    if not changing:
        return None
    dropped = rng.choice(changing)
    calls = [c for i, c in enumerate(task.ground_truth[0]) if i != dropped.index]
    note = f"dropped {dropped.call.name}"
    return Labelled(_with_calls(task, calls, "dc"), "dropped_call", task.id, note)


def redundant_call(task: Task, trace: CallTrace, rng: random.Random) -> Labelled | None:
    """One state-changing call made twice in a row (an idempotent one leaves the first
    without effect on the final state)."""
    changing = [c for c in trace.calls if c.changed_state]
    if not changing:
        return None
    doubled = rng.choice(changing)
    calls = list(task.ground_truth[0])
    calls.insert(doubled.index + 1, doubled.call)
    note = f"doubled {doubled.call.name}"
    return Labelled(_with_calls(task, calls, "rc"), "redundant_call", task.id, note)


def other_description(task: Task, others: Sequence[Task], rng: random.Random) -> Labelled | None:
    """The user message of another scenario's turn, over the same classes where one
    exists, whose calls share no function with this turn's."""
    used = {c.name for c in task.ground_truth[0]}
    classes = set(task.env_config["involved_classes"])

    def disjoint(other: Task) -> bool:
        return other.source_entry != task.source_entry and not (
            used & {c.name for c in other.ground_truth[0]}
        )

    same = [o for o in others if disjoint(o) and set(o.env_config["involved_classes"]) & classes]
    choices = same or [o for o in others if disjoint(o)]
    if not choices:
        return None
    other = rng.choice(choices)
    corrupted = msgspec.structs.replace(task, id=f"{task.id}~od", user_turns=list(other.user_turns))
    return Labelled(corrupted, "other_description", task.id, f"query of {other.id}")


def labelled_set(
    positives: int | None = None, seed: int = SEED, split: str = "train"
) -> tuple[list[Labelled], dict[str, int]]:
    """Positives (``positives`` of the ``split``'s turns, a seeded sample; all when None)
    and their negatives; with how many of each corruption did not apply."""
    from coevolve.shared.envs.bfcl.tasks import load_tasks, suite_tasks

    rng = random.Random(seed)
    train = suite_tasks("bfcl-turns-base", split)
    chosen = train if positives is None else rng.sample(train, min(positives, len(train)))
    pool = value_pool(load_tasks("multi_turn_base"))
    items: list[Labelled] = []
    skipped: Counter[str] = Counter()
    for task in chosen:
        items.append(Labelled(task, "positive", task.id))
        trace = trace_calls(task, _make_env)
        made = {
            "wrong_function": wrong_function(task, pool, rng),
            "wrong_argument": wrong_argument(task, pool, rng),
            "dropped_call": dropped_call(task, trace, rng),
            "other_description": other_description(task, train, rng),
            "written_as_call": written_as_call(task, trace, rng),
            "opposite_function": opposite_function(task, pool, rng),
            "unused_value": unused_value(task, pool, rng),
            "redundant_call": redundant_call(task, trace, rng),
            # its own generator, so the kinds above draw what they drew before it existed
            "about_the_call": about_the_call(task, trace, random.Random(f"{seed}:{task.id}")),
            "template_request": template_request(
                task, trace, random.Random(f"{seed}:template:{task.id}")
            ),
            "role_swap": role_swap(task, pool, random.Random(f"{seed}:role_swap:{task.id}")),
        }
        for kind, negative in made.items():
            if negative is None:
                skipped[kind] += 1
            else:
                items.append(negative)
    return items, dict(skipped)


# --------------------------------------------------------------------------- evaluation


@dataclass
class Outcome:
    """What each stage said about one candidate (None: not run, an earlier stage failed)."""

    item: Labelled
    passed: dict[str, bool | None] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    reasons: list[str] = field(default_factory=list)
    llm_sampled: bool = False  # the LLM stages were run on it (if it got that far)
    intent_score: float = 1.0  # check_intent's score (1.0 where it was skipped)


def _timed(outcome: Outcome, stage: str, work: Callable[[], bool]) -> bool:
    started = time.perf_counter()
    ok = work()
    outcome.seconds[stage] = time.perf_counter() - started
    outcome.passed[stage] = ok
    return ok


def deterministic_stages(item: Labelled, backend: str) -> Outcome:
    """Replay, minimality, relevance on one candidate; every check runs, even after a
    failure (its standalone catch is reported too)."""
    outcome = Outcome(item)
    task = item.task

    def replay() -> bool:
        check = replay_candidate(task, _make_env)
        outcome.reasons.extend(check.problems())
        return check.passed

    _timed(outcome, "replay", replay)
    started = time.perf_counter()
    trace = trace_calls(task, _make_env)
    trace_s = time.perf_counter() - started

    def minimal() -> bool:
        result = check_minimality(task, _make_env, trace)
        outcome.reasons.extend(result.reasons)
        return result.passed

    def relevant() -> bool:
        results = (
            check_plain_request(task, trace),
            check_not_template(task, trace),
            check_real_values(task, trace),
            check_same_action(task, trace),
            check_keeps_roles(task),
            check_arguments_named(task, trace),
            check_description_covered(task, trace),
            check_intent(task, trace, backend),  # type: ignore[arg-type]
        )
        outcome.intent_score = float(results[-1].details.get("intent_score", 1.0))
        for result in results:
            outcome.passed[result.name] = result.passed
            outcome.reasons.extend(result.reasons)
        return all(result.passed for result in results)

    _timed(outcome, "minimality", minimal)
    _timed(outcome, "relevance", relevant)
    outcome.seconds["minimality"] += trace_s / 2
    outcome.seconds["relevance"] += trace_s / 2
    return outcome


# the judge's semantic criteria but minimality (a stage of its own here) and
# exercises_failure (a labelled turn comes from no signal's failure)
RELEVANCE_CHECKS = tuple(
    name for name in SEMANTIC_CRITERIA if name not in ("exercises_failure", "minimal")
)
# the intent threshold is fitted on one half: the largest on this grid at which this share
# of its sound turns pass the deterministic stages (the 0.8 target, with a margin)
INTENT_GRID = tuple(round(0.5 + 0.05 * i, 2) for i in range(10))
FIT_MIN_ACCEPT = 0.82


def with_intent_threshold(outcome: Outcome, threshold: float) -> Outcome:
    """``outcome`` as the relevance stage would have judged it at this intent threshold."""
    passed = dict(outcome.passed)
    passed["intent_matches"] = outcome.intent_score >= threshold
    passed["relevance"] = all(passed.get(name) for name in RELEVANCE_CHECKS)
    return replace(outcome, passed=passed)


def fit_intent_threshold(outcomes: Sequence[Outcome], min_accept: float = FIT_MIN_ACCEPT) -> float:
    """The largest threshold of ``INTENT_GRID`` at which ``min_accept`` of the positives
    among ``outcomes`` pass the deterministic stages (the smallest when none does)."""
    positives = [o for o in outcomes if o.item.positive]
    for threshold in sorted(INTENT_GRID, reverse=True):
        passing = sum(deterministic_pass(with_intent_threshold(o, threshold)) for o in positives)
        if positives and passing / len(positives) >= min_accept:
            return threshold
    return min(INTENT_GRID)


def deterministic_pass(outcome: Outcome) -> bool:
    return all(outcome.passed.get(s) for s in DETERMINISTIC)


async def llm_stages(outcomes: Sequence[Outcome], llm: Any, max_tokens: int) -> None:
    """Round trip and the LLM judge on the candidates that pass the deterministic
    stages (the others never reach them)."""
    from coevolve.services.judge.handler import ask_judgment, judgment_outcome
    from coevolve.services.judge.roundtrip import round_trip
    from coevolve.shared.structured import RejectionCounter

    counter = RejectionCounter()
    for outcome in outcomes:
        if not deterministic_pass(outcome):
            continue
        task = outcome.item.task
        started = time.perf_counter()
        trip = await round_trip(llm, task, _make_env)
        outcome.seconds["round_trip"] = time.perf_counter() - started
        outcome.passed["round_trip"] = trip.passed
        outcome.reasons.extend(trip.reasons)
        started = time.perf_counter()
        check = await asyncio.to_thread(replay_candidate, task, _make_env)
        judged = await ask_judgment(llm, task, check, max_tokens, counter)
        accepted, reasons, _, _ = judgment_outcome(judged)
        outcome.seconds["llm_judge"] = time.perf_counter() - started
        outcome.passed["llm_judge"] = accepted
        if not accepted:
            outcome.reasons.extend(reasons)


def stage_accepts(outcome: Outcome, stage: str) -> bool | None:
    """Whether the pipeline up to ``stage`` accepts; None when it was not measured."""
    if stage not in STAGES[:3] and not outcome.llm_sampled:
        return None
    for name in PIPELINES[stage]:
        value = outcome.passed.get(name)
        if value is False:
            return False
        if value is None:
            return None
    return True


def stage_seconds(outcome: Outcome, stage: str) -> float:
    # a pipeline stops at the first failed stage: later ones cost nothing
    total = 0.0
    for name in PIPELINES[stage]:
        total += outcome.seconds.get(name, 0.0)
        if outcome.passed.get(name) is False:
            break
    return total


def summarize(outcomes: Sequence[Outcome], stage: str) -> dict[str, Any]:
    """Accept rate of positives, reject rate of negatives (all and per corruption) and
    seconds per candidate of the pipeline up to ``stage``, over the candidates where it
    was measured."""
    measured: list[tuple[Outcome, bool]] = []
    for o in outcomes:
        accepted = stage_accepts(o, stage)
        if accepted is not None:
            measured.append((o, accepted))
    positives = [a for o, a in measured if o.item.positive]
    negatives = [(o.item.kind, a) for o, a in measured if not o.item.positive]
    counted = [(k, a) for k, a in negatives if k in CORRUPTIONS]
    row: dict[str, Any] = {
        "positives": len(positives),
        "negatives": len(counted),
        "accept_rate_positive": _rate(sum(positives), len(positives)),
        "reject_rate_negative": _rate(sum(not a for _, a in counted), len(counted)),
        "reject_rate_by_corruption": {},
        "seconds_per_candidate": round(
            sum(stage_seconds(o, stage) for o, _ in measured) / max(len(measured), 1), 4
        ),
    }
    for kind in ALL_CORRUPTIONS:
        of_kind = [a for k, a in negatives if k == kind]
        row["reject_rate_by_corruption"][kind] = _rate(sum(not a for a in of_kind), len(of_kind))
    return row


def standalone(outcomes: Sequence[Outcome]) -> dict[str, dict[str, float | None]]:
    """Per check, the share of each kind of candidate it rejects on its own."""
    checks = ("replay", "minimality", *RELEVANCE_CHECKS, "round_trip", "llm_judge")
    kinds = ("positive", *ALL_CORRUPTIONS)
    table: dict[str, dict[str, float | None]] = {}
    for check in checks:
        table[check] = {}
        for kind in kinds:
            values = [
                o.passed[check]
                for o in outcomes
                if o.item.kind == kind and o.passed.get(check) is not None
            ]
            table[check][kind] = _rate(sum(not v for v in values), len(values))
    return table


def _mean(values: Sequence[float]) -> float | None:
    return round(sum(values) / len(values), 2) if values else None


def _rate(count: int, total: int) -> float | None:
    return round(count / total, 3) if total else None


# --------------------------------------------------------------------------- run


async def _with_llm(outcomes: Sequence[Outcome], run_dir: Path, max_tokens: int) -> None:
    from coevolve.bench.local_llm import served_roles
    from coevolve.shared.llm.server import ServerSettings

    settings = ServerSettings(n_threads=1, n_ctx=8192)
    greedy = {"default": {"temperature": 0.0}}
    async with served_roles(settings, ("judge",), run_dir, greedy) as llms:
        await llm_stages(outcomes, llms["judge"], max_tokens)


def run(quick: bool) -> dict[str, Any]:
    from coevolve.services.judge.config import JudgeConfig
    from coevolve.shared.similarity import embedding_available

    config = JudgeConfig()
    backend = config.relevance_backend
    if backend == "auto":
        backend = "embedding" if embedding_available() else "ngram"
    started = time.perf_counter()
    items, skipped = labelled_set(QUICK_POSITIVES if quick else None)
    build_s = time.perf_counter() - started
    outcomes = [deterministic_stages(item, backend) for item in items]
    llm_count = QUICK_LLM_POSITIVES if quick else FULL_LLM_POSITIVES
    sample_ids = {
        o.item.source_id
        for o in random.Random(SEED).sample(
            [o for o in outcomes if o.item.positive],
            min(llm_count, sum(o.item.positive for o in outcomes)),
        )
    }
    sampled = [o for o in outcomes if o.item.source_id in sample_ids]
    for outcome in sampled:
        outcome.llm_sampled = True
    with tempfile.TemporaryDirectory(prefix="coevolve-bench-judge-") as tmp:
        asyncio.run(_with_llm(sampled, Path(tmp), config.max_tokens))
    counts = Counter(o.item.kind for o in outcomes)
    report: dict[str, Any] = {
        "benchmark": "judge",
        "quick": quick,
        "suite": "bfcl-turns-base (train split)",
        "relevance_backend": backend,
        "candidates": len(outcomes),
        "by_kind": {kind: counts.get(kind, 0) for kind in ("positive", *ALL_CORRUPTIONS)},
        "corruption_not_applicable": skipped,
        "llm_sample_positives": len(sample_ids),
        "llm_sample_candidates": len(sampled),
        "build_seconds": round(build_s, 2),
        "stages": {stage: summarize(outcomes, stage) for stage in STAGES},
        "stages_on_llm_sample": {stage: summarize(sampled, stage) for stage in STAGES},
        "standalone_reject_rate": standalone(outcomes),
        "llm_seconds_per_call": {
            stage: _mean([o.seconds[stage] for o in sampled if stage in o.seconds])
            for stage in ("round_trip", "llm_judge")
        },
        "target": {"reject_rate_negative": 0.9, "accept_rate_positive": 0.8},
    }
    # the intent threshold is fitted on the train split's turns (above); the eval split's
    # turns and their corruptions are the half it never saw
    fitted = fit_intent_threshold(outcomes)
    heldout_items, heldout_skipped = labelled_set(QUICK_POSITIVES if quick else None, split="eval")
    heldout_outcomes = [deterministic_stages(i, backend) for i in heldout_items]
    heldout = summarize([with_intent_threshold(o, fitted) for o in heldout_outcomes], "+relevance")
    report["intent_threshold"] = {
        "fitted_on_train": fitted,
        "configured": MIN_INTENT_SCORE.get(backend),
        "fit_min_accept": FIT_MIN_ACCEPT,
    }
    report["heldout"] = {
        "suite": "bfcl-turns-base (eval split)",
        "stage": "+relevance",
        "intent_threshold": fitted,
        "corruption_not_applicable": heldout_skipped,
        **heldout,
    }
    report["accept_rate_positive_heldout"] = heldout["accept_rate_positive"]
    report["reject_rate_negative_heldout"] = heldout["reject_rate_negative"]
    full = report["stages"]["+llm_judge"]
    report["target_met"] = bool(
        full["reject_rate_negative"] is not None
        and full["accept_rate_positive"] is not None
        and full["reject_rate_negative"] >= 0.9
        and full["accept_rate_positive"] >= 0.8
    )
    report["rejected_positives"] = [
        {"id": o.item.task.id, "reasons": o.reasons[:3]}
        for o in outcomes
        if o.item.positive and not all(v for v in o.passed.values() if v is not None)
    ][:40]
    print_table(report)
    return report


def print_table(report: dict[str, Any]) -> None:
    def pct(value: float | None) -> str:
        return "-" if value is None else f"{value:.0%}"

    kinds = tuple({**CORRUPTIONS, **EXTRA_CORRUPTIONS}.values())
    for key, title in (
        ("stages", "all candidates"),
        ("stages_on_llm_sample", f"LLM sample ({report['llm_sample_candidates']} candidates)"),
    ):
        tables.print_table(
            f"judge stages, {title}, {report['relevance_backend']} relevance",
            ("stage", "pos", "neg", "accept pos", "reject neg", *kinds, "s/cand"),
            [
                (
                    stage,
                    row["positives"],
                    row["negatives"],
                    pct(row["accept_rate_positive"]),
                    pct(row["reject_rate_negative"]),
                    *(pct(row["reject_rate_by_corruption"][k]) for k in ALL_CORRUPTIONS),
                    f"{row['seconds_per_candidate']:.3f}",
                )
                for stage, row in report[key].items()
            ],
        )
    heldout = report["heldout"]
    tables.print_table(
        "each check on its own: share rejected",
        ("check", "positive", *kinds),
        [
            (check, *(pct(row[k]) for k in ("positive", *ALL_CORRUPTIONS)))
            for check, row in report["standalone_reject_rate"].items()
        ],
        note="LLM seconds per call (candidates that reached it): "
        f"{report['llm_seconds_per_call']}\n"
        f"held out ({heldout['suite']}, intent threshold {heldout['intent_threshold']} fitted "
        f"on the train split): accept {pct(heldout['accept_rate_positive'])} of "
        f"{heldout['positives']} sound turns, reject {pct(heldout['reject_rate_negative'])} "
        f"of {heldout['negatives']} corrupted",
    )
