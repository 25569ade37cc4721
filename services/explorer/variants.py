"""Other values for a variant round, read from the environment's state.

A round after the first should call the failed function with other values than the
rounds before. A 0.5B explorer asked for that in words repeated its first call instead:
each of run 25's three explorations made the same call in all three rounds
(``get_stock_info(AAPL)`` three times), so each gave one candidate where it could give
three. Code finds the values the state holds beside the one already used (the other keys
of the mapping it is a key of, the other items of its list, the same field of the
sibling records) and the call's schema then offers only those (``enum``).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from coevolve.shared.argument_values import is_salient
from coevolve.shared.messages import ToolCall

# the most values a parameter's enum offers: enough to vary, short enough for the grammar
MAX_ALTERNATIVES = 12


def _same_kind(value: Any, other: Any) -> bool:
    if isinstance(value, bool) or isinstance(other, bool):
        return False
    if isinstance(value, str):
        return isinstance(other, str)
    return isinstance(value, int | float) and isinstance(other, int | float)


def _siblings(node: Any, value: Any) -> Iterator[Any]:
    """Every value that stands beside ``value`` somewhere in ``node``."""
    if isinstance(node, Mapping):
        keys = [k for k in node if isinstance(k, str)]
        if isinstance(value, str) and value in keys and len(keys) > 1:
            yield from keys
        scalars = [v for v in node.values() if not isinstance(v, Mapping | list)]
        if value in scalars and len(scalars) == len(node) and len(node) > 1:
            yield from scalars
        records = [v for v in node.values() if isinstance(v, Mapping)]
        yield from _record_fields(records, value)
        for child in node.values():
            yield from _siblings(child, value)
    elif isinstance(node, list | tuple):
        if value in node:
            yield from (item for item in node if not isinstance(item, Mapping | list))
        yield from _record_fields([v for v in node if isinstance(v, Mapping)], value)
        for child in node:
            yield from _siblings(child, value)


def _record_fields(records: Sequence[Mapping[Any, Any]], value: Any) -> Iterator[Any]:
    """The same field of sibling records where one record holds ``value`` there."""
    if len(records) < 2:
        return
    for record in records:
        for field, held in record.items():
            if held == value and not isinstance(held, Mapping | list):
                yield from (other[field] for other in records if field in other)


def alternatives(state: Mapping[str, Any] | None, value: Any, used: Sequence[Any]) -> list[Any]:
    """Values of ``value``'s kind that the state holds beside it, without those of
    ``used``; [] when the state does not hold it."""
    if state is None or not is_salient(value):
        return []
    found: list[Any] = []
    for other in _siblings(state, value):
        fresh = other not in used and other not in found
        if fresh and _same_kind(value, other) and is_salient(other):
            found.append(other)
        if len(found) >= MAX_ALTERNATIVES:
            break
    return found


def varied_tools(
    tools: Sequence[dict[str, Any]],
    tried: Sequence[ToolCall],
    state: Mapping[str, Any] | None,
) -> list[dict[str, Any]]:
    """``tools`` with, for each function an earlier round already called first, one
    parameter restricted to the state's other values for it (the first parameter that
    has any); unchanged where the state offers none."""
    out: list[dict[str, Any]] = []
    for tool in tools:
        function = tool.get("function", tool)
        calls = [call for call in tried if call.name == function.get("name")]
        properties = (function.get("parameters") or {}).get("properties") or {}
        restricted = None
        for parameter in properties:
            used = [call.arguments[parameter] for call in calls if parameter in call.arguments]
            if not used:
                continue
            others = alternatives(state, used[0], used)
            if others:
                restricted = (parameter, others)
                break
        if restricted is None:
            out.append(tool)
            continue
        parameter, others = restricted
        varied = copy.deepcopy(tool)
        target = varied.get("function", varied)["parameters"]["properties"][parameter]
        target["enum"] = others
        out.append(varied)
    return out
