"""Secure by default: generated credentials, compose from secrets with no port published,
the deployed nats.conf with the generated authorization, and the documented table."""

from __future__ import annotations

import shutil
import stat
import subprocess
from pathlib import Path

import yaml

from coevolve.shared.config import BusSettings
from coevolve.shared.runtime.credentials import (
    AUTH_CONFIG_FILE,
    ensure_llm_api_key,
    load_credentials,
    main,
    service_environment,
)
from coevolve.shared.runtime.nats_server import find_binary
from coevolve.shared.runtime.permissions import USERS, markdown_table
from coevolve.shared.runtime.subjects import SERVICES

ROOT = Path(__file__).resolve().parents[2]


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def compose(name: str = "compose.yaml") -> dict:
    return yaml.safe_load((ROOT / name).read_text())


def test_generated_secrets_are_owner_only_and_distinct(tmp_path: Path) -> None:
    assert main([str(tmp_path / "secrets")]) == 0
    folder = tmp_path / "secrets" / "nats"
    assert mode(folder) == 0o700
    passwords = set()
    for user in USERS:
        path = folder / f"{user}.json"
        assert mode(path) == 0o600, path
        creds = load_credentials(path)
        assert creds.user == user and len(creds.password) >= 32
        passwords.add(creds.password)
    assert len(passwords) == len(USERS)
    assert mode(tmp_path / "secrets" / AUTH_CONFIG_FILE) == 0o600
    key = ensure_llm_api_key(tmp_path / "run")
    assert mode(key) == 0o600 and len(key.read_text()) >= 32
    assert ensure_llm_api_key(tmp_path / "run").read_text() == key.read_text()  # kept


def test_each_child_service_is_given_only_its_own_credentials(tmp_path: Path) -> None:
    main([str(tmp_path)])
    settings = BusSettings(credentials_dir=str(tmp_path / "nats"))
    for service in SERVICES:
        env = service_environment(settings, service)
        assert env == {"COEVOLVE_NATS_CREDS": str(tmp_path / "nats" / f"{service}.json")}


def test_deployed_nats_conf_with_generated_authorization_is_valid(tmp_path: Path) -> None:
    main([str(tmp_path / "secrets")])
    etc = tmp_path / "etc"
    etc.mkdir()
    conf = (ROOT / "deploy" / "nats.conf").read_text().replace('"/data"', f'"{tmp_path}/data"')
    (etc / "nats.conf").write_text(conf)
    shutil.copy(tmp_path / "secrets" / AUTH_CONFIG_FILE, etc / "auth.conf")
    checked = subprocess.run(
        [str(find_binary()), "-t", "-c", str(etc / "nats.conf")],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert checked.returncode == 0, checked.stderr
    # and without the authorization it would not start at all: nothing is open by default
    (etc / "auth.conf").unlink()
    missing = subprocess.run(
        [str(find_binary()), "-t", "-c", str(etc / "nats.conf")],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert missing.returncode != 0


def test_compose_publishes_no_port_and_takes_credentials_from_secrets() -> None:
    spec = compose()
    services, secrets = spec["services"], spec["secrets"]
    for name, service in services.items():
        assert "ports" not in service, f"{name} publishes a port by default"
    assert services["nats"]["secrets"] == [{"source": "nats_auth", "target": "/etc/nats/auth.conf"}]
    assert secrets["nats_auth"]["file"] == f"./deploy/secrets/{AUTH_CONFIG_FILE}"
    assert "include ./auth.conf" in (ROOT / "deploy" / "nats.conf").read_text()
    served = {s["command"][1]: s for n, s in services.items() if n != "nats"}
    assert set(served) == set(SERVICES)
    for service, spec_ in served.items():
        secret = f"nats_{service}"
        assert spec_["secrets"] == [secret]
        assert spec_["environment"]["COEVOLVE_NATS_CREDS"] == f"/run/secrets/{secret}"
        assert secrets[secret]["file"] == f"./deploy/secrets/nats/{service}.json"


def test_ports_are_published_only_by_the_explicit_override_on_loopback() -> None:
    override = compose("compose.ports.yaml")["services"]
    assert set(override) == {"nats"}
    assert override["nats"]["ports"] == ["127.0.0.1:4222:4222", "127.0.0.1:8222:8222"]


def test_secrets_never_reach_git_or_the_image() -> None:
    assert "deploy/secrets/" in (ROOT / ".gitignore").read_text().splitlines()
    assert "deploy/secrets/" in (ROOT / ".dockerignore").read_text().splitlines()


def test_security_doc_shows_the_permission_table_of_the_code() -> None:
    assert markdown_table() in (ROOT / "docs" / "security.md").read_text()
