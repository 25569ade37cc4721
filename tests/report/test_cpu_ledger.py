"""CPU seconds per part of a run, read from its real process tree."""

from __future__ import annotations

import subprocess
import sys
import time

import psutil
import pytest

from coevolve.processes import CpuLedger, part_of_run


def test_command_lines_name_their_part_of_the_run() -> None:
    python = sys.executable
    assert part_of_run(f"{python} -m coevolve serve rollout --run-dir /r") == "rollout"
    assert part_of_run(f"{python} -m coevolve serve judge --config c.yaml") == "judge"
    assert part_of_run(f"{python} -m llama_cpp.server --model m.gguf") == "llm"
    assert part_of_run("/venv/bin/nats-server -js -p 4222") == "nats"
    assert part_of_run(f"{python} -m coevolve up --run-dir /r") == "up"
    assert part_of_run(f"{python} -m pytest tests") == "other"


def test_a_child_that_exits_keeps_the_time_it_was_seen_using() -> None:
    busy = "import time\nend = time.process_time() + 0.3\nwhile time.process_time() < end: pass"
    child = subprocess.Popen([sys.executable, "-c", busy, "serve", "rollout"])
    ledger = CpuLedger()
    try:
        while child.poll() is None:
            ledger.sample(child.pid)
    finally:
        child.wait(timeout=30)
    ledger.sample(child.pid)  # gone: nothing new, nothing lost

    assert ledger.totals()["rollout"] >= 0.1


def test_a_process_read_while_exiting_keeps_its_part(monkeypatch: pytest.MonkeyPatch) -> None:
    # Between exit and zombie, Linux shows an empty command line; that window cannot be
    # hit on purpose, so the second read is made to return what the kernel returns then.
    busy = "import time\nend = time.process_time() + 0.2\nwhile time.process_time() < end: pass"
    child = subprocess.Popen([sys.executable, "-c", busy, "serve", "rollout"])
    ledger = CpuLedger()
    try:
        while "rollout" not in ledger.totals() and child.poll() is None:  # read after its exec
            ledger.sample(child.pid)
        time.sleep(0.5)
        monkeypatch.setattr(psutil.Process, "cmdline", lambda self: [])
        ledger.sample(child.pid)
    finally:
        child.wait(timeout=30)

    assert list(ledger.totals()) == ["rollout"]
