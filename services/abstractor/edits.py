"""The request of a substitution round whose parent request names the old value in other
words ("Quasar Ltd." for ``QUAS``, "my cousin Bob" for ``USR002``): the abstractor's LLM
says which words of the parent's request name it, and code puts the new value there.

Asked to write the edited request itself, the 0.5B copied the prompt's example, dropped
most of the sentence or wrote calls into it (6 of 7 edits in a first try); naming the
words is a choice among the request's own names (``naming_spans``, an ``enum``), and the
rest of the sentence stays the person's.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

import msgspec

from coevolve.services.abstractor.call_units import CallUnit
from coevolve.services.abstractor.prompts import render_conversation
from coevolve.shared.argument_values import salient_values
from coevolve.shared.llm.client import ChatMessages
from coevolve.shared.messages import ChatMessage, ToolCall
from coevolve.shared.value_roles import role_problems

# a name is at most this many words ("Synex Solutions", "Quasar Ltd.")
MAX_SPAN_WORDS = 3

SPAN_SYSTEM = (
    "You read a user's message to an AI assistant that acts through function calls, and "
    "find the words in it that name a given value."
)


class NamingWords(msgspec.Struct, forbid_unknown_fields=True):
    """What the abstractor role answers for an edit: the words naming the old value."""

    words: str


# a quoted stretch of the request (a message to send, a file's text): a value of its own
_QUOTED = re.compile(r"(?<![\w])(['‘\"“])[^'’\"”]+?['’\"”](?![\w])")
_SENTENCE_END = re.compile(r"(?<=[.?!])\s+")
_ABBREVIATIONS = ("Ltd.", "Inc.", "Corp.", "Co.")
# the answer that no words name the value (then there is no edit)
NO_WORDS = "(none)"


def _token_core(token: str) -> str:
    """A word without the punctuation around it and without a possessive ("Corp’s")."""
    core = token.strip("\"'“”‘’()[],;:!?")
    core = re.sub(r"['’]s$", "", core)
    return core if core.endswith(_ABBREVIATIONS) else core.rstrip(".")


def _name_like(word: str) -> bool:
    """A capitalised word or one with letters and digits (``USR005``), not "I"."""
    has_digit = any(c.isdigit() for c in word)
    return len(word) > 1 and (word[0].isupper() or (has_digit and not word.isdigit()))


def naming_spans(request: str, calls: Sequence[ToolCall] = ()) -> list[str]:
    """The runs of capitalised words (or ids) of ``request``, outside its quotes and
    within a sentence, as it writes them, but those written inside an argument of
    ``calls`` (the parent's: "Rivermist" in a message about Rivermist names the city,
    not the user the message is for; the 0.5B chose it in run 29): the names a value can
    go by. A sentence's first word has its capital as a first word: a run it opens is
    offered without it too, and it is no name alone."""
    spans: list[str] = []
    # a short quoted name ("50 shares of 'Apple'") is a name; a longer quote a message
    for quoted in _QUOTED.finditer(request):
        inner = quoted.group(0)[1:-1].strip()
        words = inner.split()
        if 0 < len(words) <= MAX_SPAN_WORDS and all(_name_like(_token_core(w)) for w in words):
            spans.append(inner)
    for sentence in _SENTENCE_END.split(_QUOTED.sub(" | ", request)):
        run: list[str] = []
        tokens = [_token_core(token) for token in sentence.split()]
        for position, word in enumerate([*tokens, ""]):
            if word and _name_like(word) and word != "|":
                run.append(word)
                continue
            opens = position == len(run)
            options = ([run[1:], run] if len(run) > 1 else []) if opens else [run]
            for option in options:
                span = " ".join(option)
                if option and span in request and span not in spans:
                    spans.append(span)
            run = []
    written = [str(v).lower() for _, _, v in salient_values(calls) if isinstance(v, str)]
    return [span for span in spans if not any(span.lower() in text for text in written)]


def _call_line(calls: Sequence[ToolCall]) -> str:
    return "; ".join(
        f"{call.name}("
        + ", ".join(f"{k}={json.dumps(v, ensure_ascii=False)}" for k, v in call.arguments.items())
        + ")"
        for call in calls
    )


def span_messages(
    parent_request: str,
    parent_calls: Sequence[ToolCall],
    old: Any,
    conversation: Sequence[ChatMessage] = (),
) -> ChatMessages:
    """The prompt asking which words of ``parent_request`` name ``old``."""
    earlier = (
        f"The conversation before it:\n{render_conversation(conversation)}\n\n"
        if conversation
        else ""
    )
    value = json.dumps(old, ensure_ascii=False)
    user = (
        f"{earlier}Message: {json.dumps(parent_request, ensure_ascii=False)}\n"
        f"The assistant answered it with: {_call_line(parent_calls)}\n\n"
        f"Which words of the message name the value {value}? A message may name a stock "
        "symbol by its company, or a user id by the person's name. Answer with one JSON "
        'object: {"words": <those words, exactly as the message writes them, or '
        f'"{NO_WORDS}" when no words name it>}}.'
    )
    return [{"role": "system", "content": SPAN_SYSTEM}, {"role": "user", "content": user}]


def span_schema(spans: Sequence[str]) -> dict[str, Any]:
    """The words are one of ``spans`` or ``NO_WORDS``."""
    return {
        "type": "object",
        "properties": {"words": {"type": "string", "enum": [*spans, NO_WORDS]}},
        "required": ["words"],
        "additionalProperties": False,
    }


def edited_request(request: str, span: str, new: Any) -> str:
    """``request`` with each whole occurrence of ``span`` written as ``new``."""
    return re.sub(rf"(?<![\w]){re.escape(span)}(?![\w])", str(new), request)


def edit_unit_problems(
    unit: CallUnit, request: str, span: str, parent_request: str | None = None
) -> list[str]:
    """Why the edited request cannot be the unit's; [] when it can: the words are not in
    it, or (given the parent's request) the new value took another party's place, as
    the judge's ``keeps_roles`` rejects it (``shared.value_roles``). (A span written
    inside the calls is never offered: ``naming_spans``.)"""
    assert unit.replaced is not None
    old, new = unit.replaced
    if str(new) not in request:
        return [f"the words {span!r} are not in the request"]
    if parent_request is None:
        return []
    return role_problems(parent_request, request, old, new, unit.calls)
