"""Render a conversation with tools into the token ids the policy conditions on.

Two paths, chosen by probing the tokenizer's chat template once:

- the template renders ``tools=`` (Qwen, Hermes, Llama 3.1, ...): the tools go through it;
- it does not (SmolLM2): a system prompt lists the tools' JSON schemas and the
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` convention.

Likewise ``role="tool"`` messages pass through a template that knows that role; otherwise
they become user messages starting with ``Observation:`` so the model sees them as input.
Assistant messages are rendered from their text: the text the model generated already
holds its ``<tool_call>`` blocks, so re-rendering reproduces what was sampled. Calls that
exist only as ``tool_calls`` (ground truth written by hand) are appended as text.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from transformers import PreTrainedTokenizerBase

from coevolve.shared.messages import ChatMessage
from coevolve.shared.toolcalls import format_tool_calls

OBSERVATION_PREFIX = "Observation: "
TOOL_CALL_OPEN = "<tool_call>"

_PROBE_TOOL_NAME = "coevolve_probe_tool_7f3a"
_PROBE_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": _PROBE_TOOL_NAME,
        "description": "probe",
        "parameters": {"type": "object", "properties": {}},
    },
}
_TOOL_ROLE_IN_TEMPLATE = re.compile(r"""['"]tool['"]""")


@dataclass(frozen=True)
class TemplateSupport:
    tools: bool
    tool_role: bool


_support_cache: dict[str, TemplateSupport] = {}


def template_support(tokenizer: PreTrainedTokenizerBase) -> TemplateSupport:
    """Whether the chat template renders ``tools=`` and knows a ``tool`` role."""
    template = tokenizer.chat_template
    if not isinstance(template, str):
        raise ValueError("the tokenizer has no (single) chat template to render with")
    cached = _support_cache.get(template)
    if cached is not None:
        return cached
    try:
        probe = tokenizer.apply_chat_template(
            [{"role": "user", "content": "hi"}],
            tools=[_PROBE_TOOL],
            tokenize=False,
            add_generation_prompt=True,
        )
        renders_tools = isinstance(probe, str) and _PROBE_TOOL_NAME in probe
    except Exception:  # a template that chokes on tools= does not support them
        renders_tools = False
    support = TemplateSupport(
        tools=renders_tools, tool_role=bool(_TOOL_ROLE_IN_TEMPLATE.search(template))
    )
    _support_cache[template] = support
    return support


def tools_system_prompt(tools: list[dict[str, Any]]) -> str:
    schemas = "\n".join(json.dumps(tool.get("function", tool)) for tool in tools)
    return (
        "You can call functions to complete the user's task. The functions are listed as "
        "JSON schemas:\n<tools>\n"
        f"{schemas}\n</tools>\n"
        "To call a function, answer with one block per call, exactly in this form:\n"
        '<tool_call>{"name": "function_name", "arguments": {"arg": "value"}}</tool_call>\n'
        f'Each result comes back in a message starting with "{OBSERVATION_PREFIX.strip()}". '
        "When the task is done, answer in plain text without a tool call."
    )


def to_template_messages(
    messages: list[ChatMessage], tools: list[dict[str, Any]] | None, support: TemplateSupport
) -> list[dict[str, Any]]:
    """Plain dicts for ``apply_chat_template``, adapted to what the template supports."""
    rendered: list[dict[str, Any]] = []
    for message in messages:
        content = message.content
        if message.role == "assistant" and message.tool_calls and TOOL_CALL_OPEN not in content:
            calls = format_tool_calls(message.tool_calls)
            content = f"{content}\n{calls}" if content else calls
        if message.role == "tool" and not support.tool_role:
            rendered.append({"role": "user", "content": OBSERVATION_PREFIX + content})
        else:
            rendered.append({"role": message.role, "content": content})
    if tools and not support.tools:
        prompt = tools_system_prompt(tools)
        if rendered and rendered[0]["role"] == "system":
            rendered[0] = {"role": "system", "content": f"{rendered[0]['content']}\n\n{prompt}"}
        else:
            rendered.insert(0, {"role": "system", "content": prompt})
    return rendered


def render_text(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[ChatMessage],
    tools: list[dict[str, Any]] | None,
    *,
    add_generation_prompt: bool = True,
) -> str:
    support = template_support(tokenizer)
    native_tools: Any = tools if (tools and support.tools) else None
    text = tokenizer.apply_chat_template(
        to_template_messages(messages, tools, support),
        tools=native_tools,
        tokenize=False,
        add_generation_prompt=add_generation_prompt,
    )
    if not isinstance(text, str):
        raise TypeError(f"chat template rendered {type(text).__name__}, expected str")
    return text


def encode_text(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """Token ids of rendered text; special tokens come from the text, none are added."""
    ids: list[int] = tokenizer(text, add_special_tokens=False)["input_ids"]
    return ids


def decode_ids(tokenizer: PreTrainedTokenizerBase, ids: list[int]) -> str:
    """Text of ``ids`` exactly as sampled: special tokens kept, no space clean-up."""
    text = tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    if not isinstance(text, str):
        raise TypeError(f"tokenizer decoded {type(text).__name__}, expected str")
    return text


def render_prompt_ids(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[ChatMessage],
    tools: list[dict[str, Any]] | None,
    *,
    add_generation_prompt: bool = True,
) -> list[int]:
    """Token ids of ``messages`` (with ``tools``), ending in the assistant prompt by default."""
    text = render_text(tokenizer, messages, tools, add_generation_prompt=add_generation_prompt)
    return encode_text(tokenizer, text)
