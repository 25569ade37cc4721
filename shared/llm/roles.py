"""Which endpoint, model and sampling parameters each LLM role uses.

Configuration (a dict, e.g. the ``llm`` section of ``services`` in ``coevolve.yaml``)::

    default: {temperature: 0.7}        # applies to every role
    server: {n_ctx: 8192}              # the local llama.cpp server (see ``server.py``)
    roles:
      explorer: {temperature: 0.9}
      judge:                           # a stronger endpoint: one entry
        base_url: http://gpu-box:8000/v1
        model: Qwen/Qwen2.5-32B-Instruct
        temperature: 0.0

Each role's settings are ``default`` updated with the role's own keys. A role without
``base_url`` talks to the local llama.cpp server: the one ``coevolve up`` started (found
through ``COEVOLVE_LLM_BASE_URL``), else one this process starts on first use. Roles whose
endpoint settings are equal share one client.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Unpack, get_args

import msgspec
import yaml

from coevolve.shared.llm.client import ChatMessages, ChatOptions, LLMClient, LLMResponse
from coevolve.shared.llm.openai_backend import OpenAIBackend, OpenAISettings, Transport
from coevolve.shared.llm.server import (
    API_KEY_ENV,
    BASE_URL_ENV,
    MODEL_ENV,
    LlamaServer,
    ServerSettings,
)

# attributor: labels each step of a rollout GOOD or BAD (``rollout.step_credit``; off by
# default, and unused then); distiller: draws experiences from rollout groups (the
# distiller service; off by default)
Role = Literal["summarizer", "explorer", "abstractor", "judge", "attributor", "distiller"]
ROLES: tuple[Role, ...] = get_args(Role)

# The local server runs one request at a time for every service: a call may wait behind
# several others, so its timeout is longer than a remote endpoint's.
LOCAL_TIMEOUT_S = 600.0
REMOTE_TIMEOUT_S = 120.0


class RoleSettings(Transport, kw_only=True, forbid_unknown_fields=True, frozen=True):
    """A role's endpoint (none: the local llama.cpp server), sampling and transport."""

    base_url: str | None = None
    model: str | None = None
    max_tokens: int = 256
    temperature: float = 0.7
    timeout_s: float | None = None  # default: 600 s on the local server, 120 s elsewhere
    max_concurrency: int | None = None  # default: 1 on the local server, 8 elsewhere

    @property
    def local(self) -> bool:
        return self.base_url is None

    def backend_key(self) -> tuple[Any, ...]:
        """What identifies the client instance (sampling parameters excluded)."""
        fields = msgspec.structs.asdict(self)
        return tuple(sorted((k, v) for k, v in fields.items() if k not in _SAMPLING))


_SAMPLING = frozenset({"max_tokens", "temperature"})


class LLMSettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    default: dict[str, Any] = msgspec.field(default_factory=dict)
    roles: dict[Role, dict[str, Any]] = msgspec.field(default_factory=dict)
    server: ServerSettings = msgspec.field(default_factory=ServerSettings)


class RoleConfigError(ValueError):
    """A role's LLM settings cannot be used; the message names the role and the key."""


def parse_llm_section(section: dict[str, Any] | LLMSettings | None) -> LLMSettings:
    if isinstance(section, LLMSettings):
        return section
    try:
        return msgspec.convert(section or {}, LLMSettings, strict=False)
    except msgspec.ValidationError as exc:
        raise RoleConfigError(f"llm: {exc}") from exc


def role_settings(section: dict[str, Any] | LLMSettings | None) -> dict[Role, RoleSettings]:
    """Every role's settings from an ``llm`` config section (missing section: defaults)."""
    settings = parse_llm_section(section)
    resolved: dict[Role, RoleSettings] = {}
    for role in ROLES:
        merged = {**settings.default, **settings.roles.get(role, {})}
        try:
            config = msgspec.convert(merged, RoleSettings, strict=False)
        except msgspec.ValidationError as exc:
            raise RoleConfigError(f"llm role {role}: {exc}") from exc
        if config.base_url and not config.model:
            raise RoleConfigError(f"llm role {role}: an endpoint (base_url) needs a model")
        resolved[role] = config
    return resolved


def role_settings_from_yaml(text: str) -> dict[Role, RoleSettings]:
    loaded = yaml.safe_load(text) or {}
    if not isinstance(loaded, dict):
        raise RoleConfigError("llm: the YAML must hold a mapping")
    section = loaded.get("llm", loaded)
    return role_settings(section)


def openai_settings(settings: RoleSettings, **endpoint: Any) -> OpenAISettings:
    """The HTTP client's settings for a role; ``endpoint`` overrides (the local server's
    URL, key and model)."""
    local = settings.local
    values: dict[str, Any] = {name: getattr(settings, name) for name in Transport.__struct_fields__}
    values.update(
        base_url=settings.base_url,
        model=settings.model,
        timeout_s=settings.timeout_s or (LOCAL_TIMEOUT_S if local else REMOTE_TIMEOUT_S),
        max_concurrency=settings.max_concurrency or (1 if local else 8),
    )
    values.update(endpoint)
    return OpenAISettings(**values)


def local_endpoint(
    settings: RoleSettings, base_url: str, api_key: str, model: str
) -> OpenAISettings:
    """A role's client for the local llama.cpp server at ``base_url``."""
    return openai_settings(
        settings,
        base_url=base_url,
        model=settings.model or model,
        api_key=api_key,
        api_key_env=None,
        structured_output="json_object"
        if settings.structured_output == "auto"
        else settings.structured_output,
    )


class OwnServer:
    """A local server this process starts on first use (when no ``coevolve up`` started one
    for it: the lockstep schedule, in-process tests), shared by its roles."""

    def __init__(self, settings: ServerSettings | None, run_dir: Path | None) -> None:
        log_dir = (run_dir or Path("runs/default")) / "logs"
        self.server = LlamaServer(settings, log_file=log_dir / "llm.log")
        self._started = False
        self._lock: asyncio.Lock | None = None

    async def ensure_started(self) -> LlamaServer:
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if not self._started:
                await asyncio.to_thread(self.server.start)
                self._started = True
        return self.server

    async def stop(self) -> None:
        if self._started:
            await asyncio.to_thread(self.server.stop)
            self._started = False


class OwnServerBackend:
    """A role's client for an :class:`OwnServer`, which it starts on its first call."""

    def __init__(self, settings: RoleSettings, own: OwnServer) -> None:
        self.settings = settings
        self.own = own
        self.name = "llama.cpp:local"
        self._client: OpenAIBackend | None = None

    async def chat(self, messages: ChatMessages, **options: Unpack[ChatOptions]) -> LLMResponse:
        if self._client is None:
            server = await self.own.ensure_started()
            self._client = OpenAIBackend(
                local_endpoint(self.settings, server.base_url, server.api_key, server.alias)
            )
            self.name = self._client.name
        return await self._client.chat(messages, **options)

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None


def make_backend(settings: RoleSettings, own: OwnServer) -> LLMClient:
    """The client for a role: its own endpoint, else the local server (the shared one that
    ``coevolve up`` announced in the environment, else ``own``, started on first use)."""
    if not settings.local:
        return OpenAIBackend(openai_settings(settings))
    shared_url = os.environ.get(BASE_URL_ENV)
    if shared_url:
        return OpenAIBackend(
            local_endpoint(
                settings,
                shared_url,
                os.environ.get(API_KEY_ENV, ""),
                os.environ.get(MODEL_ENV, "local"),
            )
        )
    return OwnServerBackend(settings, own)


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

    def __init__(
        self,
        settings: dict[Role, RoleSettings],
        run_dir: Path | None = None,
        server: ServerSettings | None = None,
    ) -> None:
        backends: dict[tuple[Any, ...], LLMClient] = {}
        self._roles: dict[Role, RoleLLM] = {}
        self.own_server = OwnServer(server, run_dir)
        for role, config in settings.items():
            key = config.backend_key()
            if key not in backends:
                backends[key] = make_backend(config, self.own_server)
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
        parsed = parse_llm_section(section)
        chosen = role_settings(parsed)
        if roles is not None:
            chosen = {role: config for role, config in chosen.items() if role in roles}
        return cls(chosen, run_dir=run_dir, server=parsed.server)

    def __getitem__(self, role: Role) -> RoleLLM:
        return self._roles[role]

    @property
    def backends(self) -> list[LLMClient]:
        return list(self._backends)

    async def aclose(self) -> None:
        for backend in self._backends:
            await backend.aclose()
        await self.own_server.stop()
