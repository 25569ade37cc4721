"""Prompt rendering: tools through the template when it can, a system prompt otherwise."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
from transformers import PreTrainedTokenizerBase

from coevolve.shared.messages import ChatMessage, ToolCall
from coevolve.shared.policy import (
    OBSERVATION_PREFIX,
    LoadedPolicy,
    render_prompt_ids,
    render_text,
    template_support,
)
from coevolve.shared.toolcalls import format_tool_calls, parse_tool_calls

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "cd",
            "description": "Change directory.",
            "parameters": {
                "type": "object",
                "properties": {"folder": {"type": "string"}},
                "required": ["folder"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "ls",
            "description": "List files.",
            "parameters": {"type": "object", "properties": {}},
        },
    },
]

CONVERSATION = [
    ChatMessage(role="user", content="Go to the docs folder and list it."),
    ChatMessage(
        role="assistant",
        content='<tool_call>{"name": "cd", "arguments": {"folder": "docs"}}</tool_call>',
    ),
    ChatMessage(role="tool", content='{"current_working_directory": "docs"}'),
]

# A template of our own that renders tools and has a tool role (like Qwen / Hermes ones).
TOOLS_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTools:\n"
    "{%- for tool in tools %}\n{{ tool.function.name }} {{ tool | tojson }}{%- endfor %}"
    "<|im_end|>\n{% endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'tool' %}<|im_start|>user\n<tool_response>{{ message.content }}"
    "</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def tools_tokenizer(policy: LoadedPolicy) -> PreTrainedTokenizerBase:
    tokenizer = copy.deepcopy(policy.tokenizer)
    tokenizer.chat_template = TOOLS_TEMPLATE
    return tokenizer


def test_smollm2_template_gets_tools_as_a_system_prompt(policy: LoadedPolicy) -> None:
    tokenizer = policy.tokenizer
    support = template_support(tokenizer)
    assert not support.tools and not support.tool_role
    text = render_text(tokenizer, CONVERSATION, TOOLS, tool_rendering="full")
    system = text.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\n")
    for tool in TOOLS:
        assert json.dumps(tool["function"]) in system
    assert '<tool_call>{"name": ' in system
    # the observation is a user turn the model reads, then the assistant prompt follows
    assert f"<|im_start|>user\n{OBSERVATION_PREFIX}" + CONVERSATION[2].content in text
    assert "<|im_start|>tool" not in text
    assert text.endswith("<|im_end|>\n<|im_start|>assistant\n")


def test_system_message_is_kept_and_tools_appended(policy: LoadedPolicy) -> None:
    messages = [ChatMessage(role="system", content="Be brief."), *CONVERSATION[:1]]
    text = render_text(policy.tokenizer, messages, TOOLS, tool_rendering="full")
    assert text.count("<|im_start|>system") == 1
    assert text.startswith("<|im_start|>system\nBe brief.\n\nYou can call functions")


def test_no_tools_renders_the_plain_template(policy: LoadedPolicy) -> None:
    text = render_text(policy.tokenizer, CONVERSATION[:1], None)
    assert "<tools>" not in text
    expected = policy.tokenizer.apply_chat_template(
        [{"role": "user", "content": CONVERSATION[0].content}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert text == expected


def test_prompt_ids_are_the_rendered_text_without_added_specials(policy: LoadedPolicy) -> None:
    tokenizer = policy.tokenizer
    ids = render_prompt_ids(tokenizer, CONVERSATION, TOOLS)
    assert tokenizer.decode(ids) == render_text(tokenizer, CONVERSATION, TOOLS)
    im_start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert ids[0] == im_start  # no BOS added in front of the template's own tokens
    assert ids.count(im_start) == 5  # system, user, assistant, observation, prompt
    closed = render_prompt_ids(tokenizer, CONVERSATION, TOOLS, add_generation_prompt=False)
    assert ids[: len(closed)] == closed


def test_calls_given_only_as_structure_are_rendered_as_text(policy: LoadedPolicy) -> None:
    calls = [ToolCall(name="cd", arguments={"folder": "docs"}), ToolCall(name="ls")]
    message = ChatMessage(role="assistant", content="", tool_calls=calls)
    text = render_text(policy.tokenizer, [*CONVERSATION[:1], message], TOOLS)
    assert format_tool_calls(calls) in text
    turn = text.split("<|im_start|>assistant\n")[1]
    assert parse_tool_calls(turn).calls == calls


def test_template_with_tools_support_gets_them_natively(
    tools_tokenizer: PreTrainedTokenizerBase,
) -> None:
    support = template_support(tools_tokenizer)
    assert support.tools and support.tool_role
    text = render_text(tools_tokenizer, CONVERSATION, TOOLS, tool_rendering="full")
    system = text.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\nTools:")
    assert all(json.dumps(tool) in system for tool in TOOLS)
    assert "You can call functions" not in text
    assert f"<tool_response>{CONVERSATION[2].content}</tool_response>" in text
    assert OBSERVATION_PREFIX not in text
    # the assistant's generated text goes through verbatim
    assert f"<|im_start|>assistant\n{CONVERSATION[1].content}<|im_end|>" in text
