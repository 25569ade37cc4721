"""Check a parsed call against the function docs before anything is dispatched.

A call passes only when its name is a plain identifier of a function offered right now,
every argument is a documented parameter with the documented JSON type, the required ones
are present, and values stay within size bounds. The errors are written for the agent.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from coevolve.shared.envs.bfcl.catalog import FunctionDoc
from coevolve.shared.messages import ToolCall

_IDENTIFIER = re.compile(r"[A-Za-z][A-Za-z0-9_]{0,63}")


@dataclass(frozen=True)
class CallLimits:
    """Size bounds on arguments (BFCL's own ground truth stays far below all of them)."""

    max_string_chars: int = 10_000
    max_array_items: int = 1_000
    max_object_keys: int = 100
    max_depth: int = 6
    max_abs_number: float = 1e12


# Arguments that drive work exponentially (precision digits, exponents) get tighter bounds.
ARGUMENT_BOUNDS: dict[tuple[str, str], tuple[float, float]] = {
    ("logarithm", "precision"): (1, 1_000),
    ("square_root", "precision"): (1, 1_000),
    ("power", "exponent"): (-1_000, 1_000),
    ("round_number", "decimal_places"): (-1_000, 1_000),
}


@dataclass(frozen=True)
class ValidatedCall:
    """A call that may be dispatched: its doc and its checked arguments."""

    doc: FunctionDoc
    arguments: dict[str, Any]

    @property
    def name(self) -> str:
        return self.doc.name


class CallValidationError(ValueError):
    """The call cannot be dispatched; ``str(error)`` is the observation for the agent."""


# JSON Schema's type names of Python values; bool before int (a bool is an int)
_JSON_TYPE_NAMES: tuple[tuple[type, str], ...] = (
    (type(None), "null"),
    (bool, "boolean"),
    (int, "integer"),
    (float, "number"),
    (str, "string"),
    (list, "array"),
    (dict, "object"),
)


def _json_type_name(value: Any) -> str:
    for python_type, name in _JSON_TYPE_NAMES:
        if isinstance(value, python_type):
            return name
    return type(value).__name__


def _check_value(
    value: Any, schema: Mapping[str, Any], where: str, limits: CallLimits, depth: int
) -> list[str]:
    if depth > limits.max_depth:
        return [f"{where} is nested deeper than {limits.max_depth} levels"]
    expected = schema.get("type", "any")
    got = _json_type_name(value)
    errors: list[str] = []
    if expected == "string":
        if not isinstance(value, str):
            return [f"{where} must be a string, got {got}"]
        if len(value) > limits.max_string_chars:
            return [
                f"{where} is too long ({len(value)} characters, at most {limits.max_string_chars})"
            ]
    elif expected == "integer":
        if not isinstance(value, int) or isinstance(value, bool):
            return [f"{where} must be an integer, got {got}"]
        if abs(value) > limits.max_abs_number:
            return [f"{where} is out of range (|value| at most {limits.max_abs_number:g})"]
    elif expected in ("float", "number"):
        if not isinstance(value, int | float) or isinstance(value, bool):
            return [f"{where} must be a number, got {got}"]
        if not math.isfinite(value) or abs(value) > limits.max_abs_number:
            return [f"{where} is out of range (|value| at most {limits.max_abs_number:g})"]
    elif expected == "boolean":
        if not isinstance(value, bool):
            return [f"{where} must be true or false, got {got}"]
    elif expected in ("array", "tuple"):
        if not isinstance(value, list):
            return [f"{where} must be an array, got {got}"]
        if len(value) > limits.max_array_items:
            return [f"{where} has too many items ({len(value)}, at most {limits.max_array_items})"]
        item_schema = schema.get("items", {})
        for index, item in enumerate(value):
            errors += _check_value(item, item_schema, f"{where}[{index}]", limits, depth + 1)
            if errors:
                return errors
    elif expected == "dict":
        if not isinstance(value, dict):
            return [f"{where} must be an object, got {got}"]
        if len(value) > limits.max_object_keys:
            return [f"{where} has too many keys ({len(value)}, at most {limits.max_object_keys})"]
        properties: Mapping[str, Any] = schema.get("properties", {})
        unknown = [key for key in value if properties and key not in properties]
        if unknown:
            allowed = ", ".join(properties)
            return [f"{where} has unknown key(s) {unknown[:5]}; allowed: {allowed}"]
        for key, item in value.items():
            item_schema = properties.get(key, {})
            errors += _check_value(item, item_schema, f"{where}.{key}", limits, depth + 1)
            if errors:
                return errors
    else:
        # Untyped: accept JSON scalars and bounded containers only.
        errors += _check_untyped(value, where, limits, depth)
    if errors:
        return errors
    enum = schema.get("enum")
    if enum is not None and value not in enum:
        return [f"{where} must be one of {enum}, got {value!r}"]
    return []


def _check_untyped(value: Any, where: str, limits: CallLimits, depth: int) -> list[str]:
    if isinstance(value, list):
        return _check_value(value, {"type": "array"}, where, limits, depth)
    if isinstance(value, dict):
        return _check_value(value, {"type": "dict"}, where, limits, depth)
    if isinstance(value, str):
        return _check_value(value, {"type": "string"}, where, limits, depth)
    if isinstance(value, int | float) and not isinstance(value, bool):
        return _check_value(value, {"type": "float"}, where, limits, depth)
    return []


def validate_call(
    call: ToolCall,
    functions: Mapping[str, FunctionDoc],
    limits: CallLimits | None = None,
) -> ValidatedCall:
    """Return the call ready to dispatch, or raise CallValidationError saying why not."""
    limits = limits or CallLimits()
    name = call.name
    if not isinstance(name, str) or not _IDENTIFIER.fullmatch(name):
        shown = repr(name)[:80]
        raise CallValidationError(
            f"invalid function name {shown}: a name is a plain identifier such as "
            "'ls' or 'get_stock_info' (no dots, brackets, spaces or leading underscore)"
        )
    doc = functions.get(name)
    if doc is None:
        available = ", ".join(sorted(functions))
        raise CallValidationError(f"unknown function '{name}'. Available functions: {available}")
    if not isinstance(call.arguments, dict):
        raise CallValidationError(f"{name}: 'arguments' must be a JSON object")
    properties = doc.properties
    errors: list[str] = []
    unknown = [key for key in call.arguments if key not in properties]
    if unknown:
        shown_keys = ", ".join(repr(key)[:60] for key in unknown[:5])
        errors.append(
            f"unknown argument(s) {shown_keys}; '{name}' takes: "
            + (", ".join(properties) or "no arguments")
        )
    missing = [key for key in doc.required if key not in call.arguments]
    if missing:
        errors.append(f"missing required argument(s): {', '.join(missing)}")
    for key, value in call.arguments.items():
        if key not in properties:
            continue
        errors += _check_value(value, properties[key], f"argument '{key}'", limits, depth=1)
        bounds = ARGUMENT_BOUNDS.get((name, key))
        if bounds is not None and isinstance(value, int | float) and not isinstance(value, bool):
            low, high = bounds
            if not low <= value <= high:
                errors.append(f"argument '{key}' must be between {low:g} and {high:g}")
    if errors:
        raise CallValidationError(f"{name}: " + "; ".join(errors))
    return ValidatedCall(doc=doc, arguments=dict(call.arguments))
