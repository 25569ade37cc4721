"""A configuration file's ``services:`` sections: a misspelled one is an error, not ignored."""

from __future__ import annotations

from pathlib import Path

import pytest

from coevolve.shared.config import ConfigError, load_settings
from coevolve.shared.subjects import SERVICES


def test_a_misspelled_section_is_refused_with_the_name_it_meant(tmp_path: Path) -> None:
    config = tmp_path / "coevolve.yaml"
    config.write_text("services:\n  rolout:\n    temperature: 0.7\n")
    with pytest.raises(
        ConfigError, match=r"services\.rolout: no such section \(did you mean 'rollout'\?\)"
    ):
        load_settings(config)


def test_every_service_section_and_the_llm_section_load(tmp_path: Path) -> None:
    config = tmp_path / "coevolve.yaml"
    lines = ["services:"] + [f"  {name}: {{}}" for name in (*SERVICES, "llm")]
    config.write_text("\n".join(lines) + "\n")
    settings = load_settings(config)
    assert set(settings.services) == {*SERVICES, "llm"}
