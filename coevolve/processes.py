"""``coevolve up`` as a child process, and the process trees it leaves (through psutil,
so no ``/proc`` is read by hand): what the harness (``coevolve.harness``), on which the
experiments and the benchmarks run, uses to wait for a run, stop it whole and make sure
nothing of it is left running."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from coevolve.up_state import recorded_nats_url

UP_START_TIMEOUT_S = 120.0
STOP_GRACE_S = 60.0


def wait_for_nats_url(
    run_dir: Path, process: subprocess.Popen[bytes], timeout_s: float = UP_START_TIMEOUT_S
) -> str:
    """The NATS URL ``up`` records once its server listens; fails if ``up`` exits first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        url = recorded_nats_url(run_dir)
        if url is not None:
            return url
        if process.poll() is not None:
            raise RuntimeError(f"coevolve up exited with {process.returncode} before NATS was up")
        time.sleep(0.2)
    raise TimeoutError(f"coevolve up recorded no NATS URL in {run_dir} within {timeout_s} s")


@dataclass(frozen=True)
class Shutdown:
    graceful: bool
    returncode: int | None
    seconds: float


def stop_process_group(
    process: subprocess.Popen[bytes],
    grace_s: float = STOP_GRACE_S,
    sig: signal.Signals = signal.SIGINT,
) -> Shutdown:
    """Send ``sig`` to the process group led by ``process``; SIGKILL the group after ``grace_s``.

    ``process`` must have been started with ``start_new_session=True``. The group is
    SIGKILLed at the end even after a graceful exit: it may hold grandchildren.
    """
    started = time.monotonic()
    graceful = True
    if process.poll() is None:
        signal_group(process.pid, sig)
        try:
            process.wait(grace_s)
        except subprocess.TimeoutExpired:
            graceful = False
    signal_group(process.pid, signal.SIGKILL)
    returncode = process.wait(10)
    return Shutdown(graceful, returncode, round(time.monotonic() - started, 1))


def signal_group(group: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(group, sig)


def kill_leftovers(marker: str) -> list[int]:
    """SIGKILL every process whose command line contains ``marker``, with its process group.

    The marker is the run directory: only this run's services and NATS server carry it
    (each leads a session of its own), so an ``up`` killed mid-shutdown leaves none behind.
    """
    killed: list[int] = []
    own_pid, own_group = os.getpid(), os.getpgrp()
    for process in psutil.process_iter(["cmdline"]):
        command = " ".join(process.info["cmdline"] or ())
        if process.pid == own_pid or marker not in command:
            continue
        with contextlib.suppress(ProcessLookupError, psutil.Error):
            group = os.getpgid(process.pid)
            if group != own_group:
                signal_group(group, signal.SIGKILL)
            process.kill()
            killed.append(process.pid)
    return killed


def descendants(pid: int) -> dict[int, float]:
    """Every process below ``pid`` (children in sessions of their own too), with its start
    time, so one killed later is the same process and not a reused pid."""
    found: dict[int, float] = {}
    with contextlib.suppress(psutil.Error):
        for child in psutil.Process(pid).children(recursive=True):
            with contextlib.suppress(psutil.Error):
                found[child.pid] = child.create_time()
    return found


def descendant_commands(pid: int) -> list[tuple[int, str]]:
    """(pid, command line) of every process below ``pid``."""
    found: list[tuple[int, str]] = []
    with contextlib.suppress(psutil.Error):
        for child in psutil.Process(pid).children(recursive=True):
            with contextlib.suppress(psutil.Error):
                found.append((child.pid, " ".join(child.cmdline())))
    return found


def kill_survivors(processes: Mapping[int, float]) -> list[int]:
    """SIGKILL those of ``processes`` (pid -> start time) still running as themselves."""
    killed = []
    for pid, started in processes.items():
        with contextlib.suppress(psutil.Error):
            process = psutil.Process(pid)
            if process.create_time() != started:
                continue
            process.kill()
            killed.append(pid)
    return killed


def part_of_run(command: str) -> str:
    """Which part of a run a command line is: a service (``coevolve serve NAME``), the
    LLM server, the NATS server, or ``up`` itself."""
    words = command.split()
    if "serve" in words and words.index("serve") + 1 < len(words):
        return words[words.index("serve") + 1]
    if "llama_cpp.server" in command:
        return "llm"
    if "nats-server" in command:
        return "nats"
    return "up" if "up" in words else "other"


@dataclass
class CpuLedger:
    """CPU seconds (user + system) per part of a run, from each process's latest sample:
    a process that exits keeps what it was last seen using, a restarted service adds its
    new process."""

    seen: dict[tuple[int, float], tuple[str, float]] = field(default_factory=dict)

    def sample(self, pid: int) -> None:
        """Read ``pid`` and every process below it."""
        with contextlib.suppress(psutil.Error):
            root = psutil.Process(pid)
            for process in (root, *root.children(recursive=True)):
                with contextlib.suppress(psutil.Error):
                    with process.oneshot():
                        times = process.cpu_times()
                        key = (process.pid, process.create_time())
                        command = " ".join(process.cmdline())
                    # An exiting process reads an empty command line: keep the part it had.
                    known = self.seen.get(key)
                    part = known[0] if known and not command else part_of_run(command)
                    self.seen[key] = (part, times.user + times.system)

    def totals(self) -> dict[str, float]:
        parts: dict[str, float] = {}
        for part, seconds in self.seen.values():
            parts[part] = round(parts.get(part, 0.0) + seconds, 1)
        return dict(sorted(parts.items()))


def share_model_cache(run_dir: Path, base_run_dir: Path) -> bool:
    """Link ``run_dir/models`` to the base run's converted models, when it has any."""
    models = base_run_dir.resolve() / "models"
    if not models.is_dir() or (run_dir / "models").exists():
        return False
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "models").symlink_to(models, target_is_directory=True)
    return True
