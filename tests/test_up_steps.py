"""The steps of ``coevolve up`` before its services run: NATS started with fresh
credentials (or NATS_URL's taken), what ``up`` records for other processes, and the child
process of each service replica."""

from __future__ import annotations

from pathlib import Path

import psutil
import pytest
import typer

from coevolve.cli.up import Nats, prepare_run_dir, service_specs, start_nats
from coevolve.shared.config import NATS_CREDENTIALS_DIR, load_settings
from coevolve.shared.runtime.credentials import CREDENTIALS_DIR_ENV, CREDENTIALS_ENV
from coevolve.up_state import record_up, recorded_nats_url

OUTSIDE_URL = "nats://127.0.0.1:4999"


def test_up_starts_nats_with_fresh_credentials_and_records_its_url(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("NATS_URL", raising=False)
    monkeypatch.setenv(CREDENTIALS_DIR_ENV, "")  # start_nats points it at the run's own
    settings = load_settings(run_dir=str(tmp_path / "run"))
    run = prepare_run_dir(settings)
    assert recorded_nats_url(run) is None
    nats = start_nats(settings, port=0, cluster=1)
    try:
        pids = nats.pids()
        assert nats.server is not None and nats.url == nats.server.url == nats.bus.url
        assert len(pids) == 1 and psutil.Process(pids[0]).is_running()
        credentials = run / NATS_CREDENTIALS_DIR
        assert nats.bus.credentials_dir == str(credentials)
        assert (credentials / "learner.json").is_file()
        record_up(run, nats.url, pids)
        assert recorded_nats_url(run) == nats.url
    finally:
        nats.stop()
    assert not psutil.pid_exists(pids[0])


def test_with_nats_url_up_starts_no_server_and_refuses_a_cluster(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NATS_URL", OUTSIDE_URL)
    settings = load_settings(run_dir=str(tmp_path / "run"))
    nats = start_nats(settings, port=0, cluster=1)
    assert (nats.url, nats.server, nats.pids()) == (OUTSIDE_URL, None, [])
    assert nats.bus is settings.bus
    with pytest.raises(typer.BadParameter, match="unset NATS_URL"):
        start_nats(settings, port=0, cluster=3)


def test_each_replica_is_a_serve_child_with_its_own_log_and_credentials(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(CREDENTIALS_DIR_ENV, raising=False)
    settings = load_settings(run_dir=str(tmp_path / "run"))
    run = settings.run_dir
    (tmp_path / "secrets").mkdir()
    (tmp_path / "secrets" / "judge.json").write_text("{}")
    settings.bus.credentials_dir = str(tmp_path / "secrets")
    config = tmp_path / "coevolve.yaml"
    nats = Nats(OUTSIDE_URL, settings.bus)
    specs = service_specs(settings, config, {"explorer": 2, "judge": 1, "learner": 0}, nats, None)
    assert [spec.name for spec in specs] == ["explorer-0", "explorer-1", "judge"]
    assert specs[1].log_path == run / "logs" / "explorer-1.log"
    assert specs[2].argv[-6:] == ["serve", "judge", "--run-dir", str(run), "--config", str(config)]
    assert all(spec.env["NATS_URL"] == OUTSIDE_URL for spec in specs)
    # a service with a credentials file gets it; the others have none to get
    assert specs[2].env[CREDENTIALS_ENV] == str(tmp_path / "secrets" / "judge.json")
    assert CREDENTIALS_ENV not in specs[0].env
