"""The supervisor's crash budget and back-off, on real child processes (small scripts)."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from coevolve.cli import app
from coevolve.shared.runtime.nats_server import NatsServer
from coevolve.shared.runtime.supervisor import ChildSpec, Supervisor, read_state
from coevolve.up_state import SUPERVISOR_FILE, supervised_services
from tests.support.wait import wait_until_sync

# exits at once with code 3: a crash loop
CRASH_AT_ONCE = "import sys; sys.exit(3)"
# a long start-up that dies before it is ready (an OOM kill during a warm start)
DIE_DURING_STARTUP = "import time, sys; time.sleep(0.3); sys.exit(1)"
# says it is ready, then dies after the same time: its back-off resets every time
READY_THEN_DIE = (
    "import os, pathlib, time, sys; pathlib.Path(os.environ['COEVOLVE_READY_FILE']).touch(); "
    "time.sleep(0.3); sys.exit(1)"
)
# says it is ready and exits at once, before a supervisor's look can see it running
READY_THEN_EXIT = (
    "import os, pathlib, sys; pathlib.Path(os.environ['COEVOLVE_READY_FILE']).touch(); sys.exit(1)"
)
HEALTHY = (
    "import os, pathlib, time; pathlib.Path(os.environ['COEVOLVE_READY_FILE']).touch(); "
    "time.sleep(600)"
)


@dataclass
class Events:
    lines: list[tuple[float, str]] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __call__(self, line: str) -> None:
        with self._lock:
            self.lines.append((time.monotonic(), line))

    def starts(self, name: str) -> list[float]:
        with self._lock:
            return [at for at, line in self.lines if line.startswith(f"started {name} ")]

    def matching(self, text: str) -> list[str]:
        with self._lock:
            return [line for _, line in self.lines if text in line]


def spec(tmp_path: Path, name: str, code: str) -> ChildSpec:
    return ChildSpec(
        name=name,
        argv=[sys.executable, "-c", code],
        log_path=tmp_path / "logs" / f"{name}.log",
        ready_file=tmp_path / "ready" / name,
    )


def supervisor_of(tmp_path: Path, children: dict[str, str], **settings: Any) -> Supervisor:
    """A supervisor of small scripts (``children``: name -> code), their logs and ready
    files under ``tmp_path``; ``settings``: its back-off, crash budget, state file and
    event sink."""
    return Supervisor([spec(tmp_path, name, code) for name, code in children.items()], **settings)


def crash_loop_beside(tmp_path: Path, looping: str, healthy: str, **settings: Any) -> Supervisor:
    """A supervisor of ``looping``, which exits at once with code 3, and ``healthy``, which
    says it is ready and runs on; a crash is restarted after 0.05 s."""
    children = {looping: CRASH_AT_ONCE, healthy: HEALTHY}
    return supervisor_of(tmp_path, children, min_backoff_s=0.05, **settings)


# a crash budget no test here exhausts and a back-off that doubles from 0.1 s: back-off only
BACKING_OFF: dict[str, Any] = {"min_backoff_s": 0.1, "max_backoff_s": 60.0, "max_crashes": 100}


@contextmanager
def supervising(supervisor: Supervisor) -> Iterator[Supervisor]:
    thread = threading.Thread(target=supervisor.run, kwargs={"poll_s": 0.02}, daemon=True)
    thread.start()
    try:
        yield supervisor
    finally:
        supervisor.request_stop()
        thread.join(20)
        assert not thread.is_alive()


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


def test_crash_loop_is_held_back_and_reported_while_a_healthy_child_runs_on(
    tmp_path: Path,
) -> None:
    events = Events()
    state_path = tmp_path / "supervisor.json"
    supervisor = crash_loop_beside(
        tmp_path,
        "looper",
        "steady",
        max_crashes=3,
        crash_window_s=60.0,
        state_path=state_path,
        on_event=events,
    )
    with supervising(supervisor):
        wait_until_sync(lambda: "looper" in supervisor.held_back(), 60, "looper held back")
        steady_pid = supervisor.pids()["steady"]

        def recorded() -> bool:
            state = read_state(state_path)
            children = state["children"] if state else {}
            return (
                children.get("looper", {}).get("state") == "held_back"
                and children.get("steady", {}).get("state") == "running"
            )

        wait_until_sync(recorded, 60, "the state file to say looper held back, steady running")
        time.sleep(1.0)  # room for a wrongful restart: five of the 0.2 s back-off it would get
        assert len(events.starts("looper")) == 3
        assert "looper" not in supervisor.pids()
        reason = supervisor.held_back()["looper"]
        assert "exited 3 times within 60 s" in reason and "exit code 3" in reason
        [line] = events.matching("looper held back")
        assert reason in line and "looper.log" in line

        state = read_state(state_path)
        assert state is not None
        assert state["children"]["looper"]["state"] == "held_back"
        assert state["children"]["looper"]["held_back_reason"] == reason
        assert state["children"]["steady"]["state"] == "running"
        # the healthy child was never touched
        assert supervisor.pids()["steady"] == steady_pid and alive(steady_pid)
        assert len(events.starts("steady")) == 1
        assert supervisor.held_back() == {"looper": reason}
    assert not alive(steady_pid)


def test_a_child_that_dies_during_start_up_keeps_backing_off(tmp_path: Path) -> None:
    """Dying 0.3 s into its start-up, never ready: each restart waits twice as long as the
    one before. The same child that said it was ready restarts after the minimum back-off
    every time."""
    events = Events()
    supervisor = supervisor_of(
        tmp_path,
        {"slow": DIE_DURING_STARTUP, "ready": READY_THEN_DIE},
        on_event=events,
        **BACKING_OFF,
    )
    with supervising(supervisor):
        wait_until_sync(
            lambda: len(events.starts("slow")) >= 5 and len(backoffs(events, "ready")) >= 4,
            120,
            "five starts of slow and four restarts of ready",
        )
    assert backoffs(events, "slow")[:4] == [0.1, 0.2, 0.4, 0.8]
    ready = backoffs(events, "ready")
    assert len(ready) >= 4 and set(ready) == {0.1}
    # and the waits are real: the fourth restart came more than start-up + 0.8 s later
    slow = events.starts("slow")
    assert slow[4] - slow[3] > 0.3 + 0.8
    assert supervisor.held_back() == {}


def test_a_child_that_said_it_was_ready_keeps_the_minimum_back_off_however_soon_it_dies(
    tmp_path: Path,
) -> None:
    events = Events()
    supervisor = supervisor_of(tmp_path, {"brief": READY_THEN_EXIT}, on_event=events, **BACKING_OFF)
    with supervising(supervisor):
        wait_until_sync(lambda: len(backoffs(events, "brief")) >= 4, 120, "four restarts")
    assert set(backoffs(events, "brief")) == {0.1}


def backoffs(events: Events, name: str) -> list[float]:
    """The back-off of each restart of ``name``, as its event lines announce it."""
    lines = events.matching(f"{name} exited with ")
    return [float(line.split("restarting in ")[1].split(" s")[0]) for line in lines]


def test_status_names_the_held_back_service_and_why(
    tmp_path: Path, nats_server: NatsServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_dir = tmp_path / "run"
    supervisor = crash_loop_beside(
        tmp_path,
        "learner",
        "judge",
        max_crashes=2,
        state_path=run_dir / SUPERVISOR_FILE,
    )
    monkeypatch.setenv("NATS_URL", nats_server.url)
    with supervising(supervisor):
        wait_until_sync(lambda: "learner" in supervisor.held_back(), 60, "learner held back")
        wait_until_sync(lambda: "judge" in supervised_services(run_dir), 60, "judge supervised")
        as_json = CliRunner().invoke(app, ["status", "--json", "--run-dir", str(run_dir)])
        as_text = CliRunner().invoke(app, ["status", "--run-dir", str(run_dir)])
    assert as_json.exit_code == 0, as_json.output
    report = json.loads(as_json.output.strip().splitlines()[-1])
    reason = supervisor.held_back()["learner"]
    assert report["held_back"] == {"learner": reason}
    assert report["supervisor"]["judge"]["state"] == "running"
    assert as_text.exit_code == 0, as_text.output
    assert f"held back by the supervisor: learner: {reason}" in as_text.output
