"""Supervise child processes: restart with back-off on crash, stop them all on request.

Each child runs in its own process group, so stopping it also stops anything it spawned;
its stdout and stderr go to its log file. ``stop()`` sends SIGTERM to every group, waits
up to ``stop_timeout_s`` and SIGKILLs what is left: no process outlives the supervisor.

Crash budget: a child that exits ``max_crashes`` times within ``crash_window_s`` is held
back (not restarted again) and the reason is reported. The back-off between restarts
doubles on every exit and resets only once the child said it was ready (it creates the
file named by ``COEVOLVE_READY_FILE``; the actor runtime does once it is "running"), not
after some uptime: a service that dies at the end of a long start-up keeps backing off.
With ``state_path`` the supervisor writes every child's state there as JSON (read by
``coevolve status``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Literal

from coevolve.shared.runtime.backoff import Backoff
from coevolve.shared.runtime.child_process import child_setup

log = logging.getLogger(__name__)

READY_FILE_ENV = "COEVOLVE_READY_FILE"

ChildState = Literal["starting", "running", "backing_off", "held_back", "stopped"]


def mark_ready() -> None:
    """Tell a supervisor that this process is ready (no-op when not supervised)."""
    path = os.environ.get(READY_FILE_ENV)
    if path:
        with contextlib.suppress(OSError):
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            Path(path).touch()


@dataclass
class ChildSpec:
    name: str
    argv: list[str]
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)
    # created by the child once ready; None: the child never says (back-off never resets)
    ready_file: Path | None = None
    # added to the child's niceness: above 0 it yields the cores to the others
    niceness: int = 0


@dataclass
class Child:
    spec: ChildSpec
    backoff: Backoff  # the wait before its next restart
    process: subprocess.Popen[bytes] | None = None
    log_file: IO[bytes] | None = None
    restarts: int = 0
    started_at: float = 0.0
    next_start_at: float = 0.0
    ready: bool = False
    crashes: deque[float] = field(default_factory=deque)
    last_exit_code: int | None = None
    held_back_reason: str | None = None

    @property
    def state(self) -> ChildState:
        if self.held_back_reason is not None:
            return "held_back"
        if self.process is not None and self.process.poll() is None:
            return "running" if self.ready else "starting"
        return "backing_off" if self.next_start_at else "stopped"


class Supervisor:
    def __init__(
        self,
        specs: list[ChildSpec],
        *,
        min_backoff_s: float = 1.0,
        max_backoff_s: float = 30.0,
        max_crashes: int = 5,
        crash_window_s: float = 600.0,
        stop_timeout_s: float = 8.0,
        state_path: Path | None = None,
        on_event: Callable[[str], None] | None = None,
    ) -> None:
        if max_crashes < 1 or crash_window_s <= 0:
            raise ValueError("max_crashes must be >= 1 and crash_window_s > 0")
        self.children = [
            Child(spec, backoff=Backoff(min_backoff_s, max_backoff_s)) for spec in specs
        ]
        self.max_crashes = max_crashes
        self.crash_window_s = crash_window_s
        self.stop_timeout_s = stop_timeout_s
        self.state_path = state_path
        self.on_event = on_event or log.info
        self._stop = threading.Event()

    def request_stop(self) -> None:
        self._stop.set()

    def run(self, poll_s: float = 0.2) -> None:
        """Start every child, keep them running until ``request_stop``, then stop them."""
        try:
            for child in self.children:
                self._start(child)
            self._write_state()
            while not self._stop.wait(poll_s):
                changed = [self._tend(child) for child in self.children]
                if any(changed):
                    self._write_state()
        finally:
            self.stop()
            self._write_state()

    def pids(self) -> dict[str, int]:
        return {
            c.spec.name: c.process.pid
            for c in self.children
            if c.process is not None and c.process.poll() is None
        }

    def held_back(self) -> dict[str, str]:
        """Children that are no longer restarted, with the reason."""
        return {
            c.spec.name: c.held_back_reason for c in self.children if c.held_back_reason is not None
        }

    def snapshot(self) -> dict[str, Any]:
        """Every child's state, as written to ``state_path``."""
        return {
            "pid": os.getpid(),
            "at": time.time(),
            "max_crashes": self.max_crashes,
            "crash_window_s": self.crash_window_s,
            "children": {
                c.spec.name: {
                    "state": c.state,
                    "pid": c.process.pid if c.process is not None else None,
                    "restarts": c.restarts,
                    "crashes_in_window": len(c.crashes),
                    "backoff_s": c.backoff.upcoming_s,
                    "last_exit_code": c.last_exit_code,
                    "held_back_reason": c.held_back_reason,
                    "log": str(c.spec.log_path),
                }
                for c in self.children
            },
        }

    def _write_state(self) -> None:
        if self.state_path is None:
            return
        try:
            self.state_path.parent.mkdir(parents=True, exist_ok=True)
            partial = self.state_path.with_suffix(".tmp")
            partial.write_text(json.dumps(self.snapshot()))
            partial.replace(self.state_path)  # readers never see half a file
        except OSError as exc:
            log.warning("could not write supervisor state to %s: %s", self.state_path, exc)

    def _start(self, child: Child) -> None:
        child.spec.log_path.parent.mkdir(parents=True, exist_ok=True)
        if child.log_file is None:
            child.log_file = child.spec.log_path.open("ab")
        env = {**os.environ, **child.spec.env}
        if child.spec.ready_file is not None:
            child.spec.ready_file.parent.mkdir(parents=True, exist_ok=True)
            child.spec.ready_file.unlink(missing_ok=True)
            env[READY_FILE_ENV] = str(child.spec.ready_file)
        child.ready = False
        child.process = subprocess.Popen(
            child.spec.argv,
            stdout=child.log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
            preexec_fn=child_setup(child.spec.niceness),
        )
        child.started_at = time.monotonic()
        child.next_start_at = 0.0
        self.on_event(f"started {child.spec.name} (pid {child.process.pid})")

    def _tend(self, child: Child) -> bool:
        """One look at ``child``; True when its state changed."""
        if child.held_back_reason is not None:
            return False
        now = time.monotonic()
        process = child.process
        if process is not None and process.poll() is None:
            return self._saw_ready(child)
        if process is not None:
            # a child may say it is ready and die before a look saw it (a loaded machine)
            self._saw_ready(child)
            self._on_exit(child, process.returncode, now)
            return True
        if now >= child.next_start_at:
            child.restarts += 1
            self._start(child)
            return True
        return False

    @staticmethod
    def _saw_ready(child: Child) -> bool:
        """Whether ``child`` has just said it is ready (its ready file exists): its back-off
        resets."""
        ready_file = child.spec.ready_file
        if child.ready or ready_file is None or not ready_file.exists():
            return False
        child.ready = True
        child.backoff.reset()
        return True

    def _on_exit(self, child: Child, code: int, now: float) -> None:
        child.process = None
        child.last_exit_code = code
        child.crashes.append(now)
        while child.crashes and now - child.crashes[0] > self.crash_window_s:
            child.crashes.popleft()
        name, log_path = child.spec.name, child.spec.log_path
        if len(child.crashes) >= self.max_crashes:
            child.held_back_reason = (
                f"exited {len(child.crashes)} times within {self.crash_window_s:.0f} s "
                f"(last exit code {code}); not restarted again"
            )
            child.next_start_at = 0.0
            self.on_event(f"{name} held back: {child.held_back_reason} (log: {log_path})")
            return
        wait_s = child.backoff.next_delay()
        child.next_start_at = now + wait_s
        self.on_event(
            f"{name} exited with {code}; restarting in {wait_s:.3g} s "
            f"({len(child.crashes)}/{self.max_crashes} exits within "
            f"{self.crash_window_s:.0f} s; log: {log_path})"
        )

    def stop(self) -> None:
        running = [c for c in self.children if c.process is not None and c.process.poll() is None]
        for child in running:
            _signal_group(child, signal.SIGTERM)
        deadline = time.monotonic() + self.stop_timeout_s
        for child in running:
            assert child.process is not None
            try:
                child.process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.on_event(f"{child.spec.name} did not stop in time; killing it")
        for child in self.children:
            # the group may hold grandchildren even when the child itself has exited
            _signal_group(child, signal.SIGKILL)
            if child.process is not None:
                child.process.wait()
            child.next_start_at = 0.0
            if child.log_file is not None:
                child.log_file.close()
                child.log_file = None


def _signal_group(child: Child, sig: signal.Signals) -> None:
    if child.process is None:
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(child.process.pid, sig)


def read_state(path: Path) -> dict[str, Any] | None:
    """What a supervisor last wrote to ``path`` (None when there is nothing readable)."""
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return state if isinstance(state, dict) else None
