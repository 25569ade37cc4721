"""The world a run trains in: BFCL entries restricted to a set of API classes."""

from __future__ import annotations

import json

import pytest
import typer
from typer.testing import CliRunner

from coevolve.cli.eval_cmd import eval_command
from coevolve.services.pool_store.config import PoolStoreConfig
from coevolve.services.pool_store.handler import seed_tasks_for
from coevolve.shared.config import ConfigError, load_settings
from coevolve.shared.envs.bfcl.tasks import (
    FOCUS_CLASSES,
    seed_pool,
    split_of,
    suite_tasks,
)


def _classes(task: object) -> set[str]:
    return set(task.env_config["involved_classes"])  # type: ignore[attr-defined]


def test_the_default_world_seeds_only_entries_of_the_focus_classes() -> None:
    config = PoolStoreConfig()
    assert config.seed_classes == list(FOCUS_CLASSES)
    focused = seed_tasks_for("bfcl", config.seed_grains, config.seed_classes)
    full = seed_tasks_for("bfcl", config.seed_grains, None)
    assert focused and all(_classes(t) <= set(FOCUS_CLASSES) for t in focused)
    assert {t.id for t in focused} < {t.id for t in full}
    assert any(not _classes(t) <= set(FOCUS_CLASSES) for t in full)
    assert all(split_of(t.source_entry or t.id) == "train" for t in focused)
    assert [t.id for t in seed_pool(None, FOCUS_CLASSES)] == [t.id for t in focused]


def test_held_out_turns_of_the_world_are_enough_for_a_paired_eval() -> None:
    held_out = suite_tasks("bfcl-turns-base", "eval", FOCUS_CLASSES)
    assert len(held_out) >= 100
    assert all(_classes(t) <= set(FOCUS_CLASSES) for t in held_out)
    assert len(suite_tasks("bfcl-turns-base", "eval")) > len(held_out)


def test_an_unknown_class_is_a_config_error_naming_the_key() -> None:
    settings = load_settings(services={"pool_store": {"seed_classes": ["TradingBots"]}})
    with pytest.raises(ConfigError, match=r"pool_store.*TradingBots"):
        settings.section("pool_store", PoolStoreConfig)
    with pytest.raises(ConfigError, match="seed_classes"):
        seed_tasks_for("bfcl", None, ["NoSuchAPI"])
    with pytest.raises(ValueError, match="no API classes"):
        seed_pool(None, [])


def _cli() -> typer.Typer:
    app = typer.Typer()
    app.command()(eval_command)
    return app


def _eval_json(*options: str) -> dict[str, object]:
    args = ["--suite", "bfcl-turns-base", "--split", "eval", "--policy", "ground-truth"]
    result = CliRunner().invoke(_cli(), [*args, "--limit", "3", "--json", *options])
    assert result.exit_code == 0, result.output
    report: dict[str, object] = json.loads(result.stdout.strip().splitlines()[-1])
    return report


def test_eval_scores_the_configured_world_unless_told_otherwise() -> None:
    default = _eval_json()
    assert default["classes"] == sorted(FOCUS_CLASSES)
    every = _eval_json("--classes", "all")
    assert every["classes"] == "all"
    one = _eval_json("--classes", "TradingBot")
    assert one["classes"] == ["TradingBot"] and one["accuracy"] == 1.0
    bad = CliRunner().invoke(_cli(), ["--classes", "Nope", "--policy", "ground-truth"])
    assert bad.exit_code != 0 and "Nope" in bad.output
