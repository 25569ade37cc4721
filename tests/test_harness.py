"""The harness that runs the whole system from outside (``coevolve.harness``) and the
process handling under it, without `coevolve up` or a model: real child process groups
stand in for ``up``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import anyio
import pytest

from coevolve import processes
from coevolve.harness import (
    INHERITED,
    UpRun,
    clean_environment,
    files_exist,
    learner_steps,
    output_dir,
    policy_version,
    until_signalled,
    up_argv,
    wait_for,
)
from coevolve.report.run_data import LEARNER_STEPS
from coevolve.services.learner.handler import append_step_record, step_record
from tests.support.harness import standin_up
from tests.support.messages import rewarded_group
from tests.support.wait import wait_until_sync

# A stand-in for `coevolve up`: records its NATS URL, then writes policies v1 and v2, and
# stops on SIGINT; it dumps the environment it was given beside its run directory.
FAKE_UP = """
import json, os, pathlib, signal, sys, time
signal.signal(signal.SIGINT, signal.default_int_handler)
run = pathlib.Path(sys.argv[1])
(run / "policies").mkdir(parents=True, exist_ok=True)
(run.parent / "env.json").write_text(json.dumps(dict(os.environ)))
(run / "up.json").write_text(json.dumps({"nats_url": "nats://127.0.0.1:4999"}))
for version in (1, 2):
    time.sleep(0.2)
    (run / "policies" / f"v{version}.safetensors").write_bytes(b"")
time.sleep(120)
"""


def fake_up(tmp_path: Path, code: str = FAKE_UP, **options: Any) -> UpRun:
    return standin_up(tmp_path / "run", tmp_path / "up.log", code, **options)


def test_a_run_is_started_waited_on_and_stopped_whole(tmp_path: Path) -> None:
    with fake_up(tmp_path) as run:
        assert run.nats_url(timeout_s=10) == "nats://127.0.0.1:4999"
        assert run.wait(policy_version(2), seconds=30, poll_s=0.05) == "condition"
        assert run.wait(files_exist("up.json", Path("policies") / "v1.safetensors"), seconds=1)
        assert not policy_version(3)(run)
        assert run.wait(policy_version(3), seconds=run.elapsed_s() + 0.3, poll_s=0.05) == "time"
    stopped = run.stopped
    assert stopped is not None and stopped.graceful and not stopped.exited_early
    assert stopped.returncode != 0  # KeyboardInterrupt: it was stopped, not done
    assert run.stop_report()["graceful"] is True
    assert run.stop() is stopped  # stopping twice is stopping once
    assert sum(run.cpu.totals().values()) >= 0.0 and run.cpu.totals()
    frozen = run.elapsed_s()
    time.sleep(0.05)
    assert run.elapsed_s() == frozen  # the clock stopped with the run


def test_a_run_that_exits_ends_the_wait(tmp_path: Path) -> None:
    with fake_up(tmp_path, "raise SystemExit(3)") as run:
        assert run.wait(policy_version(1), seconds=30, poll_s=0.05) == "exited"
        with pytest.raises(RuntimeError, match="exited with 3"):
            run.nats_url(timeout_s=5)
    assert run.stopped is not None and run.stopped.exited_early
    assert run.stopped.returncode == 3


def test_a_wait_that_did_not_end_as_wanted_is_an_error(tmp_path: Path) -> None:
    with fake_up(tmp_path) as run:
        run.expect(run.wait(policy_version(1), seconds=30, poll_s=0.05), "condition")
        with pytest.raises(TimeoutError, match="no policy v9 within"):
            run.expect(run.wait(policy_version(9), seconds=0.0), "condition", "policy v9")
        ended = run.wait(seconds=run.elapsed_s() + 0.1, poll_s=0.05)
        run.expect(ended, "time")  # waited its time out, as wanted
        with pytest.raises(KeyboardInterrupt):
            run.expect("interrupted", "time")
    with fake_up(tmp_path / "second", "raise SystemExit(3)") as run:
        ended = run.wait(seconds=30, poll_s=0.05)
        with pytest.raises(RuntimeError, match=r"exited with 3 \(see .*up\.log\)"):
            run.expect(ended, "time")


def test_a_wait_needs_a_condition_or_a_time(tmp_path: Path) -> None:
    with fake_up(tmp_path) as run:
        run.nats_url(timeout_s=10)  # stopped once it handles SIGINT, not while it starts
        with pytest.raises(ValueError):
            run.wait()


def test_the_learner_steps_condition_counts_step_records(tmp_path: Path) -> None:
    with fake_up(tmp_path) as run:
        run.nats_url(timeout_s=10)  # stopped once it handles SIGINT, not while it starts
        assert not learner_steps(1)(run)
        groups = [rewarded_group("g1", "t", "seed", 1, 0.0, 1.0)]
        record = step_record(
            groups, step=1, version=2, published=True, version_before=1, max_staleness=2
        )
        append_step_record(run.run_dir / LEARNER_STEPS, record)
        assert learner_steps(1)(run) and not learner_steps(2)(run)


def test_a_run_gets_a_clean_environment_and_what_it_keeps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NATS_URL", "nats://elsewhere:4222")
    monkeypatch.setenv("COEVOLVE_CONFIG", "/elsewhere.yaml")
    monkeypatch.setenv("OMP_NUM_THREADS", "8")
    with fake_up(tmp_path, keep_env=("COEVOLVE_CONFIG",), env={"EXTRA": "1"}) as run:
        run.nats_url(timeout_s=10)
    env = json.loads((tmp_path / "env.json").read_text())
    assert "NATS_URL" not in env and env["COEVOLVE_CONFIG"] == "/elsewhere.yaml"
    assert env["OMP_NUM_THREADS"] == "1" and env["HF_HUB_OFFLINE"] == "1"
    assert env["EXTRA"] == "1"
    with fake_up(tmp_path / "second", nats_url="nats://given:4222", threads=2) as run:
        run.nats_url(timeout_s=10)
    env = json.loads((tmp_path / "second" / "env.json").read_text())
    assert env["NATS_URL"] == "nats://given:4222" and env["OMP_NUM_THREADS"] == "2"


def test_up_command_lines_for_async_and_lockstep_runs() -> None:
    own = up_argv(Path("/runs/x"), nats_port=4300, scale=["explorer=0"], quiet=True)
    assert own[own.index("--nats-port") + 1] == "4300"
    assert own[own.index("--scale") + 1] == "explorer=0" and "--quiet" in own
    lockstep = up_argv(Path("/runs/x"), lockstep_iterations=1_000_000)
    assert lockstep[lockstep.index("--schedule") + 1] == "lockstep"
    assert int(lockstep[lockstep.index("--iterations") + 1]) >= 100_000
    assert "--nats-port" not in up_argv(Path("/runs/x"))  # NATS_URL names the server
    env = clean_environment(
        {"NATS_URL": "nats://elsewhere", "PATH": "/bin", "OMP_NUM_THREADS": "4"}
    )
    assert env == {"PATH": "/bin"}
    assert set(INHERITED) >= {"NATS_URL", "COEVOLVE_RUN_DIR", "COEVOLVE_CONFIG"}


def test_output_directories_are_stamped_under_bench(tmp_path: Path) -> None:
    path = output_dir("dataloop", tmp_path)
    assert path.is_dir() and path.parent == (tmp_path / "bench").resolve()
    assert path.name.startswith("dataloop-")


def test_wait_for_takes_plain_and_async_predicates() -> None:
    async def main() -> tuple[float | None, float | None, float | None]:
        ticks: list[int] = []

        def plain() -> bool:
            ticks.append(1)
            return len(ticks) >= 3

        async def never() -> bool:
            return False

        async def at_once() -> bool:
            return True

        return (
            await wait_for(plain, 5, poll_s=0.01),
            await wait_for(never, 0.1, poll_s=0.01),
            await wait_for(at_once, 1),
        )

    counted, missed, immediate = anyio.run(main)
    assert counted is not None and missed is None and immediate == 0.0


STUBBORN = """
import signal, subprocess, sys, time
signal.signal(signal.SIGINT, signal.SIG_IGN)
signal.signal(signal.SIGTERM, signal.SIG_IGN)
grandchild = subprocess.Popen([sys.executable, "-c",
    "import signal, time; signal.signal(signal.SIGINT, signal.SIG_IGN); time.sleep(120)"])
print(grandchild.pid, flush=True)
time.sleep(120)
"""

# SIGINT's default handler restored: a shell starts background jobs with SIGINT ignored,
# and a child inherits that (so does a test run launched with `&`)
OBEDIENT = (
    "import signal, time; signal.signal(signal.SIGINT, signal.default_int_handler); "
    "print('ready', flush=True); time.sleep(120)"
)


def start_child(code: str, *extra: str) -> tuple[subprocess.Popen[bytes], str]:
    child = subprocess.Popen(
        [sys.executable, "-c", code, *extra], stdout=subprocess.PIPE, start_new_session=True
    )
    assert child.stdout is not None
    first_line = child.stdout.readline().decode().strip()  # handlers are installed by now
    return child, first_line


def gone(pid: int) -> bool:
    """Exited: no such process, or a zombie waiting for a reaper we do not control."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state == "Z"


def test_a_group_that_ignores_sigint_is_killed_after_the_grace_period() -> None:
    child, grandchild_line = start_child(STUBBORN)
    grandchild = int(grandchild_line)
    try:
        started = time.monotonic()
        shutdown = processes.stop_process_group(child, grace_s=1.0)
        took = time.monotonic() - started
    finally:
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
    assert not shutdown.graceful
    assert shutdown.returncode == -signal.SIGKILL
    assert took >= 1.0  # the grace period came first
    wait_until_sync(lambda: gone(grandchild), 60, "the grandchild to exit")


def test_a_child_that_handles_sigint_stops_gracefully() -> None:
    child, ready = start_child(OBEDIENT)
    assert ready == "ready"
    shutdown = processes.stop_process_group(child, grace_s=10.0)
    assert shutdown.graceful  # it exited within its grace period, not killed
    assert shutdown.returncode != 0  # KeyboardInterrupt


def test_leftovers_are_found_by_the_run_directory_in_their_command_line(tmp_path: Path) -> None:
    marker = str(tmp_path / "run")
    ours, _ = start_child(OBEDIENT, "--run-dir", marker)
    other, _ = start_child(OBEDIENT, "--run-dir", str(tmp_path / "other"))
    try:
        killed = processes.kill_leftovers(marker)
        assert killed == [ours.pid]
        assert ours.wait(5) == -signal.SIGKILL
        assert other.poll() is None
    finally:
        for child in (ours, other):
            if child.poll() is None:
                os.killpg(child.pid, signal.SIGKILL)
            child.wait()


def test_the_nats_url_is_read_from_up_json_once_written(tmp_path: Path) -> None:
    writer = (
        "import json, pathlib, sys, time; time.sleep(0.3); "
        "pathlib.Path(sys.argv[1]).write_text(json.dumps({'nats_url': 'nats://127.0.0.1:4999'})); "
        "time.sleep(120)"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", writer, str(tmp_path / "up.json")], start_new_session=True
    )
    try:
        assert processes.wait_for_nats_url(tmp_path, child, timeout_s=10) == "nats://127.0.0.1:4999"
    finally:
        processes.stop_process_group(child, grace_s=5)


def test_an_up_that_exits_before_nats_is_reported(tmp_path: Path) -> None:
    child = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"], start_new_session=True)
    with pytest.raises(RuntimeError, match="exited with 3"):
        processes.wait_for_nats_url(tmp_path, child, timeout_s=10)


def test_the_model_cache_of_the_base_run_is_linked_not_copied(tmp_path: Path) -> None:
    base = tmp_path / "base"
    (base / "models" / "SmolLM2").mkdir(parents=True)
    run_dir = tmp_path / "bench" / "run"
    assert processes.share_model_cache(run_dir, base)
    assert (run_dir / "models" / "SmolLM2").is_dir()
    assert (run_dir / "models").resolve() == (base / "models").resolve()
    assert not processes.share_model_cache(tmp_path / "other", tmp_path / "no-models")


def test_a_signal_ends_the_watch_early_and_is_reported() -> None:
    finished: list[bool] = []

    async def long_watch() -> None:
        await anyio.sleep(30)
        finished.append(True)

    timer = threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    try:
        received = anyio.run(until_signalled, long_watch)
    finally:
        timer.cancel()
    assert received == signal.SIGINT and not finished  # ended before its 30 s watch


def test_without_a_signal_the_watch_runs_to_its_end() -> None:
    async def short_watch() -> None:
        await anyio.sleep(0.1)

    assert anyio.run(until_signalled, short_watch) is None


@pytest.mark.skipif(not Path("/proc/self/stat").is_file(), reason="needs /proc")
def test_survivors_of_the_process_tree_are_killed() -> None:
    # a child that starts a grandchild in a session of its own (as the LLM server is)
    code = (
        "import subprocess, time; "
        "p = subprocess.Popen(['sleep', '60'], start_new_session=True); "
        "print(p.pid, flush=True); time.sleep(60)"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, start_new_session=True
    )
    try:
        assert child.stdout is not None
        grandchild = int(child.stdout.readline())
        tree = processes.descendants(child.pid)
        assert grandchild in tree
        # a pid whose start time differs is another process now: left alone
        assert processes.kill_survivors({grandchild: tree[grandchild] + 1}) == []
        child.kill()
        child.wait(10)
        assert processes.kill_survivors(tree) == [grandchild]
        deadline = time.monotonic() + 10
        while not gone(grandchild) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert gone(grandchild)
    finally:
        child.kill()
        child.wait(10)


# a caller of the harness (as `coevolve experiment ablation` is): starts a run in its own
# session, says the run's pid, and waits on it
CALLER = """
import pathlib, sys
from tests.support.harness import standin_up
tmp = pathlib.Path(sys.argv[1])
with standin_up(tmp / "run", tmp / "up.log") as run:
    print(run.process.pid, flush=True)
    run.expect(run.wait(seconds=120, poll_s=0.05), "time")
"""


def test_sigterm_to_the_caller_stops_its_run(tmp_path: Path) -> None:
    caller, run_pid = start_child(CALLER, str(tmp_path))
    try:
        caller.send_signal(signal.SIGTERM)
        assert caller.wait(timeout=60) != 0  # interrupted, not done
    finally:
        if caller.poll() is None:
            os.killpg(caller.pid, signal.SIGKILL)
    # the run leads a session of its own: only its caller's stop reaches it
    wait_until_sync(lambda: gone(int(run_pid)), 30, "the run to be stopped with its caller")
