"""How experiences enter a navigated episode's prompt, and how they leave it again.

The advice goes at the end of the first system message (a new system message opens the
conversation when there is none), so everything after it, the user's request included,
renders as it would without it. ``shared/episodes.py`` renders the first prompt both ways
and, when the episode ends, swaps the guided prompt's tokens for the plain ones: the
training sample holds no experience text.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from coevolve.shared.messages import ChatMessage, Experience

HEADER = "Advice from earlier attempts at similar requests:"


def guidance_text(experiences: Sequence[Experience]) -> str:
    """The block a navigated prompt carries: one line per experience."""
    lines = [f"- {experience.text}" for experience in experiences]
    return "\n".join([HEADER, *lines])


def with_guidance(messages: Sequence[ChatMessage], guidance: str) -> list[ChatMessage]:
    """``messages`` with ``guidance`` appended to the first system message (or in a new
    system message first)."""
    if messages and messages[0].role == "system":
        first = messages[0]
        content = f"{first.content}\n\n{guidance}" if first.content else guidance
        return [msgspec.structs.replace(first, content=content), *messages[1:]]
    return [ChatMessage(role="system", content=guidance), *messages]
