"""The one interface every LLM role talks through, whatever serves the model.

A backend turns chat messages (plus an optional JSON schema that the output must follow)
into an :class:`LLMResponse`. Transport failures that outlast the backend's retries raise
:class:`LLMUnavailable` (the caller should retry the work later, not drop it); output that
cannot be used raises :class:`LLMOutputError` (the caller should reject the work item).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, NotRequired, Protocol, TypedDict, Unpack, runtime_checkable

ChatMessages = list[dict[str, str]]


@dataclass(frozen=True)
class LLMResponse:
    """What the model said. ``parsed`` is the decoded JSON when a schema was requested and
    the text is valid JSON, else None; checking it against a type is the caller's job
    (see ``coevolve.shared.structured``)."""

    text: str
    parsed: Any | None = None
    finish_reason: str = "stop"
    model: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    attempts: int = 1


class LLMError(RuntimeError):
    """Base class of the errors an LLM backend raises."""


class LLMUnavailable(LLMError):
    """The backend could not be reached (or kept failing) within its retry budget."""


class LLMOutputError(LLMError):
    """The backend answered, but with something that is not a usable chat completion
    (not JSON, no choices, a response larger than allowed)."""

    def __init__(self, reason: str, kind: str = "bad_response", status: int | None = None) -> None:
        super().__init__(reason)
        self.kind = kind
        self.status = status


class ChatOptions(TypedDict):
    """The keyword arguments of every ``chat``: a wrapper passes them on as they came."""

    schema: NotRequired[dict[str, Any] | None]  # absent or None: free text
    max_tokens: int
    temperature: float


class Chat(Protocol):
    """What asks a model: the one ``chat`` signature of every client and role."""

    async def chat(self, messages: ChatMessages, **options: Unpack[ChatOptions]) -> LLMResponse: ...


@runtime_checkable
class LLMClient(Chat, Protocol):
    """A client of one endpoint: it asks, has a name for logs and holds connections."""

    name: str

    async def aclose(self) -> None: ...


def parse_json_or_none(text: str) -> Any | None:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None
