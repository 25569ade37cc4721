"""LLM clients for the data-loop roles: one interface over OpenAI-compatible endpoints, and
the local llama.cpp server that serves them when the configuration names none."""

from coevolve.shared.llm.client import (
    ChatMessages,
    LLMClient,
    LLMError,
    LLMOutputError,
    LLMResponse,
    LLMUnavailable,
)
from coevolve.shared.llm.openai_backend import OpenAIBackend, OpenAISettings, TokenBucket
from coevolve.shared.llm.roles import (
    ROLES,
    Role,
    RoleClients,
    RoleConfigError,
    RoleLLM,
    RoleSettings,
    role_settings,
    role_settings_from_yaml,
)
from coevolve.shared.llm.server import LlamaServer, LLMServerError, ServerSettings

__all__ = [
    "ROLES",
    "ChatMessages",
    "LLMClient",
    "LLMError",
    "LLMOutputError",
    "LLMResponse",
    "LLMServerError",
    "LLMUnavailable",
    "LlamaServer",
    "OpenAIBackend",
    "OpenAISettings",
    "Role",
    "RoleClients",
    "RoleConfigError",
    "RoleLLM",
    "RoleSettings",
    "ServerSettings",
    "TokenBucket",
    "role_settings",
    "role_settings_from_yaml",
]
