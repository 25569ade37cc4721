"""The <tool_call> text convention: parsing never raises, errors are readable."""

from __future__ import annotations

import json
import random

from coevolve.shared.messages import ToolCall
from coevolve.shared.toolcalls import (
    MAX_CALLS_PER_MESSAGE,
    format_tool_calls,
    parse_tool_calls,
)


def test_format_then_parse_round_trips() -> None:
    calls = [
        ToolCall(name="cd", arguments={"folder": "document"}),
        ToolCall(name="mean", arguments={"numbers": [1, 2.5, -3]}),
        ToolCall(name="ls", arguments={}),
    ]
    parsed = parse_tool_calls("Let me do that.\n" + format_tool_calls(calls))
    assert parsed.calls == calls
    assert parsed.errors == []
    assert parsed.text == "Let me do that."
    assert parsed.ordered == calls


def test_plain_text_has_no_calls() -> None:
    parsed = parse_tool_calls("The file has 3 lines.")
    assert not parsed.has_tool_call_blocks
    assert parsed.text == "The file has 3 lines."


def test_malformed_blocks_become_errors_in_order() -> None:
    text = (
        '<tool_call>{"name": "cd", "arguments": {"folder": "a"}}</tool_call>'
        "<tool_call>{not json}</tool_call>"
        '<tool_call>["cd"]</tool_call>'
        '<tool_call>{"arguments": {}}</tool_call>'
        '<tool_call>{"name": "cd", "arguments": [1]}</tool_call>'
        '<tool_call>{"name": "pwd", "arguments": {}}'  # unclosed: runs to the end
    )
    parsed = parse_tool_calls(text)
    assert [c.name for c in parsed.calls] == ["cd", "pwd"]
    assert len(parsed.errors) == 4
    assert "not valid JSON" in parsed.errors[0]
    assert "JSON object" in parsed.errors[1]
    assert "'name'" in parsed.errors[2]
    assert "'arguments'" in parsed.errors[3]
    kinds = ["call" if isinstance(item, ToolCall) else "error" for item in parsed.ordered]
    assert kinds == ["call", "error", "error", "error", "error", "call"]


def test_openai_style_string_arguments_and_parameters_alias() -> None:
    encoded = json.dumps({"name": "cd", "arguments": json.dumps({"folder": "x"})})
    aliased = json.dumps({"name": "cd", "parameters": {"folder": "y"}})
    parsed = parse_tool_calls(f"<tool_call>{encoded}</tool_call><tool_call>{aliased}</tool_call>")
    assert [c.arguments for c in parsed.calls] == [{"folder": "x"}, {"folder": "y"}]


def test_nan_and_infinity_are_not_json() -> None:
    parsed = parse_tool_calls('<tool_call>{"name": "add", "arguments": {"a": NaN}}</tool_call>')
    assert parsed.calls == []
    assert "NaN" in parsed.errors[0]


def test_too_many_calls_are_cut_with_an_error() -> None:
    one = '<tool_call>{"name": "pwd", "arguments": {}}</tool_call>'
    parsed = parse_tool_calls(one * (MAX_CALLS_PER_MESSAGE + 3))
    assert len(parsed.calls) == MAX_CALLS_PER_MESSAGE
    assert "at most" in parsed.errors[-1]


def test_deeply_nested_json_is_an_error_not_a_crash() -> None:
    deep = "[" * 10_000 + "]" * 10_000  # under the size limit, over the recursion limit
    parsed = parse_tool_calls(f'<tool_call>{{"name": "cd", "arguments": {deep}}}</tool_call>')
    assert parsed.calls == []
    assert parsed.errors


def test_random_garbage_never_raises() -> None:
    rng = random.Random(1234)
    alphabet = '<>/{}[]":,tool_call namearguments\\\n0123456789'
    for _ in range(2_000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 120)))
        parsed = parse_tool_calls(text)
        assert all(isinstance(c, ToolCall) for c in parsed.calls)
        assert all(isinstance(e, str) for e in parsed.errors)
