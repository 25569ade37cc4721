"""Benchmarks and the experiment watch a run that `coevolve up` secured: they find its
credentials in the run directory and connect as admin, on a real nats-server."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest

from coevolve.shared.config import NATS_CREDENTIALS_DIR, BusSettings
from coevolve.shared.runtime.bus import Bus, BusError
from coevolve.shared.runtime.credentials import new_credentials, run_bus_settings, write_credentials
from coevolve.shared.runtime.nats_server import NatsServer
from coevolve.shared.runtime.subjects import PREFIX

pytestmark = pytest.mark.anyio


async def test_watcher_of_a_secured_run_sees_every_subject(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("COEVOLVE_NATS_CREDS", "COEVOLVE_NATS_CREDS_DIR", "COEVOLVE_NATS_USER"):
        monkeypatch.delenv(name, raising=False)
    run = tmp_path / "run"
    credentials = new_credentials()
    with NatsServer(tmp_path / "nats", credentials=credentials) as server:
        write_credentials(run / NATS_CREDENTIALS_DIR, credentials)
        # what the benchmarks did before: no credentials, refused
        with pytest.raises(BusError):
            await Bus.connect(BusSettings(url=server.url, connect_timeout_s=1.0), name="bare")
        bus = await Bus.connect(run_bus_settings(run, server.url), name="watcher")
        try:
            subscription = await bus.nc.subscribe(f"{PREFIX}.>")
            await bus.nc.publish(f"{PREFIX}.signals.boundary", b"x")
            with anyio.fail_after(5):
                message = await subscription.next_msg(timeout=5)
            assert message.subject == f"{PREFIX}.signals.boundary"
        finally:
            await bus.close()


def test_run_without_credentials_connects_without_authentication(tmp_path: Path) -> None:
    settings = run_bus_settings(tmp_path, "nats://127.0.0.1:4222")
    assert settings.credentials_dir is None and settings.user is None
