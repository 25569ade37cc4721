"""compose.yaml, the image and the README agree (no Docker engine runs here)."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from coevolve.cli.serve import SERVICES

ROOT = Path(__file__).resolve().parents[1]
INSTALL = "bash deploy/install.sh"
SCALABLE = {"rollout", "explorer", "abstractor", "judge"}


def compose() -> dict:
    return yaml.safe_load((ROOT / "compose.yaml").read_text())


def test_compose_runs_every_service_with_a_real_serve_name() -> None:
    services = compose()["services"]
    served = {}
    for name, spec in services.items():
        if name == "nats":
            continue
        command = spec["command"]
        assert command[0] == "serve", name
        assert command[1] in SERVICES, f"{name}: {command[1]} is not a coevolve service"
        served[command[1]] = spec
    assert set(served) == set(SERVICES)


def test_scalable_services_have_no_fixed_names_or_ports() -> None:
    services = compose()["services"]
    for name in SCALABLE:
        spec = services[name]
        assert "container_name" not in spec and "ports" not in spec, name


def test_nats_has_jetstream_and_services_point_at_it() -> None:
    services = compose()["services"]
    conf = (ROOT / "deploy" / "nats.conf").read_text()
    assert re.search(r"^jetstream\s*{", conf, re.M)
    assert "./deploy/nats.conf:/etc/nats/nats.conf:ro" in services["nats"]["volumes"]
    for name, spec in services.items():
        if name != "nats":
            assert spec["environment"]["NATS_URL"] == "nats://nats:4222"


def test_image_installs_with_the_readme_install_step() -> None:
    dockerfile = (ROOT / "deploy" / "Dockerfile").read_text()
    runs = [
        line.removeprefix("RUN ").strip()
        for line in dockerfile.splitlines()
        if line.startswith("RUN ")
    ]
    assert runs == [INSTALL]
    assert INSTALL in (ROOT / "README.md").read_text()
    assert INSTALL in (ROOT / ".ci" / "run").read_text()
    images = {spec.get("build", {}).get("dockerfile") for spec in compose()["services"].values()}
    assert "deploy/Dockerfile" in images
