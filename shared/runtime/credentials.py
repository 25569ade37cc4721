"""NATS credentials: generated per user into files only the owner can read, and found
again by whoever connects (``resolve``); the local LLM server's API key beside them.

A credentials file is JSON ``{"user": ..., "password": ...}``. ``python -m
coevolve.shared.runtime.credentials DIR`` writes one per user under ``DIR/nats/`` and the
nats-server ``authorization`` block as ``DIR/nats-auth.conf`` (for compose / Kubernetes
secrets, docs/security.md).
"""

from __future__ import annotations

import os
import secrets
import sys
from pathlib import Path

import msgspec

from coevolve.shared.config import NATS_CREDENTIALS_DIR, BusSettings
from coevolve.shared.runtime.permissions import ADMIN, READER, USERS, authorization_config

CREDENTIALS_ENV = "COEVOLVE_NATS_CREDS"
CREDENTIALS_DIR_ENV = "COEVOLVE_NATS_CREDS_DIR"
USER_ENV = "COEVOLVE_NATS_USER"
AUTH_CONFIG_FILE = "nats-auth.conf"

# The local LLM server `coevolve up` starts binds 127.0.0.1 and requires this key: `up`
# writes it (0600) under the run directory and gives its path to every child in the env.
LLM_API_KEY_FILE = Path("secrets/llm-api-key")
LLM_API_KEY_FILE_ENV = "COEVOLVE_LLM_API_KEY_FILE"


class CredentialsError(RuntimeError):
    pass


class Credentials(msgspec.Struct, frozen=True):
    user: str
    password: str


def write_private(path: Path, data: bytes) -> None:
    """Write ``path`` readable and writable by the owner only (0600), in a 0700 folder."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(data)
    os.chmod(path, 0o600)  # an older file keeps its mode through O_TRUNC


def new_credentials() -> dict[str, Credentials]:
    """A fresh random password for every user (in memory)."""
    return {user: Credentials(user=user, password=secrets.token_urlsafe(32)) for user in USERS}


def write_credentials(directory: Path, credentials: dict[str, Credentials]) -> None:
    """One owner-only file per user, ``directory/<user>.json``, in a 0700 folder."""
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(directory, 0o700)
    for user, creds in credentials.items():
        write_private(directory / f"{user}.json", msgspec.json.encode(creds))


def generate_credentials(directory: Path) -> dict[str, Credentials]:
    credentials = new_credentials()
    write_credentials(directory, credentials)
    return credentials


def auth_config(credentials: dict[str, Credentials]) -> str:
    return authorization_config({user: c.password for user, c in credentials.items()})


def load_credentials(path: Path) -> Credentials:
    try:
        return msgspec.json.decode(path.read_bytes(), type=Credentials)
    except (OSError, msgspec.DecodeError) as exc:
        raise CredentialsError(f"cannot read NATS credentials {path}: {exc}") from exc


def resolve(settings: BusSettings, user: str | None = None) -> Credentials | None:
    """The credentials a connection uses, or None (no authentication configured).

    A credentials file given to the process wins (a deployed service has one identity);
    else the file of ``user`` in the credentials folder, and when there is none (a test
    actor), the default user's (``settings.user``, ``COEVOLVE_NATS_USER``, ``reader``).
    """
    single = settings.credentials or os.environ.get(CREDENTIALS_ENV)
    if single:
        return load_credentials(Path(single))
    folder = settings.credentials_dir or os.environ.get(CREDENTIALS_DIR_ENV)
    if not folder:
        return None
    if user and (Path(folder) / f"{user}.json").is_file():
        return load_credentials(Path(folder) / f"{user}.json")
    default = settings.user or os.environ.get(USER_ENV) or READER
    return load_credentials(Path(folder) / f"{default}.json")


def service_environment(settings: BusSettings, service: str) -> dict[str, str]:
    """The environment that gives a child service its own credentials file, if any."""
    folder = settings.credentials_dir or os.environ.get(CREDENTIALS_DIR_ENV)
    if settings.credentials or not folder or not (Path(folder) / f"{service}.json").is_file():
        return {}
    return {CREDENTIALS_ENV: str(Path(folder) / f"{service}.json")}


def run_bus_settings(run_dir: Path, url: str, connect_timeout_s: float = 10.0) -> BusSettings:
    """Settings to watch and drive a run that `coevolve up` started in ``run_dir`` (a
    benchmark, the experiment): its server, as the admin user when `up` wrote credentials."""
    folder = run_dir / NATS_CREDENTIALS_DIR
    if not folder.is_dir():
        return BusSettings(url=url, connect_timeout_s=connect_timeout_s)
    return BusSettings(
        url=url, connect_timeout_s=connect_timeout_s, credentials_dir=str(folder), user=ADMIN
    )


def ensure_llm_api_key(run_dir: Path) -> Path:
    """The local LLM server's API key file (created once, 0600); returns its path."""
    path = run_dir / LLM_API_KEY_FILE
    if not path.is_file():
        write_private(path, secrets.token_urlsafe(32).encode())
    return path


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m coevolve.shared.runtime.credentials DIR", file=sys.stderr)
        return 2
    target = Path(argv[0])
    credentials = generate_credentials(target / "nats")
    write_private(target / AUTH_CONFIG_FILE, auth_config(credentials).encode())
    print(f"wrote {len(credentials)} credentials under {target / 'nats'} and {AUTH_CONFIG_FILE}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
