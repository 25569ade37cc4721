"""Supervise child processes: restart with back-off on crash, stop them all on request.

Each child runs in its own process group, so stopping it also stops anything it spawned;
its stdout and stderr go to its log file. ``stop()`` sends SIGTERM to every group, waits
up to ``stop_timeout_s`` and SIGKILLs what is left: no process outlives the supervisor.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

log = logging.getLogger(__name__)


@dataclass
class ChildSpec:
    name: str
    argv: list[str]
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)


@dataclass
class Child:
    spec: ChildSpec
    process: subprocess.Popen[bytes] | None = None
    log_file: IO[bytes] | None = None
    restarts: int = 0
    started_at: float = 0.0
    next_start_at: float = 0.0
    backoff_s: float = 1.0


class Supervisor:
    def __init__(
        self,
        specs: list[ChildSpec],
        *,
        max_backoff_s: float = 30.0,
        healthy_after_s: float = 60.0,
        stop_timeout_s: float = 8.0,
        on_event: Callable[[str], None] | None = None,
    ) -> None:
        self.children = [Child(spec) for spec in specs]
        self.max_backoff_s = max_backoff_s
        self.healthy_after_s = healthy_after_s
        self.stop_timeout_s = stop_timeout_s
        self.on_event = on_event or log.info
        self._stop = threading.Event()

    def request_stop(self) -> None:
        self._stop.set()

    def run(self, poll_s: float = 0.2) -> None:
        """Start every child, keep them running until ``request_stop``, then stop them."""
        try:
            for child in self.children:
                self._start(child)
            while not self._stop.wait(poll_s):
                for child in self.children:
                    self._tend(child)
        finally:
            self.stop()

    def pids(self) -> dict[str, int]:
        return {
            c.spec.name: c.process.pid
            for c in self.children
            if c.process is not None and c.process.poll() is None
        }

    def _start(self, child: Child) -> None:
        child.spec.log_path.parent.mkdir(parents=True, exist_ok=True)
        if child.log_file is None:
            child.log_file = child.spec.log_path.open("ab")
        child.process = subprocess.Popen(
            child.spec.argv,
            stdout=child.log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **child.spec.env},
            start_new_session=True,
        )
        child.started_at = time.monotonic()
        self.on_event(f"started {child.spec.name} (pid {child.process.pid})")

    def _tend(self, child: Child) -> None:
        now = time.monotonic()
        process = child.process
        if process is not None and process.poll() is None:
            if now - child.started_at > self.healthy_after_s:
                child.backoff_s = 1.0
            return
        if process is not None:
            code = process.returncode
            child.process = None
            child.next_start_at = now + child.backoff_s
            self.on_event(
                f"{child.spec.name} exited with {code}; restarting in {child.backoff_s:.0f} s "
                f"(log: {child.spec.log_path})"
            )
            child.backoff_s = min(child.backoff_s * 2, self.max_backoff_s)
            return
        if now >= child.next_start_at:
            child.restarts += 1
            self._start(child)

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
            if child.log_file is not None:
                child.log_file.close()
                child.log_file = None


def _signal_group(child: Child, sig: signal.Signals) -> None:
    if child.process is None:
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(child.process.pid, sig)
