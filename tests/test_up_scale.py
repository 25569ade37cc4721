"""Which services `coevolve up` starts, and how many of each."""

from __future__ import annotations

import pytest
import typer

from coevolve.cli.sections import enabled_optional_services
from coevolve.cli.up import parse_scale
from coevolve.shared.config import Settings
from coevolve.shared.runtime.subjects import DEFAULT_SERVICES, ENABLED_BY_DEFAULT


def test_the_defaults_start_one_of_each_default_service_and_no_other() -> None:
    enabled = enabled_optional_services(Settings())
    assert enabled == set(ENABLED_BY_DEFAULT) == set()
    replicas = parse_scale([], enabled)
    assert {name for name, count in replicas.items() if count == 1} == set(DEFAULT_SERVICES)
    assert replicas["evaluator"] == 0


def test_an_optional_service_starts_only_when_its_section_turns_it_on() -> None:
    assert parse_scale([], enabled_optional_services(Settings()))["distiller"] == 0
    settings = Settings(services={"distiller": {"enabled": True}})
    assert parse_scale([], enabled_optional_services(settings))["distiller"] == 1


def test_an_enabled_optional_service_starts() -> None:
    assert parse_scale([], {"evaluator"})["evaluator"] == 1


def test_scale_overrides_both_ways() -> None:
    replicas = parse_scale(["explorer=0", "evaluator=1", "rollout=2"])
    assert (replicas["explorer"], replicas["evaluator"], replicas["rollout"]) == (0, 1, 2)


def test_an_unknown_service_is_refused() -> None:
    with pytest.raises(typer.BadParameter, match="--scale takes SERVICE=N"):
        parse_scale(["explorers=0"])
