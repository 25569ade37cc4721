"""The literal values in tool calls' arguments that a task's text should name.

Shared by the abstractor (which completes requests that leave them out) and the judge
(which rejects tasks whose text does not name them).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from coevolve.shared.messages import ToolCall


def scalars(value: Any) -> Iterator[Any]:
    """Every scalar in ``value``, lists and nested objects searched."""
    if isinstance(value, Mapping):
        for item in value.values():
            yield from scalars(item)
    elif isinstance(value, list | tuple):
        for item in value:
            yield from scalars(item)
    else:
        yield value


def is_salient(value: Any) -> bool:
    """Whether a literal argument is one a task's text should name.

    Salient: numbers other than 0 and 1 (amounts, ids, counts; 0 and 1 are mostly
    positions and flags) and strings of at least 2 characters (names, ids, file names,
    symbols, dates, and free text such as a message).
    Not salient: booleans, None, empty or one-character strings (modes such as ``"l"``).
    """
    if isinstance(value, bool) or value is None:
        return False
    if isinstance(value, int | float):
        return value not in (0, 1)
    if isinstance(value, str):
        return len(value.strip()) >= 2
    return False


def salient_values(calls: Sequence[ToolCall]) -> list[tuple[ToolCall, str, Any]]:
    """(call, parameter, value) for every salient scalar in the calls' arguments (under
    their top-level parameter), each distinct value once (the first call passing it)."""
    found: list[tuple[ToolCall, str, Any]] = []
    seen: list[Any] = []
    for call in calls:
        for parameter, argument in call.arguments.items():
            for value in scalars(argument):
                if is_salient(value) and value not in seen:
                    seen.append(value)
                    found.append((call, parameter, value))
    return found
