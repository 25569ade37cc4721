"""The judge's deterministic semantic checks: minimality and description relevance.

They run after the replay (``replay.py``) and before any LLM, each a verdict criterion:

- ``names_arguments``: the task's text names (or an earlier call returned) the salient
  literal arguments of its calls (``shared.argument_values.is_salient``, :func:`names`);
- ``covers_description``: what the request quotes and the numbers it writes are used by
  the calls (or shown by them);
- ``minimal``: dropping any single state-changing call from the ground truth changes the
  final environment state; a call whose removal leaves the final state as it was is
  redundant and the candidate is rejected naming it;
- ``exercises_failure``: when the task's lineage names target functions (what the policy
  got wrong in the parent turn), its calls include one of them; always run, cheapest;
- ``plain_request``: no request carries call syntax (a call, a JSON object, a function's
  identifier) or a log line (``shared/wording.py``);
- ``not_template``: no request is a template filled from a function's documentation: a
  "Details:" list of values, a function's name and a colon opening it, a tool's
  description copied, a "key value; key value" list (``shared/wording.py``);
- ``same_action``: no request asks for the opposite of its calls ("remove" for
  ``add_to_watchlist``) or names another function instead of its own ("check tire
  pressure" for ``adjustClimateControl``; ``shared/wording.py``);
- ``keeps_roles``: a substitution child (``lineage.parent_request`` and
  ``lineage.replaced``) writes its new value where its parent wrote the old one, not in
  another party's place ("I (user id USR004) ..." where the parent's sender was
  ``USR001`` and the swap replaced the receiver ``USR002``; ``shared/value_roles.py``);
- ``intent_matches``: the request, without the "Details:" clause code appended to it, is
  closer to the functions it calls (name and description) than to most other functions
  the environment offers (all-MiniLM-L6-v2 embeddings, or the n-gram cosine without the
  model; ``coevolve.shared.similarity``).

``names_arguments`` and ``intent_matches`` read the user turns alone, what the policy is
asked: a task's description, which no policy sees, cannot make up for its request.

They share one traced run of the calls (:func:`trace_calls`): the state before and after
each call, what it returned, what the conversation showed before the first one, and the
functions offered. "State" is what the environment's ``state()`` returns (for BFCL, the
API instances' public attributes, what BFCL's state checker compares).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from coevolve.shared.argument_values import salient_values, scalars
from coevolve.shared.envs import Environment, state_of
from coevolve.shared.messages import Task, ToolCall
from coevolve.shared.similarity import Backend, NearDuplicateIndex
from coevolve.shared.value_roles import role_problems
from coevolve.shared.wording import (
    call_syntax,
    opposite_action,
    other_function_named,
    template_request,
    without_details,
)

# The criteria semantic_checks reports, in its order (all checks enabled).
SEMANTIC_CRITERIA: tuple[str, ...] = (
    "exercises_failure",
    "plain_request",
    "not_template",
    "real_values",
    "same_action",
    "keeps_roles",
    "names_arguments",
    "covers_description",
    "minimal",
    "intent_matches",
)

# What ends a turn in a traced run: an assistant message without a tool call.
END_OF_TURN = "Done."

# A string argument longer than this (characters or words) is free text (a message, a
# tweet, a file's content): a description may paraphrase it, so it counts as named when
# this share of its words appears.
MAX_SALIENT_CHARS = 40
MAX_SALIENT_WORDS = 5
MIN_FREE_TEXT_SHARE = 0.5

# Thresholds are fitted on the train-split turns of bfcl-turns-base and their corruptions
# (bench/judge.py) and measured on the eval-split turns they never saw; the rates are in
# docs/judge.md.
#
# ``names_arguments``: at most MAX_UNNAMED salient values neither named nor returned
# earlier, and at least MIN_NAMED_SHARE of them named (most unnamed values in sound turns
# are derived: an airport code for a city, an amount computed from the state, an id
# looked up).
MAX_UNNAMED = 1
MIN_NAMED_SHARE = 0.5

# ``intent_matches``: per called function, the share of the environment's other functions
# less similar to the task's text; the mean of the better half of those (intent_score)
# must reach this, per similarity backend. Embedding: the largest threshold at which the
# train half's sound turns pass the whole judge at least 82% of the time.
MIN_INTENT_SCORE: dict[str, float] = {"embedding": 0.80, "ngram": 0.75}

# ``covers_description``: at most this many quoted literals of the request, and this many
# numbers it writes (other than 0, 1 and years), may go unused.
MAX_UNCOVERED = 0
MAX_UNUSED_NUMBERS = 1

_MONTHS: tuple[str, ...] = (
    "january",
    "february",
    "march",
    "april",
    "may",
    "june",
    "july",
    "august",
    "september",
    "october",
    "november",
    "december",
)
_WORD = re.compile(r"[a-z0-9]+")
_NUMBER = re.compile(r"\d[\d,]*(?:\.\d+)?")
# a number standing alone in a request ("100 shares", "$700"), not part of a name
_REQUEST_NUMBER = re.compile(r"(?<![\w.])\$?(\d[\d,]*(?:\.\d+)?)(?!\w)")
_ISO_DATE = re.compile(r"^(\d{4})-(\d{2})-(\d{2})$")
_ENUM_IN_TEXT = re.compile(r"\[Enum\]:\s*(\[[^\]]*\])")
_CODE = re.compile(r"^[A-Z]{3,5}$")
# a template's blank left in a value ("your_username", "YOUR_CLIENT_ID", "<city>",
# "placeholder", "xxx"): none of BFCL's multi-turn ground-truth values is one
_PLACEHOLDER = re.compile(r"^your[_\s-]|^<[^<>]+>$|placeholder|^x{3,}$|^(?:todo|tbd)$", re.I)
_FILE_NAME = re.compile(r"^[\w.-]+\.[A-Za-z0-9]{1,5}$")
# a quoted literal in a request: 'x' or "x" (not an apostrophe inside a word)
_QUOTED = re.compile(r"(?:^|(?<=[\s(\[:,]))['\"‘“]([^'\"’”\n]{2,40}?)['\"’”](?=$|[\s.,;:!?)\]])")


@dataclass(frozen=True)
class CheckResult:
    """One check's outcome: its criterion name, whether it holds, and why not."""

    name: str
    passed: bool
    reasons: list[str] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class TracedCall:
    turn: int
    index: int  # position in its turn
    call: ToolCall
    ok: bool
    observation: str
    changed_state: bool


@dataclass
class CallTrace:
    """The ground truth run call by call from the task's initial state.

    ``final_state`` is None when the environment exposes no ``state()``.
    """

    context: list[tuple[str, str]]  # (role, content) of the conversation before the calls
    calls: list[TracedCall]
    final_state: dict[str, Any] | None
    tools: list[dict[str, Any]]


def call_text(call: ToolCall) -> str:
    return f"{call.name}({json.dumps(call.arguments, ensure_ascii=False, sort_keys=True)})"


def _run(
    environment: Environment,
    task: Task,
    ground_truth: Sequence[Sequence[ToolCall]],
    trace: bool,
) -> tuple[list[TracedCall], list[tuple[str, str]], list[dict[str, Any]]]:
    """Reset, run ``ground_truth`` turn by turn (each call its own step), end every turn.
    Returns the traced calls (state compared around each only when ``trace``), the
    context messages and the tools offered at the start."""
    messages = environment.reset(task)
    context: list[tuple[str, str]] = [(m.role, m.content) for m in messages]
    tools = environment.tools()
    traced: list[TracedCall] = []
    for turn, calls in enumerate(ground_truth):
        for index, call in enumerate(calls):
            before = state_of(environment) if trace else None
            ok, observation = environment.execute(call)
            changed = trace and before is not None and state_of(environment) != before
            traced.append(TracedCall(turn, index, call, ok, observation, changed))
        environment.step(END_OF_TURN)
    return traced, context, tools


def trace_calls(task: Task, make_env: Callable[[], Environment]) -> CallTrace:
    """Run ``task.ground_truth`` in a fresh environment, recording each call. Blocking."""
    environment = make_env()
    try:
        calls, context, tools = _run(environment, task, task.ground_truth, trace=True)
        final = state_of(environment)
    finally:
        environment.close()
    return CallTrace(context=context, calls=calls, final_state=final, tools=tools)


def final_state_without(
    task: Task, make_env: Callable[[], Environment], dropped: TracedCall
) -> dict[str, Any] | None:
    """The final state when ``dropped`` is left out of the ground truth."""
    ground_truth = [
        [c for i, c in enumerate(calls) if (turn, i) != (dropped.turn, dropped.index)]
        for turn, calls in enumerate(task.ground_truth)
    ]
    environment = make_env()
    try:
        _run(environment, task, ground_truth, trace=False)
        return state_of(environment)
    finally:
        environment.close()


# --------------------------------------------------------------------------- minimality


def check_minimality(
    task: Task, make_env: Callable[[], Environment], trace: CallTrace | None = None
) -> CheckResult:
    """Every state-changing call is needed: leaving out any one of them changes the final
    state. Passes (with ``skipped`` in details) when the environment has no ``state()``."""
    trace = trace or trace_calls(task, make_env)
    if trace.final_state is None:
        return CheckResult("minimal", True, details={"skipped": "environment has no state()"})
    changing = [c for c in trace.calls if c.changed_state]
    redundant = [c for c in changing if final_state_without(task, make_env, c) == trace.final_state]
    reasons = [
        f"redundant call: turn {c.turn + 1} call {c.index + 1} {call_text(c.call)} "
        "(the final state is the same without it)"
        for c in redundant
    ]
    details = {"state_changing_calls": len(changing), "redundant_calls": len(redundant)}
    return CheckResult("minimal", not redundant, reasons, details)


# --------------------------------------------------------------------------- relevance


def is_free_text(value: str) -> bool:
    """Longer than ``MAX_SALIENT_CHARS`` characters or ``MAX_SALIENT_WORDS`` words: a
    message, a tweet, a file's content, which a request may quote or paraphrase."""
    text = value.strip()
    return len(text) > MAX_SALIENT_CHARS or len(text.split()) > MAX_SALIENT_WORDS


def enum_options(tools: Sequence[Mapping[str, Any]]) -> dict[tuple[str, str], list[str]]:
    """(function, parameter) -> the values its schema allows: a JSON-schema ``enum`` (also
    of array items) or BFCL's ``[Enum]: [...]`` in the parameter's description."""
    options: dict[tuple[str, str], list[str]] = {}
    for tool in tools:
        function = tool.get("function", tool)
        properties = (function.get("parameters") or {}).get("properties") or {}
        for parameter, spec in properties.items():
            if not isinstance(spec, Mapping):
                continue
            items = spec.get("items") if isinstance(spec.get("items"), Mapping) else {}
            allowed = spec.get("enum") or (items or {}).get("enum")
            if not allowed:
                found = _ENUM_IN_TEXT.search(str(spec.get("description", "")))
                if found:
                    try:
                        allowed = json.loads(found.group(1))
                    except ValueError:
                        allowed = None
            if isinstance(allowed, list) and allowed:
                options[(str(function.get("name")), parameter)] = [str(v) for v in allowed]
    return options


def _words(text: str) -> list[str]:
    return _WORD.findall(text.lower())


def _stem(word: str) -> str:
    return word[:-1] if len(word) > 3 and word.endswith("s") else word


def _subsequence(short: str, long: str) -> bool:
    letters = iter(long)
    return all(letter in letters for letter in short)


class TextIndex:
    """What a text names, for :func:`names`: its words (and their stems), its word
    sequence, and the numbers it writes."""

    def __init__(self, text: str) -> None:
        words = _words(text)
        self.words = words
        self.joined = f" {' '.join(words)} "
        self.stems = {_stem(w) for w in words}
        self.numbers = set()
        for raw in _NUMBER.findall(text):
            try:
                self.numbers.add(float(raw.replace(",", "")))
            except ValueError:
                continue


def abbreviates(index: TextIndex, code: str) -> bool:
    """Whether a code (a ticker, an airport) abbreviates a name in the text: its letters in
    order within one word or two adjacent ones, the first letter starting the name
    (``nvda``: Nvidia, ``sfo``: San Francisco)."""
    words = index.words
    for position, word in enumerate(words):
        if not word.startswith(code[0]):
            continue
        if _subsequence(code, word):
            return True
        if position + 1 < len(words) and _subsequence(code, word + words[position + 1]):
            return True
    return False


def names(index: TextIndex, value: Any) -> bool:
    """Whether the indexed text names ``value``: a number written with the same value, a
    string whose words appear in order (or, failing that, each word or its stem anywhere;
    a file name also without its extension), free text when ``MIN_FREE_TEXT_SHARE`` of
    its words (3+ letters) appear, an ISO date also as month name and day, an
    upper-case code also as the name it abbreviates (:func:`abbreviates`)."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value) in index.numbers
    text = str(value)
    date = _ISO_DATE.match(text.strip())
    if date:
        month, day = int(date.group(2)), int(date.group(3))
        if 1 <= month <= 12:
            name = _MONTHS[month - 1]
            month_named = _stem(name) in index.stems or name[:3] in index.stems
            day_named = float(day) in index.numbers
            if month_named and day_named:
                return True
    words = _words(text)
    if not words:
        return True
    if f" {' '.join(words)} " in index.joined:
        return True
    if is_free_text(text):
        content = {_stem(w) for w in words if len(w) >= 3}
        return not content or len(content & index.stems) / len(content) >= MIN_FREE_TEXT_SHARE
    if _CODE.match(text.strip()) and abbreviates(index, text.strip().lower()):
        return True
    if _FILE_NAME.match(text.strip()):
        words = words[:-1]  # a file name, also without its extension
    return all(_stem(w) in index.stems for w in words)


def check_arguments_named(task: Task, trace: CallTrace) -> CheckResult:
    """The task's text names its calls' salient argument values.

    A value an earlier call returned (or the conversation showed) counts as named. A value
    of an enumerated parameter ("all doors", "in START mode") counts only when the text
    names one of its options: then it must be that one.
    """
    text = TextIndex(_request_text(task, with_context=True))
    shown_before = [content for role, content in trace.context if role != "user"]
    enums = enum_options(trace.tools)
    unnamed: list[str] = []
    total = 0
    seen: list[Any] = []
    for position, traced in enumerate(trace.calls):
        earlier = "\n".join([*shown_before, *(c.observation for c in trace.calls[:position])])
        shown = TextIndex(earlier)
        for call, parameter, value in salient_values([traced.call]):
            if value in seen:
                continue
            seen.append(value)
            options = enums.get((call.name, parameter))
            picks_none = options and not any(names(text, option) for option in options)
            if picks_none:
                continue  # an enumerated value the text chooses by meaning, not by name
            total += 1
            if not (names(text, value) or names(shown, value)):
                unnamed.append(f"{call.name}: {value!r}")
    named_share = 1.0 if total == 0 else (total - len(unnamed)) / total
    passed = len(unnamed) <= MAX_UNNAMED and named_share >= MIN_NAMED_SHARE
    reasons = (
        []
        if passed
        else [
            f"the task's text does not name {len(unnamed)} of {total} key argument values: "
            + ", ".join(unnamed[:4])
        ]
    )
    details = {"salient_values": total, "unnamed": len(unnamed), "named_share": named_share}
    return CheckResult("names_arguments", passed, reasons, details)


def _request_text(task: Task, with_context: bool = False, details: bool = True) -> str:
    parts = [turn if details else without_details(turn) for turn in task.user_turns]
    if with_context:
        prior = task.env_config.get("prior_turns") or []
        parts.extend(str(turn) for turn in prior)
    return "\n".join(part for part in parts if part)


def tool_description(tool: Mapping[str, Any]) -> str:
    """What a function does: its compact hint (BFCL: its doc without the per-class
    opening) when it has one, else its description."""
    function = tool.get("function", tool)
    hints = tool.get("compact")
    if isinstance(hints, Mapping) and isinstance(hints.get("description"), str):
        return str(hints["description"])
    return str(function.get("description", ""))


def function_text(tool: Mapping[str, Any]) -> str:
    """A function's name (split into words) and what it does, for similarity."""
    function = tool.get("function", tool)
    name = str(function.get("name", ""))
    words = re.sub(r"([a-z])([A-Z])", r"\1 \2", name).replace("_", " ").lower()
    return f"{words}: {' '.join(tool_description(tool).split())}"


@lru_cache(maxsize=64)
def _function_index(texts: tuple[str, ...], backend: Backend) -> NearDuplicateIndex:
    return NearDuplicateIndex(list(texts), backend=backend)


def intent_percentiles(
    text: str, tools: Sequence[Mapping[str, Any]], used: Sequence[str], backend: Backend
) -> tuple[dict[str, float], str]:
    """For each used function name, the share of the other offered functions less similar
    to ``text`` than it is; and the similarity backend that measured it."""
    names_offered = [str(t.get("function", t).get("name", "")) for t in tools]
    index = _function_index(tuple(function_text(t) for t in tools), backend)
    scores = index.similarities(text)
    out: dict[str, float] = {}
    others = max(len(scores) - 1, 1)
    for name in dict.fromkeys(used):
        if name not in names_offered:
            out[name] = 0.0
            continue
        own = scores[names_offered.index(name)]
        out[name] = sum(1 for s in scores if s < own) / others
    return out, index.backend


def intent_score(percentiles: Mapping[str, float]) -> float:
    """The mean of the better half of the called functions' percentiles: a request names
    what it wants, not every prerequisite (the brake pedal pressed before starting the
    engine, the folder entered before a file is made)."""
    ranked = sorted(percentiles.values(), reverse=True)
    kept = ranked[: (len(ranked) + 1) // 2]
    return sum(kept) / len(kept) if kept else 1.0


def check_intent(task: Task, trace: CallTrace, backend: Backend = "auto") -> CheckResult:
    """The request is closer to the functions it calls than to most other functions
    of its environment (:func:`intent_score` >= ``MIN_INTENT_SCORE`` of the backend)."""
    used = [c.call.name for c in trace.calls]
    if len(trace.tools) < 3 or not used:
        return CheckResult("intent_matches", True, details={"skipped": "too few functions"})
    asked = _request_text(task, details=False)
    percentiles, measured_by = intent_percentiles(asked, trace.tools, used, backend)
    score = intent_score(percentiles)
    threshold = MIN_INTENT_SCORE[measured_by]
    passed = score >= threshold
    reasons = (
        []
        if passed
        else [
            "the task's text is not about the functions it calls (similarity rank "
            f"{score:.2f} < {threshold} by {measured_by}: "
            + ", ".join(f"{n} {p:.2f}" for n, p in percentiles.items())
            + ")"
        ]
    )
    details = {"intent_score": score, "backend": measured_by}
    return CheckResult("intent_matches", passed, reasons, details)


def quoted_literals(text: str) -> list[str]:
    """The literals a request quotes ('notes.txt', "USR002", a message to send)."""
    return [literal.strip() for literal in _QUOTED.findall(text) if literal.strip()]


def request_numbers(text: str) -> list[float]:
    """The numbers a request writes, other than 0, 1 and years."""
    numbers = []
    for raw in _REQUEST_NUMBER.findall(text):
        try:
            value = float(raw.replace(",", ""))
        except ValueError:
            continue
        if value not in (0, 1) and not 1900 <= value <= 2100:
            numbers.append(value)
    return numbers


def check_description_covered(task: Task, trace: CallTrace) -> CheckResult:
    """What the request quotes and the numbers it writes are used: each appears in the
    calls' arguments, in what they returned, or in what the conversation showed before
    them. A request with a file, an id, a message or an amount no call touches asks for
    more than the calls do (a dropped call, another request)."""
    used = TextIndex(
        "\n".join(
            [
                *(json_text(c.call.arguments) for c in trace.calls),
                *(c.observation for c in trace.calls),
                *(content for role, content in trace.context if role != "user"),
            ]
        )
    )
    requests = [task.description, *task.user_turns]
    literals = [q for request in requests for q in quoted_literals(request)]
    missing = [q for q in dict.fromkeys(literals) if not names(used, q)]
    numbers = [n for request in requests for n in request_numbers(request)]
    unused = [n for n in dict.fromkeys(numbers) if n not in used.numbers]
    passed = len(missing) <= MAX_UNCOVERED and len(unused) <= MAX_UNUSED_NUMBERS
    reasons = []
    if not passed:
        what = [repr(q[:60]) for q in missing[:3]] + [f"{n:g}" for n in unused[:3]]
        reasons.append("no call uses what the request names: " + ", ".join(what))
    details = {
        "quoted": len(literals),
        "unused": len(missing),
        "numbers": len(numbers),
        "unused_numbers": len(unused),
    }
    return CheckResult("covers_description", passed, reasons, details)


def offered_names(trace: CallTrace) -> list[str]:
    return [str(tool.get("function", tool).get("name", "")) for tool in trace.tools]


def check_plain_request(task: Task, trace: CallTrace) -> CheckResult:
    """Every request is plain English: no call, JSON object or function identifier."""
    offered = offered_names(trace)
    found = [(turn, call_syntax(request, offered)) for turn, request in enumerate(task.user_turns)]
    syntax = [(turn, found_in) for turn, found_in in found if found_in]
    reasons = [
        f"request {turn} is written as code, not as a user would ask: {', '.join(items[:3])}"
        for turn, items in syntax
    ]
    return CheckResult("plain_request", not syntax, reasons, {"turns_with_syntax": len(syntax)})


def tool_parameters(tools: Sequence[Mapping[str, Any]]) -> list[str]:
    """The parameter names of the offered functions."""
    names_found: list[str] = []
    for tool in tools:
        function = tool.get("function", tool)
        schema = function.get("parameters")
        properties = schema.get("properties") if isinstance(schema, Mapping) else None
        if isinstance(properties, Mapping):
            names_found.extend(str(name) for name in properties)
    return list(dict.fromkeys(names_found))


def check_not_template(task: Task, trace: CallTrace) -> CheckResult:
    """No request is a template made from a function's documentation rather than something
    a user says (``shared.wording.template_request``): a "Details:" list of values (so
    the clause the abstractor appends fails here, though other checks read the request
    without it), a function's name in words and a colon opening it ("delete message:
    ..."), a tool's description copied, a "key value; key value" list."""
    offered = offered_names(trace)
    descriptions = [d for d in (tool_description(t) for t in trace.tools) if d.strip()]
    parameters = tool_parameters(trace.tools)
    reasons = []
    for turn, request in enumerate(task.user_turns):
        why = template_request(request, offered, descriptions, parameters)
        if why is not None:
            reasons.append(f"request {turn} is a template, not what a user says: {why}")
    return CheckResult("not_template", not reasons, reasons, {"template_turns": len(reasons)})


def check_exercises_failure(task: Task) -> CheckResult:
    """A task synthesized from a parent turn the policy failed calls at least one of the
    functions it got wrong (``task.lineage.target_functions``); a task without targets
    (a seed task, an unguided exploration) passes."""
    targets = list(dict.fromkeys(task.lineage.target_functions))
    called = [call.name for calls in task.ground_truth for call in calls]
    if not targets:
        return CheckResult("exercises_failure", True, details={"targets": 0})
    hit = sorted({name for name in called if name in targets})
    reasons = (
        []
        if hit
        else [
            "the calls exercise none of the functions the parent turn failed: targets "
            f"{', '.join(targets)}; calls made {', '.join(called) or 'none'}"
        ]
    )
    return CheckResult(
        "exercises_failure", bool(hit), reasons, {"targets": len(targets), "hit": hit}
    )


def placeholder_values(task: Task) -> list[str]:
    """The ground truth's argument values that are a template's blanks, not real values."""
    return [
        value
        for turn in task.ground_truth
        for call in turn
        for value in scalars(call.arguments)
        if isinstance(value, str) and not is_free_text(value) and _PLACEHOLDER.search(value.strip())
    ]


def check_real_values(task: Task, trace: CallTrace) -> CheckResult:
    """No argument is a placeholder: a user asks with their own values."""
    found = placeholder_values(task)
    reasons = [f"the calls use placeholder values: {', '.join(map(repr, found[:3]))}"]
    return CheckResult("real_values", not found, reasons if found else [])


def check_same_action(task: Task, trace: CallTrace) -> CheckResult:
    """No request asks for the opposite of what its turn's calls do, or names another
    function of its environment instead of its own."""
    offered = offered_names(trace)
    reasons = []
    called_by_turn: dict[int, list[str]] = {}
    for traced in trace.calls:
        if traced.turn >= len(task.user_turns):
            continue
        called_by_turn.setdefault(traced.turn, []).append(traced.call.name)
        said = opposite_action(task.user_turns[traced.turn], traced.call.name, offered)
        if said is not None:
            reasons.append(
                f"request {traced.turn} asks to {said!r} but its call is {traced.call.name}"
            )
    for turn, called in sorted(called_by_turn.items()):
        other = other_function_named(task.user_turns[turn], called, offered)
        if other is not None:
            reasons.append(f"request {turn} names {other} but calls {', '.join(called)}")
    return CheckResult("same_action", not reasons, reasons)


def check_keeps_roles(task: Task) -> CheckResult:
    """A substitution child's new value takes the old value's place in the request, not
    another party's (``shared.value_roles.role_problems``); a task that is no
    substitution child passes."""
    parent_request, replaced = task.lineage.parent_request, task.lineage.replaced
    if parent_request is None or not replaced or len(replaced) != 2 or not task.user_turns:
        return CheckResult("keeps_roles", True, details={"substitution": False})
    old, new = replaced
    calls = [call for turn in task.ground_truth for call in turn]
    reasons = role_problems(parent_request, task.user_turns[0], old, new, calls)
    return CheckResult("keeps_roles", not reasons, reasons, {"substitution": True})


def json_text(value: Any) -> str:
    return " ".join(str(v) for v in scalars(value))


def semantic_checks(
    task: Task,
    make_env: Callable[[], Environment],
    *,
    minimality: bool = True,
    relevance: bool = True,
    backend: Backend = "auto",
) -> list[CheckResult]:
    """The enabled checks, cheapest first, over one traced run (``exercises_failure``
    always, the others as enabled). Blocking (run it in a worker thread); assumes the
    replay passed."""
    results: list[CheckResult] = [check_exercises_failure(task)]
    if not (minimality or relevance):
        return results
    trace = trace_calls(task, make_env)
    if relevance:
        results.append(check_plain_request(task, trace))
        results.append(check_not_template(task, trace))
        results.append(check_real_values(task, trace))
        results.append(check_same_action(task, trace))
        results.append(check_keeps_roles(task))
        results.append(check_arguments_named(task, trace))
        results.append(check_description_covered(task, trace))
    if minimality:
        results.append(check_minimality(task, make_env, trace))
    if relevance:
        results.append(check_intent(task, trace, backend))
    return results
