"""A user's own environment: a plain Python class whose public methods are the tools.

Each public method (no leading ``_``) is a tool: its signature and type hints give the JSON
schema, its docstring's first paragraph the description. An episode owns one fresh
instance, loaded from ``task.initial_state`` by the class's ``_load_scenario(state)`` when
it has one (BFCL's convention), else by setting each key as a public attribute. Scoring
follows BFCL's state and response checks, by equality. ``register_python_environment`` or
the configuration's ``environments`` section (``install_environments``) registers one.
"""

from __future__ import annotations

import copy
import functools
import importlib
import importlib.util
import inspect
import json
import os
import re
import sys
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

from coevolve.shared.envs import register_environment
from coevolve.shared.envs.episode import EpisodeState, StepCount
from coevolve.shared.envs.protocol import ReplayResult, StepResult
from coevolve.shared.envs.rendering import COMPACT_HINTS_KEY
from coevolve.shared.messages import ChatMessage, Task, ToolCall
from coevolve.shared.toolcalls import parse_tool_calls

# JSON's type names of Python types; bool before int (a bool is an int)
_JSON_NAMES: dict[Any, str] = {type(None): "null", bool: "boolean", int: "integer"}
_JSON_NAMES |= {float: "number", str: "string", list: "array", tuple: "array", dict: "object"}
_ENV_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_CONFIG_KEYS = {"class", "initial_states"}


def json_schema(hint: Any) -> dict[str, Any]:
    """The JSON schema of a type hint; ``{}`` (any value) for one it cannot express."""
    origin, args = get_origin(hint), get_args(hint)
    if origin in (Union, types.UnionType):  # Optional[X]: X or null; other unions: anything
        options = [json_schema(arg) for arg in args if arg is not type(None)]
        schema = options[0] if len(options) == 1 else {}
        if type(None) not in args or not isinstance(schema.get("type"), str):
            return schema
        enum = {"enum": [*schema["enum"], None]} if "enum" in schema else {}
        return {**schema, "type": [schema["type"], "null"], **enum}
    if origin is Literal:
        kinds = sorted({_json_type(value) for value in args})
        return {"type": kinds[0] if len(kinds) == 1 else kinds, "enum": list(args)}
    if isinstance(hint, type) and hint in _JSON_NAMES and hint is not type(None):
        return {"type": _JSON_NAMES[hint]}
    if origin in (list, tuple, Sequence):
        items = json_schema(args[0]) if args and (origin is not tuple or args[1:] == (...,)) else {}
        return {"type": "array", **({"items": items} if items else {})}
    if origin in (dict, Mapping):
        values = json_schema(args[1]) if len(args) == 2 else {}
        return {"type": "object", **({"additionalProperties": values} if values else {})}
    return {}


def _json_type(value: Any) -> str:
    return next((name for kind, name in _JSON_NAMES.items() if isinstance(value, kind)), "other")


def check_value(value: Any, schema: Mapping[str, Any], where: str) -> str | None:
    """Why ``value`` does not fit ``schema`` (a schema ``json_schema`` made), or None."""
    kinds = schema.get("type")
    if kinds is not None:
        allowed = [kinds] if isinstance(kinds, str) else list(kinds)
        got = _json_type(value)
        if got not in allowed and not (got == "integer" and "number" in allowed):
            return f"{where} must be {' or '.join(allowed)}, got {got}"
    if "enum" in schema and value not in schema["enum"]:
        return f"{where} must be one of {schema['enum']}, got {value!r}"
    if isinstance(value, list) and "items" in schema:
        found = (check_value(v, schema["items"], f"{where}[{i}]") for i, v in enumerate(value))
        return next((error for error in found if error), None)
    if isinstance(value, dict) and "additionalProperties" in schema:
        item = schema["additionalProperties"]
        found = (check_value(v, item, f"{where}.{k}") for k, v in value.items())
        return next((error for error in found if error), None)
    return None


@dataclass(frozen=True)
class Function:
    """One public method as a tool: its schema, required arguments and defaults."""

    name: str
    group: str
    description: str
    properties: dict[str, dict[str, Any]]
    required: tuple[str, ...]
    defaults: dict[str, Any]

    def tool(self) -> dict[str, Any]:
        parameters = {"type": "object", "properties": copy.deepcopy(self.properties)}
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": {**parameters, "required": list(self.required)},
            },
            COMPACT_HINTS_KEY: {"group": self.group, "description": self.description},
        }

    def check(self, arguments: Mapping[str, Any]) -> str | None:
        """Why the arguments do not fit the signature, or None."""
        errors = []
        unknown = [key for key in arguments if key not in self.properties]
        if unknown:
            takes = ", ".join(self.properties) or "no arguments"
            errors.append(f"unknown argument(s) {unknown[:5]}; '{self.name}' takes: {takes}")
        missing = [key for key in self.required if key not in arguments]
        if missing:
            errors.append(f"missing required argument(s): {', '.join(missing)}")
        for key, value in arguments.items():
            if key in self.properties:
                error = check_value(value, self.properties[key], f"argument '{key}'")
                errors += [error] if error else []
        return "; ".join(errors) or None


def _describe(cls: type, name: str, function: Any, bound: bool) -> Function:
    try:
        hints = typing.get_type_hints(function)
    except Exception:  # an annotation that does not resolve: that argument takes anything
        hints = {}
    doc = inspect.getdoc(function) or ""
    properties: dict[str, dict[str, Any]] = {}
    required: list[str] = []
    defaults: dict[str, Any] = {}
    for parameter in list(inspect.signature(function).parameters.values())[int(bound) :]:
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            continue
        properties[parameter.name] = json_schema(hints.get(parameter.name, Any))
        if parameter.default is parameter.empty:
            required.append(parameter.name)
        else:
            defaults[parameter.name] = parameter.default
    summary = " ".join(doc.split("\n\n")[0].split())
    return Function(name, cls.__name__, summary, properties, tuple(required), defaults)


@functools.cache
def public_functions(cls: type) -> dict[str, Function]:
    """The class's public methods (its own first, then inherited ones) as tools."""
    names = dict.fromkeys(n for k in cls.__mro__ if k is not object for n in vars(k))
    table: dict[str, Function] = {}
    for name in names:
        attribute = inspect.getattr_static(cls, name)
        wrapped = isinstance(attribute, staticmethod | classmethod)
        function = attribute.__func__ if wrapped else attribute
        if not name.startswith("_") and inspect.isfunction(function):
            bound = not isinstance(attribute, staticmethod)
            table[name] = _describe(cls, name, function, bound)
    return table


def public_state(instance: Any) -> dict[str, Any]:
    """A deep copy of the instance's public attributes."""
    attributes = getattr(instance, "__dict__", {})
    return {k: copy.deepcopy(v) for k, v in attributes.items() if not k.startswith("_")}


def new_instance(cls: type, initial_state: Mapping[str, Any]) -> Any:
    """A fresh instance in ``initial_state`` (``_load_scenario`` or public attributes)."""
    instance = cls()
    state = copy.deepcopy(dict(initial_state))
    loader = getattr(instance, "_load_scenario", None)
    if callable(loader):
        loader(state)
    else:
        known = public_state(instance)
        unknown = sorted(key for key in state if key not in known)
        if unknown:
            raise ValueError(
                f"{cls.__name__} has no public attribute(s) {unknown} to set from the "
                f"initial state; it has: {sorted(known)}"
            )
        for key, value in state.items():
            setattr(instance, key, value)
    try:  # no episode may share a mutable object (a module-level default) with another
        return copy.deepcopy(instance)
    except Exception:
        return instance


@dataclass
class Outcome:
    """One call: ``ran`` when it passed validation; ``result`` what scoring compares."""

    ok: bool
    text: str
    ran: bool = False
    result: Any = None


@dataclass(frozen=True)
class ScoreReport:
    score: float
    message: str


def run_call(instance: Any, functions: Mapping[str, Function], call: ToolCall) -> Outcome:
    """Validate ``call`` against ``functions`` and run it on ``instance``; never raises
    (a dict result with an ``error`` key counts as failed, BFCL's convention)."""
    function = functions.get(call.name)
    if function is None:
        available = ", ".join(functions)
        return Outcome(False, f"Error: unknown function {call.name!r}. Available: {available}")
    problem = function.check(call.arguments)
    if problem:
        return Outcome(False, f"Error: {call.name}: {problem}")
    try:
        result = getattr(instance, function.name)(**copy.deepcopy(call.arguments))
    except Exception as exc:
        text = f"Error: {type(exc).__name__}: {exc}"
        return Outcome(False, text, True, text)
    try:
        text = json.dumps(result, ensure_ascii=False, default=str)
        kept = copy.deepcopy(result)
    except Exception:  # a circular or uncopyable result: its text stands for it
        text = kept = str(result)
    return Outcome(not (isinstance(result, dict) and "error" in result), text, True, kept)


class PythonClassEnvironment(EpisodeState):
    """Episodes over one instance of a user's class (the ``Environment`` protocol).

    Turns and budgets as in BFCL: a message without tool calls ends the user turn; more
    than ``max_steps_per_turn`` steps in a turn or ``max_steps`` in all ends the episode
    unfinished (score 0). A task without user turns is a start state: its calls run, and
    the first message without one ends it.
    """

    def __init__(
        self,
        cls: type,
        *,
        name: str | None = None,
        max_steps: int = 60,
        max_steps_per_turn: int = 20,
        max_observation_chars: int = 16_000,
    ) -> None:
        self.cls, self.name, self.functions = cls, name or cls.__name__, public_functions(cls)
        self.max_steps, self.max_steps_per_turn = max_steps, max_steps_per_turn
        self.max_observation_chars = max_observation_chars
        self._instance: Any = None
        self._start(None)

    def _start(self, task: Task | None) -> None:
        self._task = task
        self._turn, self._steps = 0, StepCount()
        self._done, self._completed, self._end_reason = task is None, False, ""
        self._made: list[list[tuple[ToolCall, Any]]] = [[]]  # per turn, calls that ran
        self._turn_states: list[dict[str, Any]] = []  # the state at the end of each turn
        self.last_report: ScoreReport | None = None

    def state(self) -> dict[str, Any]:
        """A deep copy of the instance's public attributes."""
        return public_state(self._instance) if self._instance is not None else {}

    def reset(self, task: Task) -> list[ChatMessage]:
        if task.environment != self.name:
            raise ValueError(f"task {task.id} is for {task.environment!r}, not {self.name!r}")
        self._instance = new_instance(self.cls, task.initial_state)
        self._start(task)
        return [ChatMessage(role="user", content=text) for text in task.user_turns[:1]]

    def tools(self) -> list[dict[str, Any]]:
        return [function.tool() for function in self.functions.values()]

    def step(self, assistant_text: str) -> StepResult:
        if self._done:
            return StepResult(observations=[], done=True, info=self._info(["the episode is over"]))
        parsed = parse_tool_calls(assistant_text)
        self._steps.take()
        if not parsed.has_tool_call_blocks:
            user = self._advance_turn()
            info = self._info([], turn_ended=True)
            return StepResult(observations=[user] if user else [], done=self._done, info=info)
        observations: list[ChatMessage] = []
        errors: list[str] = []
        ran: list[ToolCall] = []
        for item in parsed.ordered:
            outcome = (
                self._run(item) if isinstance(item, ToolCall) else Outcome(False, f"Error: {item}")
            )
            ran += [item] if outcome.ran and isinstance(item, ToolCall) else []
            errors += [] if outcome.ok else [outcome.text]
            observations.append(ChatMessage(role="tool", content=self._clip(outcome.text)))
        self._check_budget()
        return StepResult(observations=observations, done=self._done, info=self._info(errors, ran))

    def execute(self, call: ToolCall) -> tuple[bool, str]:
        """Run one call as a step of the current turn."""
        if self._done:
            return False, "Error: the episode is over"
        outcome = self._run(call)
        self._steps.take()
        self._check_budget()
        return outcome.ok, self._clip(outcome.text)

    def replay(self, ground_truth: list[list[ToolCall]]) -> ReplayResult:
        """Each inner list is one turn's calls, run as one step; then the turn ends."""
        before = self.state()
        observations: list[str] = []
        errors: list[str] = []
        for calls in ground_truth:
            if self._done:
                errors.append(f"turn {self._turn + 1}: the task has no more turns")
                break
            for call in calls:
                outcome = self._run(call)
                observations.append(outcome.text)
                errors += [] if outcome.ok else [f"turn {self._turn}: {outcome.text}"]
            self._steps.total += 1
            self._advance_turn()
        changed = self.state() != before
        return ReplayResult(
            ok=not errors, observations=observations, errors=errors, state_changed=changed
        )

    def score(self) -> float:
        """1.0 when after every turn with ground truth the state equals the ground truth's
        and each ground-truth result is among the turn's results; else 0.0."""
        self.last_report = self._judge(self.task)
        return self.last_report.score

    def partial_credit(self) -> float:
        """Ground-truth calls matched by a made call (same name, equal arguments with the
        defaults filled in), over the larger of the two counts per turn; turns averaged."""
        credits = []
        for turn, calls in enumerate(self.task.ground_truth):
            made = [call for call, _ in self._made[turn]] if turn < len(self._made) else []
            unused = [self._key(call) for call in made]
            matched = 0
            for key in map(self._key, calls):
                if key in unused:
                    unused.remove(key)
                    matched += 1
            credits += [matched / max(len(calls), len(made))] if calls else []
        return sum(credits) / len(credits) if credits else 0.0

    def close(self) -> None:
        self._instance = None

    def _judge(self, task: Task) -> ScoreReport:
        truth = task.ground_truth
        if not task.user_turns:
            return ScoreReport(0.0, "a start task has nothing to answer")
        if len(truth) != len(task.user_turns):
            return ScoreReport(0.0, f"{len(task.user_turns)} user turns, {len(truth)} answers")
        if not self._completed:
            return ScoreReport(0.0, f"{self._end_reason or 'unfinished'} in turn {self._turn}")
        instance = new_instance(self.cls, task.initial_state)
        for turn, calls in enumerate(truth):
            expected = [run_call(instance, self.functions, call) for call in calls]
            results = [result for _, result in self._made[turn]]
            if not calls:
                continue
            if not results:
                return ScoreReport(0.0, f"turn {turn}: no function call")
            if self._turn_states[turn] != public_state(instance):
                return ScoreReport(0.0, f"turn {turn}: the state differs from the ground truth's")
            pairs = zip(calls, expected, strict=True)
            missing = [call.name for call, outcome in pairs if outcome.result not in results]
            if missing:
                return ScoreReport(0.0, f"turn {turn}: no result equal to that of {missing}")
        return ScoreReport(1.0, "every turn matches the ground truth")

    def _run(self, call: ToolCall) -> Outcome:
        outcome = run_call(self._instance, self.functions, call)
        if outcome.ran:
            self._made[self._turn].append((call, outcome.result))
        return outcome

    def _key(self, call: ToolCall) -> tuple[str, dict[str, Any]]:
        """The call with its defaults filled in, for comparison."""
        function = self.functions.get(call.name)
        return call.name, {**(function.defaults if function else {}), **call.arguments}

    def _advance_turn(self) -> ChatMessage | None:
        self._turn_states.append(self.state())
        if self._turn + 1 >= len(self.task.user_turns):
            self._done, self._completed, self._end_reason = True, True, "all turns answered"
            return None
        self._turn += 1
        self._steps.in_turn = 0
        self._made.append([])
        return ChatMessage(role="user", content=self.task.user_turns[self._turn])

    def _clip(self, text: str) -> str:
        extra = len(text) - self.max_observation_chars
        return text if extra <= 0 else f"{text[:-extra]}... [truncated {extra} characters]"

    def _info(
        self, errors: list[str], ran: Sequence[ToolCall] = (), *, turn_ended: bool = False
    ) -> dict[str, Any]:
        arguments = [", ".join(f"{k}={v!r}" for k, v in c.arguments.items()) for c in ran]
        return {
            "calls": [call.name for call in ran],
            "call_strings": [f"{c.name}({a})" for c, a in zip(ran, arguments, strict=True)],
            "errors": errors,
            "turn": self._turn,
            "step": self._steps.total,
            "turn_ended": turn_ended,
            "end_reason": self._end_reason if self._done else "",
        }


def _load_file(spec: str, path: Path) -> Any:
    if not path.is_file():
        raise ValueError(f"{spec!r}: no file {path}")
    name = "coevolve_user_env_" + re.sub(r"\W", "_", str(path))
    found = importlib.util.spec_from_file_location(name, path)
    if found is None or found.loader is None:
        raise ValueError(f"{spec!r}: {path} is not a Python module")
    module = sys.modules[name] = importlib.util.module_from_spec(found)
    try:
        found.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[name]
        raise ValueError(f"{spec!r}: loading {path} failed: {exc!r}") from exc
    return module


def _import_from_working_directory(spec: str, module_name: str) -> types.ModuleType:
    """The module, from the installed packages or the working directory, as ``python -m``
    would find it (the ``coevolve`` script and the services it starts do not put the
    working directory on the import path themselves)."""
    working = os.getcwd()
    if working not in sys.path:
        sys.path.append(working)
    try:
        return importlib.import_module(module_name)
    except ImportError as exc:
        file_form = module_name.replace(".", "/") + ".py:" + spec.rpartition(":")[2]
        raise ValueError(
            f"{spec!r}: cannot import {module_name!r} from the installed packages or the "
            f"working directory {working}: {exc}; or name its file: {file_form!r}"
        ) from exc


def load_class(spec: str) -> type:
    """``"package.module:ClassName"`` (imported) or ``"path/to/file.py:ClassName"``."""
    module_name, _, class_name = spec.rpartition(":")
    if not module_name or not class_name:
        raise ValueError(f"{spec!r} is not 'package.module:ClassName' or 'file.py:ClassName'")
    if module_name.endswith(".py") or "/" in module_name:
        module = _load_file(spec, Path(module_name).expanduser().resolve())
    else:
        module = _import_from_working_directory(spec, module_name)
    found = getattr(module, class_name, None)
    if not isinstance(found, type):
        raise ValueError(f"{spec!r}: {module_name} has no class {class_name!r}")
    if not public_functions(found):
        raise ValueError(f"{spec!r}: class {class_name} has no public method to offer as a tool")
    return found


def start_tasks_for(
    name: str, cls: type, initial_states: Sequence[Mapping[str, Any]] | None = None
) -> list[Task]:
    """One task per initial state (default: the class as constructed), nothing to answer."""
    states = initial_states if initial_states is not None else [{}]
    return [
        Task(
            id=f"{name}-state-{index}",
            environment=name,
            user_turns=[],
            initial_state=copy.deepcopy(dict(state)),
            ground_truth=[],
            env_config={"grain": "turn"},
            origin="seed",
            description=f"initial state {index} of {cls.__name__}",
            created_at=0.0,
        )
        for index, state in enumerate(states)
    ]


def register_python_environment(
    name: str, spec: str, initial_states: list[dict[str, Any]] | None = None
) -> None:
    """Load the class of ``spec``, check its initial states, and register it as ``name``."""
    if name == "bfcl":
        raise ValueError("the name 'bfcl' is the built-in BFCL environment's")
    if not _ENV_NAME.fullmatch(name):
        raise ValueError(f"{name!r} is not an environment name (letters, digits, _ . -)")
    cls = load_class(spec)
    states = copy.deepcopy(initial_states) if initial_states is not None else [{}]
    for index, state in enumerate(states):
        try:
            new_instance(cls, state)
        except Exception as exc:
            raise ValueError(f"initial_states[{index}]: {exc}") from exc

    def factory(**options: Any) -> PythonClassEnvironment:
        return PythonClassEnvironment(cls, name=name, **options)

    register_environment(name, factory, lambda: start_tasks_for(name, cls, states))


def install_environments(section: Mapping[str, Any]) -> None:
    """Register each entry of the configuration's ``environments`` section:
    ``{NAME: {class: "module:Class" | "file.py:Class", initial_states: [{...}, ...]}}``."""
    if not isinstance(section, Mapping):
        raise ValueError("environments: must map names to {class: ..., initial_states: [...]}")
    for name, entry in section.items():
        where = f"environments.{name}"
        if not isinstance(entry, Mapping):
            raise ValueError(f"{where}: must be a mapping with 'class' (and 'initial_states')")
        unknown = sorted(set(entry) - _CONFIG_KEYS)
        if unknown:
            raise ValueError(f"{where}: unknown key(s) {unknown}; allowed: {sorted(_CONFIG_KEYS)}")
        spec, states = entry.get("class"), entry.get("initial_states")
        if not isinstance(spec, str) or not spec:
            raise ValueError(f"{where}: 'class' must be 'package.module:Class' or 'file.py:Class'")
        if states is not None and not (
            isinstance(states, list) and all(isinstance(s, dict) for s in states)
        ):
            raise ValueError(f"{where}: 'initial_states' must be a list of mappings")
        try:
            register_python_environment(str(name), spec, states)
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from exc
