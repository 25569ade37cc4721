"""How the agent sees its tools: ``full`` or ``compact``, one choice per process.

- ``full``: each function's JSON schema as the environment documents it (for BFCL, its own
  docs, as in published results);
- ``compact`` (the default): one line per function, ``name(arg: type, opt?: type) - what it
  does``, under a header line per group (for BFCL, per API class). The description is the
  tool's compact hint when it has one (BFCL: its doc without the per-class boilerplate).

The choice is the top-level ``tool_rendering`` key of the run configuration
(``coevolve.shared.config.Settings``); ``load_settings`` installs it here, and every prompt
rendered through ``coevolve.shared.policy.chat`` (rollout, SFT and GRPO, eval, exploration)
uses it unless a caller names one. A tool dict may carry rendering hints under the key
``compact``: ``{"group": "GorillaFileSystem", "description": "Change the directory."}``;
they are never shown to a chat template as part of the tool's schema.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

ToolRendering = Literal["compact", "full"]
TOOL_RENDERINGS: tuple[ToolRendering, ...] = ("compact", "full")
DEFAULT_TOOL_RENDERING: ToolRendering = "compact"
COMPACT_HINTS_KEY = "compact"

_configured: ToolRendering = DEFAULT_TOOL_RENDERING

# JSON Schema types -> the short names a signature shows.
_SHORT_TYPES = {
    "string": "str",
    "integer": "int",
    "number": "float",
    "boolean": "bool",
    "object": "dict",
    "array": "list",
    # BFCL's own dialect, for schemas that were not translated
    "float": "float",
    "dict": "dict",
    "tuple": "list",
}


def check_tool_rendering(value: str) -> ToolRendering:
    if value not in TOOL_RENDERINGS:
        raise ValueError(f"tool rendering must be one of {TOOL_RENDERINGS}, not {value!r}")
    return value


def configure_tool_rendering(rendering: str) -> None:
    """Make ``rendering`` this process's tool rendering (``load_settings`` calls this)."""
    global _configured
    _configured = check_tool_rendering(rendering)


def configured_tool_rendering() -> ToolRendering:
    return _configured


def function_of(tool: Mapping[str, Any]) -> Mapping[str, Any]:
    """The function object of an OpenAI-style tool (or the tool itself if it is one)."""
    function = tool.get("function", tool)
    return function if isinstance(function, Mapping) else tool


def schema_only(tool: Mapping[str, Any]) -> dict[str, Any]:
    """The tool without its rendering hints (what a chat template or an endpoint sees)."""
    return {key: value for key, value in tool.items() if key != COMPACT_HINTS_KEY}


def short_type(schema: Mapping[str, Any]) -> str:
    kind = schema.get("type")
    if isinstance(kind, list):
        return " | ".join(_SHORT_TYPES.get(str(k), str(k)) for k in kind)
    name = _SHORT_TYPES.get(str(kind), str(kind)) if kind else "any"
    items = schema.get("items")
    if name == "list" and isinstance(items, Mapping) and items.get("type"):
        return f"list[{short_type(items)}]"
    return name


def compact_signature(function: Mapping[str, Any]) -> str:
    """``name(arg: type, opt?: type)``: required arguments first as documented."""
    parameters = function.get("parameters") or {}
    properties: Mapping[str, Any] = parameters.get("properties") or {}
    required = set(parameters.get("required") or [])
    arguments = ", ".join(
        f"{name}{'' if name in required else '?'}: {short_type(schema)}"
        for name, schema in properties.items()
    )
    return f"{function.get('name')}({arguments})"


def compact_description(tool: Mapping[str, Any]) -> str:
    hints = tool.get(COMPACT_HINTS_KEY)
    text = ""
    if isinstance(hints, Mapping) and isinstance(hints.get("description"), str):
        text = hints["description"]
    else:
        text = str(function_of(tool).get("description", ""))
    return " ".join(text.split())


def compact_line(tool: Mapping[str, Any]) -> str:
    """``name(arg: type, opt?: type) - description`` for one tool."""
    line = compact_signature(function_of(tool))
    description = compact_description(tool)
    return f"{line} - {description}" if description else line


def tool_group(tool: Mapping[str, Any]) -> str | None:
    hints = tool.get(COMPACT_HINTS_KEY)
    group = hints.get("group") if isinstance(hints, Mapping) else None
    return group if isinstance(group, str) and group else None


def compact_listing(tools: Sequence[Mapping[str, Any]]) -> str:
    """Every tool on its own line, grouped under ``# Group`` headers (first-seen order).

    Tools without a group come first, without a header.
    """
    groups: dict[str | None, list[str]] = {}
    for tool in tools:
        groups.setdefault(tool_group(tool), []).append(compact_line(tool))
    lines = list(groups.pop(None, []))
    for group, members in groups.items():
        lines.append(f"# {group}")
        lines.extend(members)
    return "\n".join(lines)
