"""Render a conversation with tools into the token ids the policy conditions on.

Two paths, chosen by probing the tokenizer's chat template once:

- the template renders ``tools=`` (Qwen, Hermes, Llama 3.1, ...): the tools go through it;
- it does not (SmolLM2): a system prompt lists the tools' JSON schemas and the
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` convention.

That is the ``full`` tool rendering. The ``compact`` one (the default; see
``coevolve.shared.envs.rendering``) always uses the system prompt, with one line per
function instead of its schema, whatever the template supports: a template's own tool
rendering is its JSON. ``tool_rendering=None`` means the process's configured rendering.

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

from coevolve.shared.envs.rendering import (
    ToolRendering,
    check_tool_rendering,
    compact_listing,
    configured_tool_rendering,
    function_of,
    schema_only,
)
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


def tools_system_prompt(
    tools: list[dict[str, Any]], tool_rendering: ToolRendering | None = None
) -> str:
    rendering = resolve_tool_rendering(tool_rendering)
    if rendering == "compact":
        listing = (
            "You can call these functions to complete the user's task "
            "(name(argument: type, optional?: type) - what it does):\n"
            f"{compact_listing(tools)}\n"
        )
    else:
        schemas = "\n".join(json.dumps(function_of(tool)) for tool in tools)
        listing = (
            "You can call functions to complete the user's task. The functions are listed as "
            f"JSON schemas:\n<tools>\n{schemas}\n</tools>\n"
        )
    return (
        f"{listing}"
        "To call a function, answer with one block per call, exactly in this form:\n"
        '<tool_call>{"name": "function_name", "arguments": {"arg": "value"}}</tool_call>\n'
        f'Each result comes back in a message starting with "{OBSERVATION_PREFIX.strip()}". '
        "When the task is done, answer in plain text without a tool call."
    )


def resolve_tool_rendering(tool_rendering: str | None) -> ToolRendering:
    """``tool_rendering``, or the process's configured one when it is None."""
    if tool_rendering is None:
        return configured_tool_rendering()
    return check_tool_rendering(tool_rendering)


def native_tools(
    tools: list[dict[str, Any]] | None,
    support: TemplateSupport,
    tool_rendering: ToolRendering | None = None,
) -> list[dict[str, Any]] | None:
    """The tools to hand the template itself (only ``full`` rendering with a template that
    renders them), without rendering hints; None when the system prompt lists them."""
    if not tools or not support.tools or resolve_tool_rendering(tool_rendering) != "full":
        return None
    return [schema_only(tool) for tool in tools]


def to_template_messages(
    messages: list[ChatMessage],
    tools: list[dict[str, Any]] | None,
    support: TemplateSupport,
    tool_rendering: ToolRendering | None = None,
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
    if tools and native_tools(tools, support, tool_rendering) is None:
        prompt = tools_system_prompt(tools, tool_rendering)
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
    tool_rendering: ToolRendering | None = None,
) -> str:
    support = template_support(tokenizer)
    rendering = resolve_tool_rendering(tool_rendering)
    template_tools: Any = native_tools(tools, support, rendering)
    text = tokenizer.apply_chat_template(
        to_template_messages(messages, tools, support, rendering),
        tools=template_tools,
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
    tool_rendering: ToolRendering | None = None,
) -> list[int]:
    """Token ids of ``messages`` (with ``tools``), ending in the assistant prompt by default."""
    text = render_text(
        tokenizer,
        messages,
        tools,
        add_generation_prompt=add_generation_prompt,
        tool_rendering=tool_rendering,
    )
    return encode_text(tokenizer, text)
