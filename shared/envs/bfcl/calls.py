"""Conversions between BFCL's call strings and ToolCalls, without ever executing text.

BFCL's ground truth is written as Python call strings (``cd(folder='document')``). They are
read with ``ast`` and ``ast.literal_eval`` (literals only); positional arguments are named
from the method's signature. The reverse direction builds a call string from already
validated values with ``repr``, for logs and for APIs that want strings.
"""

from __future__ import annotations

import ast
import inspect
from collections.abc import Iterable, Mapping
from typing import Any

from coevolve.shared.envs.bfcl.catalog import api_class, function_docs
from coevolve.shared.messages import ToolCall


class CallStringError(ValueError):
    """A ground-truth string that is not a plain call with literal arguments."""


def _plain(value: Any) -> Any:
    """Literal values as JSON-shaped data (tuples become lists)."""
    if isinstance(value, tuple | list):
        return [_plain(item) for item in value]
    if isinstance(value, dict):
        return {str(key): _plain(item) for key, item in value.items()}
    return value


def _owner_class(name: str, involved_classes: Iterable[str]) -> str | None:
    owner = None
    for class_name in involved_classes:
        if any(doc.name == name for doc in function_docs(class_name)):
            owner = class_name  # the last one wins, as in BFCL's executor
    return owner


def parse_call_string(text: str, involved_classes: Iterable[str]) -> ToolCall:
    """``"mv(source='a', destination='b')"`` -> ToolCall; literals only, nothing runs."""
    try:
        node = ast.parse(text.strip(), mode="eval").body
    except SyntaxError as exc:
        raise CallStringError(f"not a call: {text!r} ({exc.msg})") from exc
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
        raise CallStringError(f"not a plain function call: {text!r}")
    name = node.func.id
    try:
        keywords = {kw.arg: _plain(ast.literal_eval(kw.value)) for kw in node.keywords}
        positional = [_plain(ast.literal_eval(arg)) for arg in node.args]
    except ValueError as exc:
        raise CallStringError(f"non-literal argument in {text!r}") from exc
    if None in keywords:
        raise CallStringError(f"'**' arguments are not supported: {text!r}")
    arguments: dict[str, Any] = {str(key): value for key, value in keywords.items()}
    if positional:
        owner = _owner_class(name, involved_classes)
        if owner is None:
            raise CallStringError(f"cannot name positional arguments of unknown {name!r}")
        parameters = [
            p for p in inspect.signature(getattr(api_class(owner), name)).parameters if p != "self"
        ]
        if len(positional) > len(parameters):
            raise CallStringError(f"too many positional arguments in {text!r}")
        for parameter, value in zip(parameters, positional, strict=False):
            arguments[parameter] = value
    return ToolCall(name=name, arguments=arguments)


def call_string(name: str, arguments: Mapping[str, Any]) -> str:
    """``name(key=repr(value), ...)`` from validated values."""
    rendered = ", ".join(f"{key}={value!r}" for key, value in arguments.items())
    return f"{name}({rendered})"
