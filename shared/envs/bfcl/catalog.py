"""BFCL's executable API classes and their function docs, as shipped in ``bfcl_eval``.

The class -> module and class -> doc-file maps are BFCL's own constants, so every class in
``func_source_code`` that BFCL documents is covered. A function is callable only when it is
both documented and a public method of its class; nothing else is ever looked up.
"""

from __future__ import annotations

import importlib
import inspect
import json
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import bfcl_eval
from bfcl_eval.constants.executable_backend_config import (
    CLASS_FILE_PATH_MAPPING,
    MULTI_TURN_FUNC_DOC_FILE_MAPPING,
    STATELESS_CLASSES,
)

from coevolve.shared.envs.rendering import COMPACT_HINTS_KEY

DATA_DIR = Path(bfcl_eval.__file__).resolve().parent / "data"
FUNC_DOC_DIR = DATA_DIR / "multi_turn_func_doc"

# The classes the four multi-turn categories use; the others (web search, memory) belong to
# BFCL's agentic categories and need a network or a result directory.
MULTI_TURN_CLASSES: tuple[str, ...] = (
    "GorillaFileSystem",
    "MathAPI",
    "MessageAPI",
    "TwitterAPI",
    "TicketAPI",
    "TradingBot",
    "TravelAPI",
    "VehicleControlAPI",
)

# BFCL opens every description with a sentence about the function's API class, then this.
CLASS_BOILERPLATE_END = "Tool description:"

# BFCL's doc types -> JSON Schema types.
_JSON_SCHEMA_TYPES = {
    "dict": "object",
    "float": "number",
    "integer": "integer",
    "string": "string",
    "boolean": "boolean",
    "array": "array",
    "tuple": "array",
    "any": "string",
}


class UnavailableClassError(RuntimeError):
    """An API class BFCL lists but whose module cannot be imported here."""


@dataclass(frozen=True)
class FunctionDoc:
    """One documented function of one API class."""

    name: str
    class_name: str
    description: str
    parameters: dict[str, Any]

    @property
    def properties(self) -> dict[str, Any]:
        props: dict[str, Any] = self.parameters.get("properties", {})
        return props

    @property
    def required(self) -> list[str]:
        required: list[str] = self.parameters.get("required", [])
        return required

    @property
    def summary(self) -> str:
        """The description without BFCL's per-class opening (what the function does)."""
        _, marker, rest = self.description.partition(CLASS_BOILERPLATE_END)
        return rest.strip() if marker else self.description.strip()

    def tool_schema(self) -> dict[str, Any]:
        """OpenAI-style function schema (``{"type": "function", "function": {...}}``), with
        the hints the compact rendering uses (its class, its summary) beside it."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": to_json_schema(self.parameters),
            },
            COMPACT_HINTS_KEY: {"group": self.class_name, "description": self.summary},
        }


def to_json_schema(doc_schema: dict[str, Any]) -> dict[str, Any]:
    """Translate BFCL's schema dialect (``dict``, ``float``) to JSON Schema."""
    out: dict[str, Any] = {}
    for key, value in doc_schema.items():
        if key == "type" and isinstance(value, str):
            out["type"] = _JSON_SCHEMA_TYPES.get(value, value)
        elif key == "properties" and isinstance(value, dict):
            out["properties"] = {name: to_json_schema(sub) for name, sub in value.items()}
        elif key == "items" and isinstance(value, dict):
            out["items"] = to_json_schema(value)
        else:
            out[key] = value
    return out


def all_class_names() -> list[str]:
    """Every API class BFCL maps to both a source module and a function-doc file."""
    return [name for name in CLASS_FILE_PATH_MAPPING if name in MULTI_TURN_FUNC_DOC_FILE_MAPPING]


def is_stateless(class_name: str) -> bool:
    return class_name in STATELESS_CLASSES


@cache
def function_docs(class_name: str) -> tuple[FunctionDoc, ...]:
    """The documented functions of ``class_name`` that are public methods of the class."""
    path = FUNC_DOC_DIR / MULTI_TURN_FUNC_DOC_FILE_MAPPING[class_name]
    methods = public_method_names(class_name)
    docs: list[FunctionDoc] = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        raw = json.loads(line)
        if raw["name"] not in methods:
            continue
        docs.append(
            FunctionDoc(
                name=raw["name"],
                class_name=class_name,
                description=raw.get("description", ""),
                parameters=raw.get("parameters", {"type": "dict", "properties": {}}),
            )
        )
    return tuple(docs)


@cache
def api_class(class_name: str) -> type:
    """The class object (its module is imported on first use)."""
    try:
        module_path = CLASS_FILE_PATH_MAPPING[class_name]
    except KeyError:
        raise UnavailableClassError(f"BFCL has no API class named {class_name!r}") from None
    try:
        module = importlib.import_module(module_path)
    except Exception as exc:  # an optional dependency of that class is missing or broken
        raise UnavailableClassError(f"cannot import {class_name}: {exc}") from exc
    cls: type = getattr(module, class_name)
    return cls


@cache
def public_method_names(class_name: str) -> frozenset[str]:
    """Names of the class's own public functions (looked up on the class, not an instance)."""
    cls = api_class(class_name)
    return frozenset(
        name
        for name, member in inspect.getmembers(cls, inspect.isfunction)
        if not name.startswith("_")
    )


def available_class_names() -> list[str]:
    """The classes whose modules import in this environment."""
    names = []
    for name in all_class_names():
        try:
            api_class(name)
        except UnavailableClassError:
            continue
        names.append(name)
    return names
