"""Fixtures that start real parts: a nats-server with JetStream per test."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from coevolve.shared.config import Settings, load_settings
from coevolve.shared.nats_server import NatsServer

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# one torch thread per process: tests start several model processes on two cores
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# the same numbers on every CPU: bf16 is chosen only where a test asks for it
os.environ.setdefault("COEVOLVE_DTYPE", "float32")


@pytest.fixture
def nats_server(tmp_path: Path) -> Iterator[NatsServer]:
    server = NatsServer(tmp_path / "nats", log_file=tmp_path / "nats.log").start()
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
