"""The tool-call text convention: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.

This is the format of the Qwen / Hermes chat templates. Parsing never raises: every
problem becomes an entry in ``ParsedMessage.errors`` phrased for the agent to read.
Parsing only decodes JSON; whether a call names a real function with the right argument
types is the environment's job (see ``coevolve.shared.envs``).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from coevolve.shared.messages import ToolCall

OPEN_TAG = "<tool_call>"
CLOSE_TAG = "</tool_call>"

MAX_CALLS_PER_MESSAGE = 16
MAX_CALL_CHARS = 32_000

_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)


@dataclass
class ParsedMessage:
    """The tool calls found in one assistant message, the problems, and the plain text."""

    calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    text: str = ""
    # Calls and errors in the order their blocks appear (an error is a str).
    ordered: list[ToolCall | str] = field(default_factory=list)

    @property
    def has_tool_call_blocks(self) -> bool:
        """True when the message tried to call a tool (even if every call was malformed)."""
        return bool(self.calls or self.errors)


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not valid JSON")


def _decode_block(body: str) -> tuple[ToolCall | None, str | None]:
    body = body.strip()
    if len(body) > MAX_CALL_CHARS:
        return None, f"is too long ({len(body)} characters, at most {MAX_CALL_CHARS})"
    if not body:
        return None, "is empty; write a JSON object with 'name' and 'arguments'"
    try:
        data: Any = json.loads(body, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as exc:
        return None, f"is not valid JSON ({exc})"
    if not isinstance(data, dict):
        return None, "must be a JSON object with 'name' and 'arguments'"
    name = data.get("name")
    if not isinstance(name, str) or not name:
        return None, "needs a non-empty string 'name'"
    # Some chat templates write "parameters" where Qwen/Hermes write "arguments".
    arguments = data.get("arguments", data.get("parameters", {}))
    if isinstance(arguments, str):
        # OpenAI-style calls carry the arguments as a JSON-encoded string.
        try:
            arguments = json.loads(arguments, parse_constant=_reject_constant)
        except (ValueError, RecursionError) as exc:
            return None, f"has 'arguments' that are not valid JSON ({exc})"
    if not isinstance(arguments, dict):
        return None, "needs 'arguments' to be a JSON object"
    return ToolCall(name=name, arguments=arguments), None


def parse_tool_calls(text: str) -> ParsedMessage:
    """Find every ``<tool_call>`` block in ``text``; an unclosed last block runs to the end."""
    parsed = ParsedMessage()
    blocks = list(_BLOCK.finditer(text))
    parsed.text = _BLOCK.sub("", text).strip()
    for index, match in enumerate(blocks, start=1):
        if index > MAX_CALLS_PER_MESSAGE:
            error = (
                f"tool call {index} and later were ignored: at most "
                f"{MAX_CALLS_PER_MESSAGE} calls per message"
            )
            parsed.errors.append(error)
            parsed.ordered.append(error)
            break
        call, problem = _decode_block(match.group(1))
        if call is not None:
            parsed.calls.append(call)
            parsed.ordered.append(call)
        else:
            error = f"tool call {index} {problem}"
            parsed.errors.append(error)
            parsed.ordered.append(error)
    return parsed


def format_tool_call(call: ToolCall) -> str:
    body = json.dumps({"name": call.name, "arguments": call.arguments}, ensure_ascii=False)
    return f"{OPEN_TAG}\n{body}\n{CLOSE_TAG}"


def format_tool_calls(calls: list[ToolCall]) -> str:
    """The assistant text that performs ``calls`` (one block per call)."""
    return "\n".join(format_tool_call(call) for call in calls)
