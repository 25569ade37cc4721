"""A configuration file's keys and ``services:`` sections: a misspelled one is an error,
not ignored; the defaults and the repository's configuration files load."""

from __future__ import annotations

import os
from collections.abc import Iterator
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


def test_a_misspelled_section_is_refused_with_the_name_it_meant(tmp_path: Path) -> None:
    config = tmp_path / "coevolve.yaml"
    config.write_text("services:\n  rolout:\n    temperature: 0.7\n")
    with pytest.raises(
        ConfigError, match=r"services\.rolout: no such section \(did you mean 'rollout'\?\)"
    ):
        load_settings(config)


def test_an_unknown_section_is_refused_listing_the_known_ones(tmp_path: Path) -> None:
    config = tmp_path / "coevolve.yaml"
    config.write_text("services:\n  rollout: {}\n  zzz: {}\n")
    with pytest.raises(ConfigError) as refused:
        load_settings(config)
    message = str(refused.value)
    assert message.startswith("services.zzz: no such section;")
    assert message.endswith(", ".join(SERVICE_SECTIONS))


def test_a_misspelled_top_level_key_is_refused_listing_the_known_ones(tmp_path: Path) -> None:
    config = tmp_path / "coevolve.yaml"
    config.write_text("sevices:\n  rollout: {}\n")
    with pytest.raises(ConfigError) as refused:
        load_settings(config)
    message = str(refused.value)
    assert message.startswith("sevices: no such key (did you mean 'services'?);")
    assert message.endswith(", ".join(Settings.__struct_fields__))


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
def test_each_configuration_file_in_the_repository_loads(config: Path) -> None:
    load_settings(config)
