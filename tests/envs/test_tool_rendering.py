"""Tool rendering: compact (the default) vs full, one configured choice per process."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from coevolve.shared.config import ConfigError, Settings, load_settings
from coevolve.shared.envs.bfcl import BfclEnvironment, load_tasks
from coevolve.shared.envs.bfcl.catalog import function_docs
from coevolve.shared.envs.rendering import (
    TOOL_RENDERINGS,
    ToolRendering,
    configure_tool_rendering,
    configured_tool_rendering,
    short_type,
)
from coevolve.shared.messages import ChatMessage, Task
from coevolve.shared.policy.chat import (
    TemplateSupport,
    native_tools,
    render_prompt_ids,
    to_template_messages,
    tools_system_prompt,
)
from tests.support.cache import CACHE_DIR

BOILERPLATE = "This tool belongs to"
SMOLLM2_LIKE = TemplateSupport(tools=False, tool_role=False)
NATIVE_TOOLS = TemplateSupport(tools=True, tool_role=True)


def _two_class_env() -> BfclEnvironment:
    task = next(
        t for t in load_tasks("multi_turn_base") if len(t.env_config["involved_classes"]) > 1
    )
    env = BfclEnvironment()
    env.reset(task)
    return env


def test_compact_drops_the_boilerplate_and_names_each_class_once() -> None:
    env = _two_class_env()
    tools = env.tools()
    involved = env.task.env_config["involved_classes"]
    compact = tools_system_prompt(tools, "compact")
    full = tools_system_prompt(tools, "full")
    assert BOILERPLATE in full and BOILERPLATE not in compact
    lines = compact.splitlines()
    for class_name in involved:
        assert lines.count(f"# {class_name}") == 1
        assert sum(class_name in line for line in lines) == 1
        header = lines.index(f"# {class_name}")
        for doc in function_docs(class_name):
            [line] = [line for line in lines if line.startswith(f"{doc.name}(")]
            # one line per function, under its class's header, with the real description
            assert lines.index(line) > header
            assert line.endswith(f" - {' '.join(doc.summary.split())}")
            assert doc.summary and BOILERPLATE not in doc.summary
            for name, schema in doc.properties.items():
                mark = "" if name in doc.required else "?"
                assert f"{name}{mark}: {short_type(schema)}" in line.split(" - ")[0]
    assert len(compact) < len(full) / 3


def test_compact_signature_of_a_known_function() -> None:
    [tail] = [doc for doc in function_docs("GorillaFileSystem") if doc.name == "tail"]
    compact = tools_system_prompt([tail.tool_schema()], "compact")
    assert "tail(file_name: str, lines?: int) - Display the last part of a file" in compact


def test_default_rendering_is_compact() -> None:
    assert Settings().tool_rendering == "compact"
    load_settings()
    assert configured_tool_rendering() == "compact"
    env = _two_class_env()
    messages = [ChatMessage(role="user", content="hi")]
    system = to_template_messages(messages, env.tools(), SMOLLM2_LIKE)[0]["content"]
    assert system == tools_system_prompt(env.tools(), "compact")
    assert BOILERPLATE not in system and "<tools>" not in system


def test_the_configured_rendering_applies_where_none_is_named(tmp_path: Path) -> None:
    config = tmp_path / "coevolve.yaml"
    config.write_text("tool_rendering: full\n")
    assert load_settings(config).tool_rendering == "full"
    env = _two_class_env()
    system = to_template_messages([], env.tools(), SMOLLM2_LIKE)[0]["content"]
    assert "<tools>" in system and BOILERPLATE in system
    configure_tool_rendering("compact")
    system = to_template_messages([], env.tools(), SMOLLM2_LIKE)[0]["content"]
    assert "<tools>" not in system
    config.write_text("tool_rendering: terse\n")
    with pytest.raises(ConfigError, match="tool_rendering"):
        load_settings(config)


def test_a_template_with_tools_gets_them_natively_only_when_full() -> None:
    tools = _two_class_env().tools()
    assert native_tools(tools, NATIVE_TOOLS, "compact") is None
    native = native_tools(tools, NATIVE_TOOLS, "full")
    assert native is not None and len(native) == len(tools)
    # the compact hints never reach a template: it sees the OpenAI-style schema only
    assert all(set(tool) == {"type", "function"} for tool in native)
    assert to_template_messages([], tools, NATIVE_TOOLS, "full") == []
    [system] = to_template_messages([], tools, NATIVE_TOOLS, "compact")
    assert system["content"] == tools_system_prompt(tools, "compact")


def first_prompt_tokens(tokenizer: Any, task: Task, rendering: ToolRendering) -> int:
    """Tokens of ``task``'s first prompt as a rollout renders it under ``rendering``."""
    env = BfclEnvironment()
    try:
        messages = env.reset(task)
        return len(render_prompt_ids(tokenizer, messages, env.tools(), tool_rendering=rendering))
    finally:
        env.close()


@pytest.mark.parametrize("rendering", TOOL_RENDERINGS)
def test_an_eval_sequence_holds_every_held_out_turn_played_or_scored(
    rendering: ToolRendering,
) -> None:
    """A first prompt and its messages, and the replayed ground truth the likelihood
    scores, each fit one of eval's llama.cpp sequences."""
    from coevolve.cli.eval_cmd import (
        EVAL_MAX_NEW_TOKENS,
        EVAL_MAX_STEPS_PER_TURN,
        EVAL_SEQUENCE_TOKENS,
    )
    from coevolve.shared.demonstrations import (
        ReplayError,
        replayed_conversation,
        tokenize_conversation,
    )
    from coevolve.shared.envs.bfcl import suite_tasks
    from coevolve.shared.policy.loading import load_tokenizer

    tokenizer = load_tokenizer(run_dir=CACHE_DIR)  # the converted model, shared by the tests
    tasks = suite_tasks("bfcl-turns-base", "eval")
    longest = max(first_prompt_tokens(tokenizer, task, rendering) for task in tasks)
    messages = EVAL_MAX_STEPS_PER_TURN * EVAL_MAX_NEW_TOKENS
    assert longest + messages <= EVAL_SEQUENCE_TOKENS[rendering]

    before = configured_tool_rendering()
    configure_tool_rendering(rendering)
    try:
        scored = []
        for task in tasks:
            env = BfclEnvironment()
            try:
                conversation = replayed_conversation(task, env)
            except ReplayError:  # the scorer leaves such a turn unscored
                continue
            finally:
                env.close()
            examples = tokenize_conversation(tokenizer, conversation, supervise_closing=False)
            scored += [len(example.input_ids) for example in examples]
    finally:
        configure_tool_rendering(before)
    assert len(scored) >= 0.9 * len(tasks) and max(scored) <= EVAL_SEQUENCE_TOKENS[rendering]
