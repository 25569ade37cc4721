"""Run configuration: embedded defaults, then a YAML file, then environment variables.

Precedence (last wins): defaults in this module < ``coevolve.yaml`` (``--config`` or
``COEVOLVE_CONFIG``) < environment (``COEVOLVE_RUN_DIR``, ``COEVOLVE_LABELS``,
``COEVOLVE_D0_FILE``, ``NATS_URL``, ``OTEL_EXPORTER_OTLP_ENDPOINT``). Each service reads
its own section with ``Settings.section(name, StructType)``, so a typo in a key is a clear
error at start-up.
``tool_rendering`` (``compact`` | ``full``) is how every prompt shows the agent its tools;
``load_settings`` installs it for the whole process (``coevolve.shared.envs.rendering``).
``labels`` says where the training tasks come from: ``bfcl`` (BFCL's labelled train split
seeds the pool) or ``none`` (nothing labelled: the task set D0 discovered by unguided
exploration, the ``d0`` section, seeds it). ``environments`` registers users' own
environments (``coevolve.shared.envs.python_class``).
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path
from typing import Any, Literal, TypeVar

import msgspec
import yaml

from coevolve.shared.envs.rendering import (
    DEFAULT_TOOL_RENDERING,
    ToolRendering,
    configure_tool_rendering,
)
from coevolve.shared.pacing import PacingSettings
from coevolve.shared.runtime.subjects import SERVICES

DEFAULT_RUN_DIR = Path("runs/default")
# `coevolve up --labels/--d0` pass them to the services it starts through these
LABELS_ENV = "COEVOLVE_LABELS"
D0_FILE_ENV = "COEVOLVE_D0_FILE"
# what `up` sets to "none" for a run without explorers: no data loop, nothing to wait for
PACING_ENV = "COEVOLVE_PACING_WHEN_BEHIND"
# the policy's inference engines: llama.cpp (CPU), torch + peft in process, vLLM (GPUs)
EngineKind = Literal["llama_cpp", "transformers", "vllm"]
ENGINE_KINDS: tuple[EngineKind, ...] = ("llama_cpp", "transformers", "vllm")
DEFAULT_NATS_URL = "nats://127.0.0.1:4222"
# the copies of every stream and bucket (bus.replicas), as `up --nats-cluster` tells services
REPLICAS_ENV = "COEVOLVE_NATS_REPLICAS"
# the section of the LLM roles (summarizer, explorer, abstractor, judge, attributor) under services:
LLM_SECTION = "llm"
# every section under services: that something reads; any other name is a ConfigError
SERVICE_SECTIONS: tuple[str, ...] = (*SERVICES, LLM_SECTION)

S = TypeVar("S", bound=msgspec.Struct)


class ConfigError(ValueError):
    """The configuration cannot be used; the message says which key and why."""


# where `coevolve up` writes one NATS credentials file per user (docs/security.md)
NATS_CREDENTIALS_DIR = Path("secrets/nats")


class BusTls(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """TLS to the bus: ``ca`` verifies the server; ``cert``/``key`` are this client's
    certificate, for a server that verifies clients (mutual TLS)."""

    ca: str | None = None
    cert: str | None = None
    key: str | None = None


class BusSettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    # one server, or a cluster's nodes comma-separated (the client fails over between them)
    url: str = DEFAULT_NATS_URL
    # copies of every stream, key-value bucket and object store: 3 on a 3-node cluster
    # survives losing one node; more than the cluster's nodes is refused by the server
    replicas: int = 1
    connect_timeout_s: float = 5.0
    request_timeout_s: float = 10.0
    publish_timeout_s: float = 10.0
    # this process's credentials file (env COEVOLVE_NATS_CREDS), else the file of the
    # connection's user in credentials_dir (env COEVOLVE_NATS_CREDS_DIR; default: the run
    # directory's secrets/nats when it exists); none: connect without authentication
    credentials: str | None = None
    credentials_dir: str | None = None
    # the user of a connection that names none (env COEVOLVE_NATS_USER; default "reader")
    user: str | None = None
    tls: BusTls | None = None


class TelemetrySettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    exporter: Literal["jsonl", "otlp", "none"] = "jsonl"
    otlp_endpoint: str | None = None


class RuntimeSettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    heartbeat_interval_s: float = 1.0
    heartbeat_ttl_s: float = 30.0
    # SIGTERM budget: drain this long, then ~3 s to nak, tear down and close: exit < 10 s
    drain_timeout_s: float = 6.0
    fetch_timeout_s: float = 1.0
    idempotency_cache: int = 10_000
    # added to the niceness of the services `up` starts in the background (signal monitor,
    # explorer, abstractor, judge, evaluator): they take what the learner and rollout leave
    background_niceness: int = 10

    def __post_init__(self) -> None:
        if not 0 <= self.background_niceness <= 19:
            raise ValueError("runtime.background_niceness must be between 0 and 19")


# bfcl: BFCL's labelled train split seeds the pool, the warm start and the replay;
# none: only tasks discovered in the environment (D0) do, BFCL's labels reach only eval
Labels = Literal["bfcl", "none"]


class D0Settings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The task set a run with ``labels: none`` starts from, and how it is built
    (``coevolve discover``, or ``coevolve up`` when the file is missing)."""

    # relative paths are under the run directory
    file: str = "d0.json"
    environment: str = "bfcl"
    # stop at this many accepted tasks, or after max_explorations or max_minutes
    tasks: int = 24
    # `up` with no D0 file builds only this many before training starts; the explorer goes
    # on discovering beside training (explorer.discover_when_idle_s). 4: the 1.5B role
    # model accepted a task every 2.4 min (21 in 50.6, docs/no-labels.md), so v1 comes
    # within about 15 minutes on 2 cores
    first_tasks: int = 4
    max_explorations: int = 48
    max_minutes: float = 60.0
    # an environment without labelled held-out tasks (not bfcl): the 1st, (N+1)th, ...
    # accepted task is kept out of training, in the file's `heldout`, for the evaluator
    # (services.evaluator.heldout_file gives the user's own instead). 0: none
    heldout_every: int = 5
    # exploration rounds per start state (each a fresh environment)
    rounds: int = 1
    seed: int = 0
    # the local model of the LLM roles while D0 is built (nothing else runs then, so a
    # larger one is affordable: it yields more accepted tasks a minute, docs/no-labels.md);
    # null: the llm section's model
    role_model: str | None = "qwen2.5-coder-1.5b-instruct"

    def __post_init__(self) -> None:
        if min(self.tasks, self.first_tasks, self.max_explorations, self.rounds) < 1:
            raise ValueError(
                "d0.tasks, d0.first_tasks, d0.max_explorations and d0.rounds must be >= 1"
            )
        if not self.max_minutes > 0:
            raise ValueError("d0.max_minutes must be > 0")
        if self.heldout_every < 0:
            raise ValueError("d0.heldout_every must be >= 0")

    def path(self, run_dir: Path) -> Path:
        return (run_dir / Path(self.file).expanduser()).resolve()

    @property
    def keeps_heldout_every(self) -> int:
        """Every how many accepted tasks one is held out (0: none; bfcl has its eval split)."""
        return self.heldout_every if self.environment != "bfcl" else 0

    @property
    def tasks_before_training(self) -> int:
        """What `up` builds of a missing D0 before the services start."""
        return min(self.first_tasks, self.tasks)


class Settings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    run_dir: Path = DEFAULT_RUN_DIR
    tool_rendering: ToolRendering = DEFAULT_TOOL_RENDERING
    labels: Labels = "bfcl"
    d0: D0Settings = msgspec.field(default_factory=D0Settings)
    # a user's own environments: {name: {class: "module:Class", initial_states: [...]}}
    environments: dict[str, dict[str, Any]] = msgspec.field(default_factory=dict)
    bus: BusSettings = msgspec.field(default_factory=BusSettings)
    telemetry: TelemetrySettings = msgspec.field(default_factory=TelemetrySettings)
    runtime: RuntimeSettings = msgspec.field(default_factory=RuntimeSettings)
    pacing: PacingSettings = msgspec.field(default_factory=PacingSettings)
    services: dict[str, dict[str, Any]] = msgspec.field(default_factory=dict)

    def section(self, name: str, kind: type[S]) -> S:
        """This service's settings as ``kind``; unknown or mistyped keys raise ConfigError."""
        raw = self.services.get(name, {})
        try:
            return msgspec.convert(raw, kind, strict=False)
        except msgspec.ValidationError as exc:
            raise ConfigError(f"services.{name}: {exc}") from exc

    def path(self, *parts: str) -> Path:
        """A path under the run directory, created on demand (its parent directory)."""
        target = self.run_dir.joinpath(*parts)
        target.parent.mkdir(parents=True, exist_ok=True)
        return target


def load_settings(config_file: Path | None = None, **overrides: Any) -> Settings:
    raw: dict[str, Any] = {}
    config_file = config_file or _env_path("COEVOLVE_CONFIG")
    if config_file is not None:
        if not config_file.is_file():
            raise ConfigError(f"config file {config_file} does not exist")
        loaded = yaml.safe_load(config_file.read_text()) or {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {config_file} must hold a mapping at the top")
        raw = loaded
    if run_dir := os.environ.get("COEVOLVE_RUN_DIR"):
        raw["run_dir"] = run_dir
    if labels := os.environ.get(LABELS_ENV):
        raw["labels"] = labels
    if d0_file := os.environ.get(D0_FILE_ENV):
        raw.setdefault("d0", {})["file"] = d0_file
    if when_behind := os.environ.get(PACING_ENV):
        raw.setdefault("pacing", {})["when_behind"] = when_behind
    if nats_url := os.environ.get("NATS_URL"):
        raw.setdefault("bus", {})["url"] = nats_url
    if replicas := os.environ.get(REPLICAS_ENV):
        try:
            raw.setdefault("bus", {})["replicas"] = int(replicas)
        except ValueError as exc:
            raise ConfigError(f"{REPLICAS_ENV} must be a whole number, not {replicas!r}") from exc
    for env, key in (
        ("COEVOLVE_NATS_CREDS", "credentials"),
        ("COEVOLVE_NATS_CREDS_DIR", "credentials_dir"),
    ):
        if value := os.environ.get(env):
            raw.setdefault("bus", {})[key] = value
    if otlp := os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        raw.setdefault("telemetry", {}).update(exporter="otlp", otlp_endpoint=otlp)
    for key, value in overrides.items():
        if value is not None:
            raw[key] = value
    check_top_level_keys(raw)
    try:
        settings = msgspec.convert(raw, Settings, strict=False, dec_hook=_decode_path)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"configuration: {exc}") from exc
    check_service_sections(settings.services)
    settings.run_dir = settings.run_dir.expanduser().resolve()
    if settings.bus.credentials_dir is None and (settings.run_dir / NATS_CREDENTIALS_DIR).is_dir():
        settings.bus.credentials_dir = str(settings.run_dir / NATS_CREDENTIALS_DIR)
    configure_tool_rendering(settings.tool_rendering)
    if settings.environments:
        from coevolve.shared.envs.python_class import install_environments

        try:
            install_environments(settings.environments)
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc
    return settings


def check_top_level_keys(raw: dict[str, Any]) -> None:
    """A top-level key that Settings does not have (``sevices:``) is an error naming it, the
    nearest known key and all of them."""
    _refuse_unknown(raw, Settings.__struct_fields__, "", "key", "the top-level keys are")


def check_service_sections(services: dict[str, Any]) -> None:
    """A section under ``services:`` that no service reads (``rolout:``) is an error, not
    silently ignored, with the nearest known name as a hint."""
    _refuse_unknown(services, SERVICE_SECTIONS, "services.", "section", "the sections are")


def _refuse_unknown(
    found: dict[str, Any], known: tuple[str, ...], prefix: str, what: str, listing: str
) -> None:
    for name in found:
        if name in known:
            continue
        close = difflib.get_close_matches(str(name), known, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(f"{prefix}{name}: no such {what}{hint}; {listing} {', '.join(known)}")


def _decode_path(kind: type, value: Any) -> Any:
    if kind is Path and isinstance(value, str):
        return Path(value)
    raise NotImplementedError(f"cannot read {kind} from {value!r}")


def _env_path(name: str) -> Path | None:
    value = os.environ.get(name)
    return Path(value) if value else None
