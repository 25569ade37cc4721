"""A child started with a niceness runs every thread it starts at that lower priority,
and the supervisor starts a child with its spec's niceness."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import psutil
import pytest

from coevolve.shared.runtime.child_process import child_setup
from coevolve.shared.runtime.supervisor import ChildSpec, Supervisor
from tests.support.wait import wait_until_sync

MAX_NICENESS = 19
# prints the niceness of the main thread and of a thread it starts (Linux keeps it per thread)
THREADS = """
import os, threading
seen = []
own = lambda: seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
thread = threading.Thread(target=own)
thread.start(); thread.join()
print(os.getpriority(os.PRIO_PROCESS, 0), seen[0])
"""


@pytest.mark.parametrize("niceness", [7, 0])
def test_every_thread_of_a_child_runs_at_its_niceness(niceness: int) -> None:
    own = os.nice(0)
    if own + niceness > MAX_NICENESS:
        pytest.skip(f"this process already runs at niceness {own}")
    child = subprocess.run(
        [sys.executable, "-c", THREADS],
        preexec_fn=child_setup(niceness),
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    assert child.stdout.split() == [str(own + niceness)] * 2


def test_the_supervisor_starts_each_child_at_its_specs_niceness(tmp_path: Path) -> None:
    if os.nice(0) + 10 > MAX_NICENESS:
        pytest.skip(f"this process already runs at niceness {os.nice(0)}")
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    supervisor = Supervisor(
        [
            ChildSpec(name="first", argv=sleeper, log_path=tmp_path / "first.log"),
            ChildSpec(name="yields", argv=sleeper, log_path=tmp_path / "yields.log", niceness=10),
        ],
        stop_timeout_s=5.0,
    )
    thread = threading.Thread(target=supervisor.run, kwargs={"poll_s": 0.02}, daemon=True)
    thread.start()
    try:
        wait_until_sync(lambda: len(supervisor.pids()) == 2, 30, "both children started")
        niceness = {name: psutil.Process(pid).nice() for name, pid in supervisor.pids().items()}
        assert niceness["yields"] == niceness["first"] + 10
    finally:
        supervisor.request_stop()
        thread.join(20)
    assert not thread.is_alive()
