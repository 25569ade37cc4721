"""Which backend, model and sampling parameters each LLM role uses.

Configuration (a dict, e.g. the ``llm`` section of ``coevolve.yaml``)::

    default: {backend: local}                  # applies to every role
    roles:
      explorer: {temperature: 0.9}
      judge:
        backend: openai
        base_url: http://gpu-box:8000/v1
        model: Qwen/Qwen3-32B
        temperature: 0.0

Each role's settings are ``default`` updated with the role's own keys. Roles whose
backend settings are equal share one backend instance, so the local model loads once.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import msgspec
import yaml

from coevolve.shared.llm.client import ChatMessages, LLMClient, LLMResponse
from coevolve.shared.llm.local_backend import LocalBackend
from coevolve.shared.llm.openai_backend import OpenAIBackend, OpenAISettings

Role = Literal["summarizer", "explorer", "abstractor", "judge"]
ROLES: tuple[Role, ...] = ("summarizer", "explorer", "abstractor", "judge")


class RoleSettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, frozen=True):
    backend: Literal["local", "openai"] = "local"
    model: str | None = None
    # sampling
    max_tokens: int = 256
    temperature: float = 0.7
    # local backend
    device: str | None = None
    # openai backend
    base_url: str | None = None
    api_key_env: str | None = "OPENAI_API_KEY"
    timeout_s: float = 120.0
    connect_timeout_s: float = 5.0
    max_retries: int = 8
    give_up_after_s: float = 300.0
    backoff_base_s: float = 0.5
    backoff_max_s: float = 30.0
    requests_per_s: float = 5.0
    burst: int = 5
    max_response_bytes: int = 4_000_000

    def backend_key(self) -> tuple[Any, ...]:
        """What identifies the backend instance (sampling parameters excluded)."""
        if self.backend == "local":
            return ("local", self.model, self.device)
        fields = msgspec.structs.asdict(self)
        return tuple(sorted((k, v) for k, v in fields.items() if k not in _SAMPLING))


_SAMPLING = frozenset({"max_tokens", "temperature"})


class LLMSettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    default: dict[str, Any] = msgspec.field(default_factory=dict)
    roles: dict[Role, dict[str, Any]] = msgspec.field(default_factory=dict)


class RoleConfigError(ValueError):
    """A role's LLM settings cannot be used; the message names the role and the key."""


def role_settings(section: dict[str, Any] | LLMSettings | None) -> dict[Role, RoleSettings]:
    """Every role's settings from an ``llm`` config section (missing section: defaults)."""
    try:
        settings = (
            section
            if isinstance(section, LLMSettings)
            else msgspec.convert(section or {}, LLMSettings, strict=False)
        )
    except msgspec.ValidationError as exc:
        raise RoleConfigError(f"llm: {exc}") from exc
    resolved: dict[Role, RoleSettings] = {}
    for role in ROLES:
        merged = {**settings.default, **settings.roles.get(role, {})}
        try:
            config = msgspec.convert(merged, RoleSettings, strict=False)
        except msgspec.ValidationError as exc:
            raise RoleConfigError(f"llm role {role}: {exc}") from exc
        if config.backend == "openai" and not (config.base_url and config.model):
            raise RoleConfigError(f"llm role {role}: the openai backend needs base_url and model")
        resolved[role] = config
    return resolved


def role_settings_from_yaml(text: str) -> dict[Role, RoleSettings]:
    loaded = yaml.safe_load(text) or {}
    if not isinstance(loaded, dict):
        raise RoleConfigError("llm: the YAML must hold a mapping")
    section = loaded.get("llm", loaded)
    return role_settings(section)


def make_backend(settings: RoleSettings, run_dir: Path | None = None) -> LLMClient:
    """A backend for ``settings``; a local model caches its converted weights in
    ``run_dir`` (the policy loader's default when None)."""
    if settings.backend == "local":
        return LocalBackend(settings.model, device=settings.device, run_dir=run_dir)
    assert settings.base_url is not None and settings.model is not None
    return OpenAIBackend(
        OpenAISettings(
            base_url=settings.base_url,
            model=settings.model,
            api_key_env=settings.api_key_env,
            connect_timeout_s=settings.connect_timeout_s,
            timeout_s=settings.timeout_s,
            max_retries=settings.max_retries,
            give_up_after_s=settings.give_up_after_s,
            backoff_base_s=settings.backoff_base_s,
            backoff_max_s=settings.backoff_max_s,
            requests_per_s=settings.requests_per_s,
            burst=settings.burst,
            max_response_bytes=settings.max_response_bytes,
        )
    )


@dataclass
class RoleLLM:
    """A role's client with its sampling defaults bound."""

    role: Role
    client: LLMClient
    settings: RoleSettings

    async def chat(
        self,
        messages: ChatMessages,
        *,
        schema: dict[str, Any] | None = None,
        max_tokens: int | None = None,
        temperature: float | None = None,
    ) -> LLMResponse:
        return await self.client.chat(
            messages,
            schema=schema,
            max_tokens=self.settings.max_tokens if max_tokens is None else max_tokens,
            temperature=self.settings.temperature if temperature is None else temperature,
        )


class RoleClients:
    """One :class:`RoleLLM` per role, with backends shared where their settings agree."""

    def __init__(self, settings: dict[Role, RoleSettings], run_dir: Path | None = None) -> None:
        backends: dict[tuple[Any, ...], LLMClient] = {}
        self._roles: dict[Role, RoleLLM] = {}
        for role, config in settings.items():
            key = config.backend_key()
            if key not in backends:
                backends[key] = make_backend(config, run_dir)
            self._roles[role] = RoleLLM(role, backends[key], config)
        self._backends = list(backends.values())

    @classmethod
    def from_section(
        cls,
        section: dict[str, Any] | LLMSettings | None,
        run_dir: Path | None = None,
        roles: Collection[str] | None = None,
    ) -> RoleClients:
        """Clients for ``roles`` (every role when None) from a run's ``llm`` section."""
        chosen = role_settings(section)
        if roles is not None:
            chosen = {role: config for role, config in chosen.items() if role in roles}
        return cls(chosen, run_dir=run_dir)

    def __getitem__(self, role: Role) -> RoleLLM:
        return self._roles[role]

    @property
    def backends(self) -> list[LLMClient]:
        return list(self._backends)

    async def aclose(self) -> None:
        for backend in self._backends:
            await backend.aclose()
