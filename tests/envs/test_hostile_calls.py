"""A hostile corpus of tool calls: each gets a clear error observation and nothing runs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import coevolve.shared.envs.bfcl.environment as environment_module
from coevolve.shared.envs.bfcl import BfclEnvironment
from coevolve.shared.messages import Task
from tests.envs.conftest import first_task_with_class

CANARY = "coevolve_hostile_canary"


def block(payload: Any) -> str:
    body = payload if isinstance(payload, str) else json.dumps(payload)
    return f"<tool_call>{body}</tool_call>"


def touch(path: Path) -> str:
    return f"__import__('os').system('touch {path}')"


def hostile_corpus(canary_file: Path) -> dict[str, str]:
    shell = touch(canary_file)
    return {
        # dunder and builtin names
        "dunder class": block({"name": "__class__", "arguments": {}}),
        "dunder import": block({"name": "__import__", "arguments": {"name": "os"}}),
        "dunder init": block({"name": "__init__", "arguments": {}}),
        "dunder eq": block({"name": "__eq__", "arguments": {"other": 1}}),
        "dunder dict": block({"name": "__dict__", "arguments": {}}),
        "builtin eval": block({"name": "eval", "arguments": {"source": shell}}),
        "builtin exec": block({"name": "exec", "arguments": {"source": shell}}),
        "builtin getattr": block({"name": "getattr", "arguments": {"o": "os", "name": "system"}}),
        "builtin open": block({"name": "open", "arguments": {"file": str(canary_file)}}),
        "blocked by bfcl": block({"name": "kill", "arguments": {}}),
        # attribute chains and call syntax in the name
        "attribute chain": block({"name": "root.contents.clear", "arguments": {}}),
        "class attribute": block({"name": "GorillaFileSystem._load_scenario", "arguments": {}}),
        "module attribute": block({"name": "os.system", "arguments": {"command": shell}}),
        "call syntax name": block({"name": "cd(folder='..')", "arguments": {}}),
        "nested call name": block({"name": f"cd(folder={shell})", "arguments": {}}),
        "lambda name": block({"name": f"lambda: {shell}", "arguments": {}}),
        "spaced name": block({"name": " cd", "arguments": {"folder": "document"}}),
        "fullwidth name": block({"name": "ｃｄ", "arguments": {"folder": "document"}}),
        # private and undocumented methods of the episode's own instances
        "private load": block({"name": "_load_scenario", "arguments": {"scenario": {}}}),
        "private navigate": block({"name": "_navigate_to_directory", "arguments": {"path": "/"}}),
        "private validate": block(
            {"name": "_validate_file_or_directory_name", "arguments": {"dir_name": "x"}}
        ),
        # unknown functions
        "unknown": block({"name": "rm_rf", "arguments": {"path": "/"}}),
        "unknown system": block({"name": "system", "arguments": {"command": shell}}),
        # code or calls inside arguments, where the documented type is not a string
        "lambda argument": block(
            {"name": "tail", "arguments": {"file_name": "x", "lines": "lambda: 1"}}
        ),
        "import argument": block({"name": "tail", "arguments": {"file_name": "x", "lines": shell}}),
        "nested call argument": block(
            {"name": "cd", "arguments": {"folder": {"name": "rm", "arguments": {"file_name": "a"}}}}
        ),
        "dunder argument name": block(
            {"name": "cd", "arguments": {"folder": "document", "__class__": "x"}}
        ),
        "list arguments": block({"name": "cd", "arguments": ["document"]}),
        # Python instead of JSON
        "python call": block(f"cd(folder='document'); {shell}"),
        "python lambda": block(f"(lambda: {shell})()"),
        # sizes
        "huge block": block({"name": "echo", "arguments": {"content": "x" * 1_000_000}}),
        "huge string": block({"name": "echo", "arguments": {"content": "x" * 20_000}}),
        "huge number": block({"name": "tail", "arguments": {"file_name": "a", "lines": 10**30}}),
        "deep nesting": block({"name": "ls", "arguments": {"a": [[[[[[[[True]]]]]]]]}}),
    }


@pytest.fixture
def filesystem_task(base_tasks: list[Task]) -> Task:
    return first_task_with_class(base_tasks, "GorillaFileSystem")


@pytest.fixture
def dispatch_counter(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Counts every call that reaches an API method."""
    dispatched: list[str] = []
    real_dispatch = environment_module.dispatch

    def counting(instances: Any, call: Any) -> Any:
        dispatched.append(call.name)
        return real_dispatch(instances, call)

    monkeypatch.setattr(environment_module, "dispatch", counting)
    return dispatched


def test_every_hostile_call_is_refused_with_a_clear_error(
    filesystem_task: Task, dispatch_counter: list[str], tmp_path: Path
) -> None:
    canary_file = tmp_path / CANARY
    corpus = hostile_corpus(canary_file)
    for label, text in corpus.items():
        env = BfclEnvironment()
        env.reset(filesystem_task)
        before = env.state()
        result = env.step(text)
        assert len(result.observations) == 1, label
        observation = result.observations[0]
        assert observation.role == "tool", label
        assert observation.content.startswith("Error: "), (label, observation.content)
        assert len(observation.content) < 2_000, label
        assert result.info["calls"] == [], label
        assert not result.done and env.turn == 0, label
        assert env.state() == before, label
        assert env.record == [[[]]], label
    assert dispatch_counter == []
    assert not canary_file.exists()


def test_hostile_math_arguments_that_would_take_forever_are_refused(
    base_tasks: list[Task], dispatch_counter: list[str]
) -> None:
    task = first_task_with_class(base_tasks, "MathAPI")
    env = BfclEnvironment()
    env.reset(task)
    for name, arguments in [
        ("power", {"base": 10, "exponent": 10**9}),
        ("logarithm", {"value": 10, "base": 2, "precision": 10**8}),
        ("square_root", {"number": 2, "precision": 10**8}),
        ("add", {"a": float("1e300"), "b": 1}),
        ("mean", {"numbers": [1.0] * 5_000}),
    ]:
        result = env.step(block({"name": name, "arguments": arguments}))
        content = result.observations[0].content
        assert content.startswith("Error: "), name
        assert any(word in content for word in ("between", "range", "too many")), content
    assert dispatch_counter == []


def test_code_inside_a_string_argument_stays_inert_data(
    filesystem_task: Task, tmp_path: Path
) -> None:
    canary_file = tmp_path / CANARY
    env = BfclEnvironment()
    env.reset(filesystem_task)
    before = env.state()
    payloads = [touch(canary_file), f"lambda: {touch(canary_file)}", "rm(file_name='a')"]
    for payload in payloads:
        result = env.step(block({"name": "cd", "arguments": {"folder": payload}}))
        # cd runs with the text as a folder name; the API answers that no such folder exists
        assert result.info["calls"] == ["cd"]
        assert "error" in result.observations[0].content.lower()
    assert env.state() == before
    assert not canary_file.exists()


def test_an_exception_inside_an_api_method_is_an_observation(
    filesystem_task: Task, monkeypatch: pytest.MonkeyPatch
) -> None:
    env = BfclEnvironment()
    env.reset(filesystem_task)
    instance = env._instances["GorillaFileSystem"]

    def broken(**_: Any) -> None:
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(instance, "pwd", broken)
    result = env.step(block({"name": "pwd", "arguments": {}}))
    assert result.observations[0].content == "Error during execution: disk on fire"
    assert result.info["errors"] and not result.done
