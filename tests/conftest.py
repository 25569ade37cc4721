"""Fixtures that start real parts: a nats-server with JetStream and authentication per test."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from coevolve.shared.config import PACING_ENV, Settings, load_settings
from coevolve.shared.runtime.credentials import (
    CREDENTIALS_DIR_ENV,
    USER_ENV,
    generate_credentials,
    load_credentials,
)
from coevolve.shared.runtime.nats_server import NatsServer
from coevolve.shared.runtime.permissions import ADMIN, USERS

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# one torch thread per process: tests start several model processes on two cores
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# the same numbers on every CPU: bf16 is chosen only where a test asks for it
os.environ.setdefault("COEVOLVE_DTYPE", "float32")
# a learner in a test does not wait for a data loop the test did not start; the tests of
# the pacing contract turn it on themselves
os.environ.setdefault(PACING_ENV, "none")


@pytest.fixture
def nats_credentials(tmp_path: Path) -> Path:
    """One credentials file per bus user (shared/runtime/permissions.py), as `coevolve up` makes."""
    folder = tmp_path / "secrets" / "nats"
    generate_credentials(folder)
    return folder


@pytest.fixture
def nats_server(
    tmp_path: Path, nats_credentials: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[NatsServer]:
    """A nats-server with authentication and every user's permissions on. Each actor
    connects as its own user (its service's name); a connection that names none (the
    test's own) is admin, and so is an actor without a role (a test probe). Child
    processes inherit the same through the environment."""
    credentials = {user: load_credentials(nats_credentials / f"{user}.json") for user in USERS}
    server = NatsServer(
        tmp_path / "nats", log_file=tmp_path / "nats.log", credentials=credentials
    ).start()
    monkeypatch.setenv(CREDENTIALS_DIR_ENV, str(nats_credentials))
    monkeypatch.setenv(USER_ENV, ADMIN)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def settings(tmp_path: Path, nats_server: NatsServer) -> Settings:
    settings = load_settings(run_dir=str(tmp_path / "run"))
    settings.bus.url = nats_server.url
    settings.runtime.heartbeat_interval_s = 0.5
    settings.runtime.fetch_timeout_s = 0.3
    settings.runtime.drain_timeout_s = 5.0
    return settings
