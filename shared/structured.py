"""Turning an LLM's JSON into a typed value, or into a counted, explained rejection.

Whatever the model returns (nothing, half a document, the wrong fields, megabytes of
text), :func:`parse_structured` answers with either a value of the requested msgspec type
or a :class:`Rejection` naming what was wrong; it never raises. :func:`ask_structured`
does the same around a chat call; only :class:`~coevolve.shared.llm.LLMUnavailable`
escapes it, because an unreachable endpoint means "retry later", not "bad output".

Also here: JSON schemas for tool calls derived from OpenAI-style function schemas, so a
constrained model can only call functions that exist, with arguments of the right shape.
"""

from __future__ import annotations

import logging
import re
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec

from coevolve.shared.llm.client import Chat, ChatMessages, LLMOutputError

T = TypeVar("T")

DEFAULT_MAX_CHARS = 32_000
_PREVIEW_CHARS = 160
_FENCED = re.compile(r"```(?:json)?\s*(.*?)\s*```", re.DOTALL)


_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Rejection:
    """Why an LLM output was not used. ``kind`` is one of: empty, too_large, truncated,
    invalid_json, wrong_schema, bad_response, http_error, prompt_too_long, repeated_call
    (an action that already failed, see the explorer); the distiller's advice also
    too_short, too_long, incomplete, unknown_function, unknown_argument, unknown_name and
    no_tools (``shared/experience/checks.py``)."""

    kind: str
    reason: str
    preview: str = ""


class RejectionCounter:
    """Counts outcomes per rejection kind (and accepted outputs), for metrics."""

    def __init__(self) -> None:
        self.rejected: Counter[str] = Counter()
        self.accepted = 0

    def record(self, outcome: object) -> None:
        if isinstance(outcome, Rejection):
            self.rejected[outcome.kind] += 1
        else:
            self.accepted += 1

    @property
    def total_rejected(self) -> int:
        return sum(self.rejected.values())

    def snapshot(self) -> dict[str, int]:
        return {"accepted": self.accepted, **{f"rejected.{k}": v for k, v in self.rejected.items()}}


def _preview(text: str) -> str:
    return text[:_PREVIEW_CHARS]


def parse_structured(
    text: str,
    kind: type[T],
    *,
    finish_reason: str = "stop",
    max_chars: int = DEFAULT_MAX_CHARS,
) -> T | Rejection:
    """Decode ``text`` as JSON of type ``kind`` (a msgspec Struct or any msgspec type)."""
    if not isinstance(text, str):
        return Rejection("bad_response", f"output is {type(text).__name__}, not text")
    stripped = text.strip()
    if not stripped:
        return Rejection("empty", "the model returned no text")
    if len(stripped) > max_chars:
        return Rejection(
            "too_large",
            f"output of {len(stripped)} characters exceeds the limit of {max_chars}",
            _preview(stripped),
        )
    document, error = _decode_json(stripped)
    if error is not None:
        if finish_reason == "length" or "truncated" in error:
            return Rejection(
                "truncated",
                f"JSON ends early (finish_reason={finish_reason}): {error}",
                _preview(stripped),
            )
        return Rejection("invalid_json", f"not JSON: {error}", _preview(stripped))
    try:
        return msgspec.convert(document, kind, strict=True)
    except msgspec.ValidationError as exc:
        return Rejection(
            "wrong_schema", f"JSON does not match {_name(kind)}: {exc}", _preview(stripped)
        )


def _decode_json(text: str) -> tuple[Any, str | None]:
    """The document in ``text``; tolerates a Markdown code fence around it."""
    try:
        return msgspec.json.decode(text), None
    except msgspec.DecodeError as exc:
        first_error = str(exc)
    fenced = _FENCED.search(text)
    if fenced:
        try:
            return msgspec.json.decode(fenced.group(1)), None
        except msgspec.DecodeError as exc:
            return None, str(exc)
    return None, first_error


def _name(kind: object) -> str:
    return getattr(kind, "__name__", repr(kind))


async def ask_structured(
    llm: Chat,
    messages: ChatMessages,
    kind: type[T],
    *,
    schema: dict[str, Any],
    max_tokens: int,
    temperature: float,
    counter: RejectionCounter | None = None,
    max_chars: int = DEFAULT_MAX_CHARS,
) -> T | Rejection:
    """Ask for JSON following ``schema`` and decode it as ``kind``.

    Raises only :class:`~coevolve.shared.llm.LLMUnavailable` (retry the work later).
    """
    try:
        response = await llm.chat(
            messages, schema=schema, max_tokens=max_tokens, temperature=temperature
        )
    except LLMOutputError as exc:
        outcome: T | Rejection = Rejection(exc.kind, str(exc))
    else:
        outcome = parse_structured(
            response.text, kind, finish_reason=response.finish_reason, max_chars=max_chars
        )
    if counter is not None:
        counter.record(outcome)
    return outcome


# --------------------------------------------------------------------------- tool schemas

_TYPE_ALIASES = {
    "dict": "object",
    "float": "number",
    "int": "integer",
    "bool": "boolean",
    "str": "string",
    "list": "array",
    "tuple": "array",
}
_KEPT_KEYWORDS = ("enum", "minimum", "maximum", "minItems", "maxItems", "minLength", "maxLength")


def json_schema_of_parameter(spec: dict[str, Any]) -> dict[str, Any]:
    """A strict JSON schema from a function-parameter schema, mapping the Python-style
    type names some function docs use (dict, float, tuple, any) to JSON schema ones."""
    declared = spec.get("type")
    declared = _TYPE_ALIASES.get(declared, declared) if isinstance(declared, str) else None
    out: dict[str, Any] = {}
    if declared and declared != "any":
        out["type"] = declared
    for keyword in _KEPT_KEYWORDS:
        if keyword in spec:
            out[keyword] = spec[keyword]
    if declared == "array" and isinstance(spec.get("items"), dict):
        out["items"] = json_schema_of_parameter(spec["items"])
    if declared == "object" and isinstance(spec.get("properties"), dict) and spec["properties"]:
        out["properties"] = {
            name: json_schema_of_parameter(sub if isinstance(sub, dict) else {})
            for name, sub in spec["properties"].items()
        }
        required = [r for r in spec.get("required", []) if r in out["properties"]]
        if required:
            out["required"] = required
        out["additionalProperties"] = False
    return out


def function_call_schema(tools: list[dict[str, Any]]) -> dict[str, Any]:
    """Schema of one call ``{"name": ..., "arguments": {...}}`` to one of ``tools``
    (OpenAI-style ``{"type": "function", "function": {name, parameters}}`` entries)."""
    options: list[dict[str, Any]] = []
    for tool in tools:
        function = tool.get("function", tool)
        name = function.get("name")
        if not isinstance(name, str):
            continue
        parameters = function.get("parameters") or {"type": "object", "properties": {}}
        arguments = json_schema_of_parameter({**parameters, "type": "object"})
        if "properties" not in arguments:
            arguments = {"type": "object", "properties": {}, "additionalProperties": False}
        options.append(
            {
                "type": "object",
                "properties": {"name": {"const": name}, "arguments": arguments},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
        )
    if not options:
        raise ValueError("no function with a name among the tools")
    return options[0] if len(options) == 1 else {"anyOf": options}


def tool_names(tools: list[dict[str, Any]]) -> set[str]:
    names: set[str] = set()
    for tool in tools:
        name = tool.get("function", tool).get("name")
        if isinstance(name, str):
            names.add(name)
    return names


async def report_rejection(
    metric: Callable[..., Awaitable[None]],
    role: str,
    counter: RejectionCounter,
    rejection: Rejection,
    about: str,
) -> None:
    """Log a rejected LLM answer and publish the running count of its kind for ``role``.

    ``metric`` is the service's ``Actor.metric``; ``about`` names what was being processed.
    """
    _log.warning("%s: %s output rejected (%s): %s", about, role, rejection.kind, rejection.reason)
    await metric("llm_rejections", counter.rejected[rejection.kind], role=role, kind=rejection.kind)
