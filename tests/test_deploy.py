"""compose.yaml, the image and the README agree (no Docker engine runs here)."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from coevolve.cli.serve import SERVICES
from coevolve.shared.runtime.nats_server import NatsServer
from coevolve.shared.runtime.subjects import STREAMS

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


def test_the_cluster_profile_gives_every_service_three_nodes_and_three_copies() -> None:
    base = compose()["services"]
    cluster = yaml.safe_load((ROOT / "compose.cluster.yaml").read_text())["services"]
    nodes = {name for name in cluster if name.startswith("nats")}
    assert nodes == {"nats", "nats-2", "nats-3"}
    for name in set(base) - {"nats"}:
        environment = cluster[name]["environment"]
        urls = environment["NATS_URL"].split(",")
        assert {url.split("//")[1].split(":")[0] for url in urls} == nodes, name
        assert environment["COEVOLVE_NATS_REPLICAS"] == "3"
    names = {cluster[node]["environment"]["NATS_NODE"] for node in nodes}
    assert names == {"n1", "n2", "n3"}


def test_the_cluster_nodes_config_is_accepted_by_nats_server(tmp_path: Path) -> None:
    """``nats-server -t`` checks deploy/nats-cluster.conf as a node would load it."""
    import os
    import shutil
    import subprocess

    from coevolve.shared.runtime.credentials import auth_config, new_credentials
    from coevolve.shared.runtime.nats_server import find_binary

    conf = tmp_path / "nats-cluster.conf"
    shutil.copy(ROOT / "deploy" / "nats-cluster.conf", conf)
    (tmp_path / "auth.conf").write_text(auth_config(new_credentials()))
    checked = subprocess.run(
        [str(find_binary()), "-c", str(conf), "-t"],
        env={**os.environ, "NATS_NODE": "n2"},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert checked.returncode == 0, checked.stderr
    routes = re.findall(r"nats-route://([\w-]+):6222", conf.read_text())
    assert set(routes) == {"nats", "nats-2", "nats-3"}


def stated_store_bytes(config_text: str) -> int:
    match = re.search(r"max_file_store:\s*(\d+)\s*(GB|G)?", config_text)
    assert match, "max_file_store is not stated"
    return int(match.group(1)) * (1024**3 if match.group(2) else 1)


def test_every_nats_config_states_a_file_store_that_holds_the_streams_bounds(
    tmp_path: Path,
) -> None:
    """Left unset, JetStream sizes its store from the disk's free space and refuses the
    streams on a small disk."""
    reserved = sum(spec.max_bytes for spec in STREAMS)
    configs = [NatsServer(tmp_path).config_text()] + [
        (ROOT / "deploy" / name).read_text() for name in ("nats.conf", "nats-cluster.conf")
    ]
    for text in configs:
        assert stated_store_bytes(text) >= reserved
