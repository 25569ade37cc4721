"""Argument checks against function docs, and BFCL call strings read without running them."""

from __future__ import annotations

from typing import Any

import pytest

from coevolve.shared.envs.bfcl.calls import CallStringError, call_string, parse_call_string
from coevolve.shared.envs.bfcl.catalog import FunctionDoc
from coevolve.shared.envs.bfcl.instances import function_table
from coevolve.shared.envs.bfcl.validation import CallLimits, CallValidationError, validate_call
from coevolve.shared.messages import ToolCall

FUNCTIONS = function_table(["GorillaFileSystem", "MathAPI", "TicketAPI", "TwitterAPI"])


def refused(name: str, arguments: Any, limits: CallLimits | None = None) -> str:
    with pytest.raises(CallValidationError) as caught:
        validate_call(ToolCall(name=name, arguments=arguments), FUNCTIONS, limits)
    return str(caught.value)


def test_valid_calls_pass_with_their_arguments() -> None:
    call = validate_call(ToolCall(name="mean", arguments={"numbers": [1, 2.5]}), FUNCTIONS)
    assert call.name == "mean" and call.arguments == {"numbers": [1, 2.5]}
    assert call.doc.class_name == "MathAPI"
    optional = validate_call(ToolCall(name="ls", arguments={}), FUNCTIONS)
    assert optional.arguments == {}


@pytest.mark.parametrize(
    ("name", "arguments", "expected"),
    [
        ("tail", {"file_name": "a", "lines": True}, "must be an integer, got boolean"),
        ("tail", {"file_name": "a", "lines": 2.0}, "must be an integer, got number"),
        ("add", {"a": "1", "b": 2}, "must be a number, got string"),
        ("ls", {"a": "yes"}, "must be true or false, got string"),
        ("mean", {"numbers": [1, "2"]}, "argument 'numbers'[1] must be a number"),
        ("mean", {"numbers": 3}, "must be an array, got integer"),
        ("cd", {"folder": None}, "must be a string, got null"),
        ("edit_ticket", {"ticket_id": 1, "updates": {"owner": "me"}}, "unknown key(s) ['owner']"),
        ("edit_ticket", {"ticket_id": 1, "updates": {"priority": "high"}}, "must be an integer"),
        ("cd", {}, "missing required argument(s): folder"),
    ],
)
def test_wrong_types_are_named_precisely(name: str, arguments: Any, expected: str) -> None:
    assert expected in refused(name, arguments)


def test_size_limits() -> None:
    limits = CallLimits(max_string_chars=5, max_array_items=3, max_abs_number=100, max_depth=2)
    assert "too long" in refused("cd", {"folder": "abcdef"}, limits)
    assert "too many items" in refused("mean", {"numbers": [1, 2, 3, 4]}, limits)
    assert "out of range" in refused("add", {"a": 101, "b": 1}, limits)
    assert "out of range" in refused("add", {"a": float("inf"), "b": 1}, CallLimits())
    deep = {"ticket_id": 1, "updates": {"title": "x"}}
    assert "nested deeper" in refused("edit_ticket", deep, CallLimits(max_depth=1))


def test_an_undocumented_schema_type_still_gets_bounded() -> None:
    doc = FunctionDoc("free", "MathAPI", "", {"type": "dict", "properties": {"x": {}}})
    limits = CallLimits(max_string_chars=3)
    with pytest.raises(CallValidationError, match="too long"):
        validate_call(ToolCall(name="free", arguments={"x": ["abcd"]}), {"free": doc}, limits)


def test_ground_truth_strings_become_tool_calls() -> None:
    involved = ["GorillaFileSystem", "TwitterAPI"]
    assert parse_call_string("cd(folder='document')", involved) == ToolCall(
        name="cd", arguments={"folder": "document"}
    )
    # positional arguments are named from the method's signature
    assert parse_call_string("sort('final_report.pdf')", involved).arguments == {
        "file_name": "final_report.pdf"
    }
    tags = parse_call_string("post_tweet(content='hi', tags=('#a', '#b'))", involved)
    assert tags.arguments == {"content": "hi", "tags": ["#a", "#b"]}


@pytest.mark.parametrize(
    "text",
    [
        "cd(folder=__import__('os').getcwd())",
        "cd(folder=open('/etc/passwd').read())",
        "os.system('ls')",
        "cd(**{'folder': 'x'})",
        "(lambda: 1)()",
        "cd(folder='a'",
        "cd",
    ],
)
def test_call_strings_that_are_not_plain_literal_calls_are_refused(text: str) -> None:
    with pytest.raises(CallStringError):
        parse_call_string(text, ["GorillaFileSystem"])


def test_call_string_is_built_from_values_with_repr() -> None:
    text = call_string("echo", {"content": 'it\'s "quoted"\n', "file_name": "a.txt"})
    assert text == "echo(content='it\\'s \"quoted\"\\n', file_name='a.txt')"
    assert parse_call_string(text, ["GorillaFileSystem"]).arguments == {
        "content": 'it\'s "quoted"\n',
        "file_name": "a.txt",
    }
