"""LLM clients for the data-loop roles: one interface, an HTTP and an in-process backend."""

from coevolve.shared.llm.client import (
    ChatMessages,
    LLMClient,
    LLMError,
    LLMOutputError,
    LLMResponse,
    LLMUnavailable,
)
from coevolve.shared.llm.local_backend import LocalBackend
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

__all__ = [
    "ROLES",
    "ChatMessages",
    "LLMClient",
    "LLMError",
    "LLMOutputError",
    "LLMResponse",
    "LLMUnavailable",
    "LocalBackend",
    "OpenAIBackend",
    "OpenAISettings",
    "Role",
    "RoleClients",
    "RoleConfigError",
    "RoleLLM",
    "RoleSettings",
    "TokenBucket",
    "role_settings",
    "role_settings_from_yaml",
]
