"""`coevolve up` reads every section it will hand out before it starts anything: a
wrong-typed setting is one error naming the key, not a service restarted until held back."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from coevolve.cli.sections import SECTION_CONFIGS, check_sections
from coevolve.shared.config import LLM_SECTION, SERVICE_SECTIONS, ConfigError, load_settings


def up_with(tmp_path: Path, config_text: str) -> tuple[subprocess.CompletedProcess[str], Path]:
    config = tmp_path / "coevolve.yaml"
    config.write_text(config_text)
    run_dir = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NATS_", "COEVOLVE_"))}
    options = ["--config", str(config), "--run-dir", str(run_dir), "--nats-port", "0", "--quiet"]
    done = subprocess.run(
        [sys.executable, "-m", "coevolve", "up", *options],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return done, run_dir


def test_a_wrong_typed_setting_stops_up_before_anything_starts(tmp_path: Path) -> None:
    done, run_dir = up_with(tmp_path, "services:\n  learner:\n    grpo:\n      lr: fast\n")
    assert done.returncode != 0
    said = done.stdout + done.stderr
    assert "services.learner" in said and "$.grpo.lr" in said, said
    assert "Expected `float`, got `str`" in said, said
    # no NATS store, no service log: nothing was started
    assert not (run_dir / "nats").exists() and not (run_dir / "logs").exists()


def test_a_value_a_service_refuses_stops_up_too(tmp_path: Path) -> None:
    done, _ = up_with(tmp_path, "services:\n  llm:\n    server:\n      niceness: 40\n")
    assert done.returncode != 0
    assert "niceness must be between 0 and 19" in done.stdout + done.stderr


def test_every_service_section_is_checked() -> None:
    assert set(SECTION_CONFIGS) == set(SERVICE_SECTIONS) - {LLM_SECTION}


@pytest.mark.parametrize(
    ("section", "text", "key"),
    [
        ("rollout", {"temperature": "hot"}, "services.rollout"),
        ("judge", {"no_such_key": 1}, "services.judge"),
        ("llm", {"default": {"temperature": "hot"}}, "services.llm role"),
    ],
)
def test_check_sections_names_the_section(section: str, text: dict, key: str) -> None:
    settings = load_settings()
    settings.services[section] = text
    with pytest.raises(ConfigError, match=key):
        check_sections(settings)


def test_the_defaults_pass() -> None:
    check_sections(load_settings())
