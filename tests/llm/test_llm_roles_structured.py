"""Per-role LLM configuration, and structured-output parsing on its own."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace

import msgspec
import pytest

from coevolve.shared.llm import (
    OpenAIBackend,
    RoleClients,
    RoleConfigError,
    role_settings,
    role_settings_from_yaml,
)
from coevolve.shared.llm.roles import ROLES, OwnServerBackend, make_backend, parse_llm_section
from coevolve.shared.llm.run_server import start_for_run
from coevolve.shared.llm.server import API_KEY_ENV, BASE_URL_ENV, MODEL_ENV
from coevolve.shared.structured import Rejection, json_schema_of_parameter, parse_structured
from tests.support.fake_llm import FakeOpenAI, completion

YAML = """
llm:
  default: {max_tokens: 200}
  server: {n_ctx: 4096}
  roles:
    explorer: {temperature: 0.9}
    judge:
      base_url: http://127.0.0.1:9/v1
      model: judge-model
      temperature: 0.0
      max_tokens: 120
    abstractor:
      base_url: http://127.0.0.1:9/v1
      model: judge-model
"""


def test_defaults_every_role_on_the_local_server() -> None:
    roles = role_settings(None)
    assert set(roles) == set(ROLES)
    assert all(r.local and r.model is None for r in roles.values())


def test_yaml_section_merges_default_and_role_keys() -> None:
    roles = role_settings_from_yaml(YAML)
    assert roles["summarizer"].max_tokens == 200 and roles["summarizer"].temperature == 0.7
    assert roles["explorer"].temperature == 0.9 and roles["explorer"].local
    assert not roles["judge"].local and roles["judge"].max_tokens == 120
    assert roles["abstractor"].max_tokens == 200
    assert parse_llm_section({"server": {"n_ctx": 4096}}).server.n_ctx == 4096


def test_backends_are_shared_where_settings_agree(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(BASE_URL_ENV, raising=False)
    clients = RoleClients(role_settings_from_yaml(YAML))
    assert clients["summarizer"].client is clients["explorer"].client
    # no server announced by `coevolve up`: this process starts its own on first use
    assert isinstance(clients["summarizer"].client, OwnServerBackend)
    # judge and abstractor differ only in sampling parameters: one HTTP client
    assert clients["judge"].client is clients["abstractor"].client
    assert isinstance(clients["judge"].client, OpenAIBackend)
    assert len(clients.backends) == 2
    asyncio.run(clients.aclose())
    assert clients.own_server.server.process is None  # never used, never started


def test_local_roles_use_the_server_announced_in_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(BASE_URL_ENV, "http://127.0.0.1:9/v1")
    monkeypatch.setenv(API_KEY_ENV, "k")
    monkeypatch.setenv(MODEL_ENV, "served-name")
    clients = RoleClients(role_settings(None))
    backend = clients["judge"].client
    assert isinstance(backend, OpenAIBackend)
    assert backend.settings.base_url == "http://127.0.0.1:9/v1"
    assert backend.settings.model == "served-name"
    assert backend.settings.resolved_api_key() == "k"
    # llama.cpp's dialect, one request at a time, a timeout that allows for the queue
    assert backend.dialect == "json_object"
    assert backend.settings.max_concurrency == 1
    assert backend.settings.timeout_s == 600.0
    asyncio.run(clients.aclose())


def test_a_remote_endpoint_detects_its_dialect_and_runs_several_requests() -> None:
    roles = role_settings({"default": {"base_url": "http://h/v1", "model": "m"}})
    backend = make_backend(roles["judge"], own=None)  # type: ignore[arg-type]
    assert isinstance(backend, OpenAIBackend)
    assert backend.dialect is None and backend.settings.max_concurrency == 8
    asyncio.run(backend.aclose())


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"roles": {"critic": {}}}, "critic"),
        ({"default": {"temprature": 0.2}}, "temprature"),
        ({"roles": {"judge": {"base_url": "http://h/v1"}}}, "needs a model"),
        ({"roles": {"judge": {"backend": "local"}}}, "backend"),
        ({"roles": {"judge": {"structured_output": "xml"}}}, "structured_output"),
        ({"default": {"max_tokens": "many"}}, "max_tokens"),
        ({"server": {"n_ctxx": 1}}, "n_ctxx"),
    ],
)
def test_bad_configuration_is_a_clear_error(section: dict[str, object], message: str) -> None:
    with pytest.raises(RoleConfigError, match=message):
        role_settings(section)


def test_role_client_applies_its_sampling_defaults() -> None:
    server = FakeOpenAI(default=completion("hello")).start()
    try:
        section = {
            "default": {
                "base_url": server.base_url,
                "model": "m",
                "max_tokens": 33,
                "temperature": 0.25,
            }
        }
        clients = RoleClients(role_settings(section))

        async def go() -> None:
            assert (
                await clients["judge"].chat([{"role": "user", "content": "hi"}])
            ).text == "hello"
            await clients["judge"].chat([{"role": "user", "content": "hi"}], max_tokens=5)
            await clients.aclose()

        asyncio.run(go())
    finally:
        server.stop()
    assert (server.requests[0]["max_tokens"], server.requests[0]["temperature"]) == (33, 0.25)
    assert server.requests[1]["max_tokens"] == 5


class StartedFake:
    """Stands in for the process's own server: already running, at the fake endpoint."""

    def __init__(self, endpoint: FakeOpenAI) -> None:
        self.endpoint = endpoint
        self.starts = 0

    async def ensure_started(self) -> SimpleNamespace:
        self.starts += 1
        return SimpleNamespace(base_url=self.endpoint.base_url, api_key="k", alias="served-name")


def test_own_server_backend_passes_every_option_on() -> None:
    server = FakeOpenAI(default=completion('{"x": 1}')).start()
    own = StartedFake(server)
    backend = OwnServerBackend(role_settings(None)["judge"], own)  # type: ignore[arg-type]
    schema = {"type": "object", "properties": {"x": {"type": "integer"}}}

    async def go() -> None:
        question = [{"role": "user", "content": "hi"}]
        answer = await backend.chat(question, schema=schema, max_tokens=7, temperature=0.5)
        assert answer.parsed == {"x": 1}
        await backend.chat(question, max_tokens=9, temperature=0.0)
        await backend.aclose()

    try:
        asyncio.run(go())
    finally:
        server.stop()
    first, second = server.requests
    assert (first["max_tokens"], first["temperature"]) == (7, 0.5)
    assert first["response_format"] == {"type": "json_object", "schema": schema}
    assert (second["max_tokens"], second["temperature"]) == (9, 0.0)
    assert "response_format" not in second
    assert backend.name == "openai:served-name"
    assert own.starts == 1  # the client made on the first call serves the next


class Point(msgspec.Struct):
    x: int
    y: int


@pytest.mark.parametrize(
    ("text", "finish", "kind"),
    [
        ("", "stop", "empty"),
        ('{"x":1,"y":', "stop", "truncated"),
        ('{"x":1,"y":2', "length", "truncated"),
        ('{"x":1,"y":2} and more', "stop", "invalid_json"),
        ('{"x":1}', "stop", "wrong_schema"),
        ('{"x":1.5,"y":2}', "stop", "wrong_schema"),
        ('"x"', "stop", "wrong_schema"),
        ("[" * 40_000, "stop", "too_large"),
    ],
)
def test_parse_structured_rejections(text: str, finish: str, kind: str) -> None:
    outcome = parse_structured(text, Point, finish_reason=finish)
    assert isinstance(outcome, Rejection) and outcome.kind == kind
    assert len(outcome.preview) <= 160


def test_parse_structured_accepts_a_fenced_document() -> None:
    assert parse_structured('```json\n{"x": 1, "y": 2}\n```', Point) == Point(1, 2)
    assert parse_structured('  {"x":3,"y":4}\n', Point) == Point(3, 4)


def test_parameter_types_from_function_docs_become_json_schema() -> None:
    spec = {
        "type": "dict",
        "properties": {
            "amount": {"type": "float", "description": "x"},
            "pair": {"type": "tuple", "items": {"type": "string"}},
            "anything": {"type": "any"},
            "mode": {"type": "string", "enum": ["a", "b"], "default": "a"},
        },
        "required": ["amount", "missing"],
    }
    assert json_schema_of_parameter(spec) == {
        "type": "object",
        "properties": {
            "amount": {"type": "number"},
            "pair": {"type": "array", "items": {"type": "string"}},
            "anything": {},
            "mode": {"type": "string", "enum": ["a", "b"]},
        },
        "required": ["amount"],
        "additionalProperties": False,
    }


def test_no_local_server_when_every_role_in_use_names_an_endpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The attributor is in use only with rollout.step_credit and the distiller only with
    its service: four remote roles, the attributor and distiller unset, start no local
    server."""
    monkeypatch.delenv(BASE_URL_ENV, raising=False)
    remote = {"base_url": "http://gpu-box:8000/v1", "model": "Qwen/Qwen2.5-32B-Instruct"}
    unset = ("attributor", "distiller")
    section = {"roles": {role: remote for role in ROLES if role not in unset}}
    assert start_for_run(section, tmp_path) is None
