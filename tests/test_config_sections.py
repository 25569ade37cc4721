"""A configuration file's keys and ``services:`` sections: a misspelled one is an error,
not ignored; the defaults and the repository's configuration files load."""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
import yaml

from coevolve.shared.config import (
    DEFAULT_RUN_DIR,
    SERVICE_SECTIONS,
    ConfigError,
    Settings,
    load_settings,
)
from coevolve.shared.runtime.subjects import SERVICES

ROOT = Path(__file__).resolve().parents[1]
# not configuration files: the environment, run outputs, build trees, git's own files
SKIPPED_DIRS = {".venv", "runs", "build", ".git", "node_modules"}
ENV_VARS = (
    "COEVOLVE_CONFIG",
    "COEVOLVE_RUN_DIR",
    "NATS_URL",
    "COEVOLVE_NATS_REPLICAS",
    "COEVOLVE_NATS_CREDS",
    "COEVOLVE_NATS_CREDS_DIR",
    "OTEL_EXPORTER_OTLP_ENDPOINT",
)


@pytest.fixture(autouse=True)
def _no_config_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ENV_VARS:
        monkeypatch.delenv(name, raising=False)


def refusal(tmp_path: Path, text: str) -> str:
    """What loading a configuration file holding ``text`` refuses it with."""
    config = tmp_path / "coevolve.yaml"
    config.write_text(text)
    with pytest.raises(ConfigError) as refused:
        load_settings(config)
    return str(refused.value)


def test_a_misspelled_section_is_refused_with_the_name_it_meant(tmp_path: Path) -> None:
    message = refusal(tmp_path, "services:\n  rolout:\n    temperature: 0.7\n")
    assert "services.rolout: no such section (did you mean 'rollout'?)" in message


@pytest.mark.parametrize(
    ("text", "start", "known"),
    [
        (
            "services:\n  rollout: {}\n  zzz: {}\n",
            "services.zzz: no such section;",
            SERVICE_SECTIONS,
        ),
        (
            "sevices:\n  rollout: {}\n",
            "sevices: no such key (did you mean 'services'?);",
            Settings.__struct_fields__,
        ),
    ],
    ids=["an unknown section", "a misspelled top-level key"],
)
def test_an_unknown_name_is_refused_listing_the_known_ones(
    tmp_path: Path, text: str, start: str, known: Sequence[str]
) -> None:
    message = refusal(tmp_path, text)
    assert message.startswith(start)
    assert message.endswith(", ".join(known))


def test_every_service_section_and_the_llm_section_load(tmp_path: Path) -> None:
    config = tmp_path / "coevolve.yaml"
    lines = ["services:"] + [f"  {name}: {{}}" for name in (*SERVICES, "llm")]
    config.write_text("\n".join(lines) + "\n")
    settings = load_settings(config)
    assert set(settings.services) == {*SERVICES, "llm"} == set(SERVICE_SECTIONS)


def test_the_defaults_load() -> None:
    settings = load_settings()
    assert settings.services == {}
    assert settings.run_dir == DEFAULT_RUN_DIR.resolve()


def _config_files() -> Iterator[Path]:
    """The repository's YAML files with a top-level ``services:``, but for docker compose's."""
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = sorted(d for d in dirs if d not in SKIPPED_DIRS and not d.endswith(".egg-info"))
        for name in sorted(files):
            if not name.endswith((".yaml", ".yml")) or name.startswith(
                ("compose", "docker-compose")
            ):
                continue
            path = Path(folder) / name
            loaded = yaml.safe_load(path.read_text())
            if isinstance(loaded, dict) and "services" in loaded:
                yield path


CONFIG_FILES = list(_config_files())


def test_the_repository_has_configuration_files() -> None:
    assert CONFIG_FILES


@pytest.mark.parametrize("config", CONFIG_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_each_configuration_file_in_the_repository_loads(
    config: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """From its own folder, where it is run (a user environment's file form is relative
    to it: `examples/shop`)."""
    import coevolve.shared.envs as envs

    monkeypatch.setattr(envs, "_REGISTRY", dict(envs._REGISTRY))
    monkeypatch.setattr(envs, "_STARTS", dict(envs._STARTS))
    monkeypatch.chdir(config.parent)
    load_settings(config)
