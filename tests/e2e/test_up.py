"""`coevolve up` for real: NATS (one server, or a cluster of three) and all seven services
as processes, status, SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from coevolve.shared.runtime.subjects import BACKGROUND_SERVICES, DEFAULT_SERVICES

pytestmark = pytest.mark.e2e


def coevolve(*args: str) -> list[str]:
    return [sys.executable, "-m", "coevolve", *args]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is dead for our purpose
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split()[2]
    except OSError:
        return False
    return state != "Z"


def assert_data_loop_yields(services: list[dict], up_pid: int) -> None:
    """The data-loop services and the LLM server run at a lower CPU priority (a higher
    niceness) than the learner, rollout and pool store."""
    niceness = {s["service"]: psutil.Process(s["pid"]).nice() for s in services}
    first = max(niceness[name] for name in ("learner", "rollout", "pool_store"))
    background = [name for name in BACKGROUND_SERVICES if name in niceness]
    assert len(background) >= 4 and all(niceness[n] > first for n in background), niceness
    llm = [
        child
        for child in psutil.Process(up_pid).children(recursive=True)
        if "llama_cpp.server" in " ".join(child.cmdline())
    ]
    assert llm and all(child.nice() > first for child in llm), niceness


@pytest.mark.parametrize("nats_nodes", [1, 3], ids=["one-server", "cluster-of-3"])
def test_up_status_and_sigterm_leave_no_process(tmp_path: Path, nats_nodes: int) -> None:
    run_dir = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k != "NATS_URL"}
    cluster = ["--nats-cluster", str(nats_nodes)] if nats_nodes > 1 else []
    # its output to a file: a pipe nobody reads while it runs could fill and block it
    output = tmp_path / "up.out"
    with output.open("wb") as out:
        up = subprocess.Popen(
            coevolve("up", "--run-dir", str(run_dir), "--nats-port", "0", *cluster),
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    report: dict = {}
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            assert up.poll() is None, output.read_text()
            probe = subprocess.run(
                coevolve("status", "--json", "--run-dir", str(run_dir)),
                env=env,
                capture_output=True,
                text=True,
                timeout=30,
            )
            if probe.returncode == 0:
                report = json.loads(probe.stdout.strip().splitlines()[-1])
                fresh = {s["service"] for s in report["services"] if s["heartbeat_age_s"] < 5}
                if fresh >= set(DEFAULT_SERVICES):
                    break
            time.sleep(1)
        fresh = {s["service"] for s in report.get("services", []) if s["heartbeat_age_s"] < 5}
        assert fresh >= set(DEFAULT_SERVICES), report
        assert report["missing"] == []
        assert {s["stream"] for s in report["streams"]} >= {"COEVOLVE_ROLLOUT_GROUPS"}

        if nats_nodes > 1:  # every stream led by one node and copied to the two others
            for stream in report["streams"]:
                assert stream["leader"] is not None, stream
                assert len(stream["replicas"]) == nats_nodes - 1, stream
        up_info = json.loads((run_dir / "up.json").read_text())
        assert len(up_info["nats_pids"]) == nats_nodes
        pids = [s["pid"] for s in report["services"]] + up_info["nats_pids"]
        assert all(alive(pid) for pid in pids)
        assert_data_loop_yields(report["services"], up.pid)

        up.send_signal(signal.SIGTERM)
        assert up.wait(120) == 0
        # every service stopped by itself within its stop timeout: none had to be killed
        assert "did not stop in time" not in output.read_text(), output.read_text()
        leftovers = [pid for pid in pids if alive(pid)]
        assert leftovers == []
        assert not (run_dir / "up.json").exists()
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
