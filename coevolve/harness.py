"""One way to run the whole system from outside it: start ``coevolve up`` on a fresh run
directory (its own NATS server, its own process group), wait for a condition, stop it
whole, and leave nothing of it running. What the benchmarks that run the system build
their runs on; the figures a stopped run leaves are read by ``coevolve.run_figures``.

- :meth:`UpRun.start`: ``coevolve up`` (or ``up --schedule lockstep``) in a process group
  of its own, with the caller's shell settings that would point it at another run left
  out, its output appended to a log file, the base run's converted models linked in;
- :meth:`UpRun.wait`: until a :data:`Condition` holds (:func:`policy_version`,
  :func:`learner_steps`, :func:`files_exist`, or any predicate over the run), a time has
  passed, ``up`` has exited or the user pressed Ctrl-C; the run's CPU use is sampled
  meanwhile (:class:`~coevolve.processes.CpuLedger`);
- :meth:`UpRun.expect`: a wait's end that was not the one wanted as an exception;
- :meth:`UpRun.stop`: SIGINT to the group, SIGKILL after a grace period, then every
  process it had started and any process that carries the run directory in its command
  line (``with UpRun.start(...) as run:`` stops it on the way out too);
- :func:`tally_bus` (into a :class:`~coevolve.bus_tally.BusTally`), :func:`watch_bus`,
  :func:`wait_for`, :func:`until_signalled`: the asynchronous side, for a caller that
  follows the bus while the run goes on.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import anyio
from anyio.abc import TaskStatus
from nats.aio.subscription import DEFAULT_SUB_PENDING_BYTES_LIMIT, Subscription

from coevolve.bus_tally import BusTally
from coevolve.processes import (
    STOP_GRACE_S,
    UP_START_TIMEOUT_S,
    CpuLedger,
    descendants,
    kill_leftovers,
    kill_survivors,
    share_model_cache,
    stop_process_group,
    wait_for_nats_url,
)
from coevolve.report.run_data import LEARNER_STEPS, policy_files, read_steps
from coevolve.shared.config import DEFAULT_RUN_DIR, BusSettings
from coevolve.shared.llm.server import API_KEY_ENV, BASE_URL_ENV, MODEL_ENV
from coevolve.shared.runtime.bus import Bus
from coevolve.shared.runtime.credentials import CREDENTIALS_DIR_ENV
from coevolve.shared.runtime.nats_server import free_port
from coevolve.shared.runtime.subjects import PREFIX

# settings a caller's shell may hold that would point a run at someone else's
INHERITED = (
    "NATS_URL",
    "COEVOLVE_CONFIG",
    "COEVOLVE_RUN_DIR",
    "OMP_NUM_THREADS",
    CREDENTIALS_DIR_ENV,
    BASE_URL_ENV,
    API_KEY_ENV,
    MODEL_ENV,
)
# what a caller's shell may name for a run on purpose: an LLM endpoint and credentials
EXTERNAL_ENDPOINTS = (CREDENTIALS_DIR_ENV, BASE_URL_ENV, API_KEY_ENV, MODEL_ENV)
CPU_SAMPLE_EVERY_S = 5.0
# rollout groups are ~50 KB each: a subscription to everything has room for a burst
TALLY_PENDING_BYTES = 512 * 1024 * 1024
# more than any run reaches: time ends a lockstep run started here, not its iterations
LOCKSTEP_ITERATIONS = 1_000_000

Ended = Literal["condition", "time", "exited", "interrupted"]
Condition = Callable[["UpRun"], bool]


def base_run_dir() -> Path:
    """The run directory the caller works in (``COEVOLVE_RUN_DIR``, else the default):
    its converted models are shared, its ``bench/`` folder holds the benchmarks' runs."""
    return Path(os.environ.get("COEVOLVE_RUN_DIR") or DEFAULT_RUN_DIR)


def output_dir(name: str, base: Path | None = None) -> Path:
    """``BASE/bench/<name>-<stamp>``, created, as an absolute path."""
    path = (base or base_run_dir()) / "bench" / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"
    path.mkdir(parents=True, exist_ok=True)
    return path.resolve()


def clean_environment(
    env: Mapping[str, str] = os.environ, keep: Iterable[str] = ()
) -> dict[str, str]:
    """``env`` without the :data:`INHERITED` settings, except those named in ``keep``."""
    dropped = set(INHERITED) - set(keep)
    return {k: v for k, v in env.items() if k not in dropped}


def machine_cores() -> int:
    """The cores this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def up_argv(
    run_dir: Path,
    *,
    nats_port: int | None = None,
    config: Path | None = None,
    scale: Sequence[str] = (),
    lockstep_iterations: int | None = None,
    quiet: bool = False,
) -> list[str]:
    """``coevolve up``'s command line for a run on ``run_dir``: async on a NATS server of
    its own on ``nats_port`` (None: the one ``NATS_URL`` names), or lockstep for
    ``lockstep_iterations`` learner steps."""
    argv = [sys.executable, "-m", "coevolve", "up", "--run-dir", str(run_dir)]
    if quiet:
        argv.append("--quiet")
    if config is not None:
        argv += ["--config", str(config)]
    if lockstep_iterations is not None:
        return [*argv, "--schedule", "lockstep", "--iterations", str(lockstep_iterations)]
    if nats_port is not None:
        argv += ["--nats-port", str(nats_port)]
    for value in scale:
        argv += ["--scale", value]
    return argv


def spawn_group(
    argv: Sequence[str], env: Mapping[str, str], log_path: Path
) -> subprocess.Popen[bytes]:
    """``argv`` as the leader of a process group of its own (so it can be stopped whole),
    its output appended to ``log_path``."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("ab") as log:
        return subprocess.Popen(
            list(argv),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=dict(env),
            start_new_session=True,
        )


def interrupt_on_sigterm() -> None:
    """Make SIGTERM end this process as Ctrl-C does, so a run's ``with`` block still stops
    it: ``up`` leads a session of its own, and by default SIGTERM ends the caller at once,
    leaving the run behind. Only where nothing else handles SIGTERM, in the main thread."""
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _raise_interrupt)


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")


@dataclass(frozen=True)
class Stopped:
    """How a run ended and was stopped."""

    exited_early: bool  # up had exited before it was asked to stop
    graceful: bool  # it stopped within the grace period after SIGINT
    returncode: int | None
    stop_s: float
    killed: list[int]  # processes of the run still there after the stop, then SIGKILLed


@dataclass
class UpRun:
    """One ``coevolve up`` run, from its spawn to its stop."""

    run_dir: Path
    log_path: Path
    process: subprocess.Popen[bytes]
    started: float = field(default_factory=time.monotonic)  # monotonic, at the spawn
    started_at: float = field(default_factory=time.time)  # Unix seconds, at the spawn
    shared_models: bool = False
    cpu: CpuLedger = field(default_factory=CpuLedger)
    stopped: Stopped | None = None
    stopped_at: float | None = None  # Unix seconds, when the stop was asked for
    _next_cpu_sample: float = 0.0

    @classmethod
    def start(
        cls,
        run_dir: Path,
        log_path: Path,
        *,
        nats_url: str | None = None,
        config: Path | None = None,
        scale: Sequence[str] = (),
        lockstep: bool = False,
        threads: int = 1,
        quiet: bool = False,
        keep_env: Iterable[str] = (),
        env: Mapping[str, str] | None = None,
        base: Path | None = None,
        argv: Sequence[str] | None = None,
    ) -> UpRun:
        """``coevolve up`` on ``run_dir``: a NATS server of its own on a free port unless
        ``nats_url`` names one; ``lockstep``: ``up --schedule lockstep`` with more
        iterations than it finishes. Each process gets ``threads`` torch threads and no
        hub access; ``keep_env`` names :data:`INHERITED` settings to pass on anyway and
        ``env`` adds settings. ``argv`` replaces the command line (tests)."""
        shared = share_model_cache(run_dir, base or base_run_dir())
        environment = {
            **clean_environment(keep=keep_env),
            **(env or {}),
            "OMP_NUM_THREADS": str(threads),
            "HF_HUB_OFFLINE": "1",
        }
        if nats_url is not None:
            environment["NATS_URL"] = nats_url
        if argv is None:
            argv = up_argv(
                run_dir,
                nats_port=None if nats_url is not None else free_port(),
                config=config,
                scale=scale,
                lockstep_iterations=LOCKSTEP_ITERATIONS if lockstep else None,
                quiet=quiet,
            )
        interrupt_on_sigterm()
        process = spawn_group(argv, environment, log_path)
        return cls(run_dir, log_path, process, shared_models=shared)

    def __enter__(self) -> UpRun:
        return self

    def __exit__(self, *_: object) -> None:
        if self.stopped is None:
            self.stop()

    @property
    def running(self) -> bool:
        return self.process.poll() is None

    def elapsed_s(self) -> float:
        """Seconds since the spawn (until the stop, once stopped)."""
        if self.stopped_at is not None:
            return self.stopped_at - self.started_at
        return time.monotonic() - self.started

    def nats_url(self, timeout_s: float = UP_START_TIMEOUT_S) -> str:
        """The URL of the NATS server ``up`` started, once it listens."""
        return wait_for_nats_url(self.run_dir, self.process, timeout_s)

    def bus_settings(self, url: str | None = None) -> BusSettings:
        """Settings to connect to the run's bus (its own credentials, where it has any)."""
        from coevolve.shared.runtime.credentials import run_bus_settings

        return run_bus_settings(self.run_dir, url or self.nats_url())

    def sample_cpu(self, every_s: float = CPU_SAMPLE_EVERY_S) -> None:
        """Read the CPU time of the run's processes, at most once per ``every_s``."""
        now = time.monotonic()
        if now >= self._next_cpu_sample:
            self.cpu.sample(self.process.pid)
            self._next_cpu_sample = now + every_s

    def wait(
        self,
        until: Condition | None = None,
        *,
        seconds: float | None = None,
        poll_s: float = 1.0,
        on_poll: Callable[[UpRun], None] | None = None,
    ) -> Ended:
        """Until ``until(self)`` holds or ``seconds`` after the spawn have passed (at least
        one of them), ``up`` exits, or Ctrl-C; says which. Samples the CPU meanwhile and
        calls ``on_poll`` (progress lines) after each poll."""
        if until is None and seconds is None:
            raise ValueError("wait for a condition, a time or both")
        deadline = None if seconds is None else self.started + seconds
        try:
            while True:
                self.sample_cpu()
                if until is not None and until(self):
                    return "condition"
                if not self.running:
                    return "exited"
                if deadline is not None and time.monotonic() >= deadline:
                    return "time"
                left = poll_s if deadline is None else deadline - time.monotonic()
                time.sleep(max(0.0, min(poll_s, left)))
                if on_poll is not None:
                    on_poll(self)
        except KeyboardInterrupt:
            return "interrupted"

    def expect(self, ended: Ended, wanted: Ended, waiting_for: str = "the condition") -> None:
        """Raise unless a :meth:`wait` ended as ``wanted``: KeyboardInterrupt on Ctrl-C (the
        caller stops as if :meth:`wait` had not caught it), RuntimeError when ``up`` exited
        (its return code and log named), TimeoutError when the time ran out before
        ``waiting_for``."""
        if ended == wanted:
            return
        if ended == "interrupted":
            raise KeyboardInterrupt
        if ended == "exited":
            raise RuntimeError(
                f"coevolve up exited with {self.process.returncode} (see {self.log_path})"
            )
        raise TimeoutError(
            f"no {waiting_for} within {self.elapsed_s():.0f} s (see {self.log_path})"
        )

    def stop(self, grace_s: float = STOP_GRACE_S) -> Stopped:
        """Stop ``up`` and everything it started (see the module's docstring)."""
        if self.stopped is not None:
            return self.stopped
        self.cpu.sample(self.process.pid)  # what each part used until the stop
        self.stopped_at = self.started_at + (time.monotonic() - self.started)
        exited_early = not self.running
        tree = descendants(self.process.pid)
        shutdown = stop_process_group(self.process, grace_s)
        killed = kill_survivors(tree) + kill_leftovers(str(self.run_dir.resolve()))
        self.stopped = Stopped(
            exited_early, shutdown.graceful, shutdown.returncode, shutdown.seconds, killed
        )
        return self.stopped

    def stop_report(self) -> dict[str, object]:
        """The stop as a result's JSON gives it (empty while the run is running)."""
        if self.stopped is None:
            return {}
        s = self.stopped
        return {
            "exited_early": s.exited_early,
            "graceful": s.graceful,
            "returncode": s.returncode,
            "stop_s": s.stop_s,
            "killed_after_stop": s.killed,
        }


# ---------------------------------------------------------------------- conditions


def policy_version(at_least: int) -> Condition:
    """The learner has written policy ``v<at_least>`` or a later one (v1: the warm start;
    every trained step writes the next)."""
    return lambda run: max(policy_files(run.run_dir), default=0) >= at_least


def learner_steps(at_least: int) -> Condition:
    """The learner's step records (``RUN_DIR/learner/steps.jsonl``) hold ``at_least`` steps."""
    return lambda run: len(read_steps(run.run_dir / LEARNER_STEPS)) >= at_least


def files_exist(*names: str | Path) -> Condition:
    """Every one of ``names`` (relative to the run directory) exists."""
    return lambda run: all((run.run_dir / name).exists() for name in names)


# ---------------------------------------------------------------------- the bus


async def wait_for(
    predicate: Callable[[], bool | Awaitable[bool]], timeout_s: float, poll_s: float = 0.5
) -> float | None:
    """Seconds until ``predicate()`` (plain or async) held, or None if it did not within
    ``timeout_s``."""
    started = time.monotonic()
    with anyio.move_on_after(timeout_s):
        while True:
            value = predicate()
            if inspect.isawaitable(value):
                value = await value
            if value:
                return round(time.monotonic() - started, 1)
            await anyio.sleep(poll_s)
    return None


OnMessage = Callable[[str, bytes, dict[str, str]], None]


async def watch_bus(
    settings: BusSettings,
    subjects: Sequence[str],
    on_message: OnMessage,
    *,
    name: str = "harness",
    pending_bytes: int = DEFAULT_SUB_PENDING_BYTES_LIMIT,
    connect_timeout_s: float = 10.0,
    task_status: TaskStatus[Bus] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Pass every message on ``subjects`` (core NATS: it sees every publish, JetStream or
    not, without taking part in any consumer) to ``on_message(subject, data, headers)``
    until cancelled. ``task_status`` gets the connection once the subscriptions are live."""
    bus = await Bus.connect(settings, name=name)
    try:
        with anyio.fail_after(connect_timeout_s):
            subscriptions = [
                await bus.nc.subscribe(s, pending_bytes_limit=pending_bytes) for s in subjects
            ]
            await bus.nc.flush()

        async def pump(subscription: Subscription) -> None:
            async for message in subscription.messages:
                on_message(message.subject, message.data, dict(message.headers or {}))

        async with anyio.create_task_group() as tg:
            for subscription in subscriptions:
                tg.start_soon(pump, subscription)
            task_status.started(bus)
    finally:
        with anyio.move_on_after(5, shield=True):
            await bus.close(timeout=3.0)


async def stream_messages(bus: Bus, stream: str) -> list[tuple[str, bytes]]:
    """(subject, data) of every message a JetStream stream holds now, in order."""
    info = await bus.js.stream_info(stream)
    messages = []
    for seq in range(int(info.state.first_seq), int(info.state.last_seq) + 1):
        with contextlib.suppress(Exception):  # deleted (acked) messages leave gaps
            raw = await bus.js.get_msg(stream, seq)
            messages.append((raw.subject or "", raw.data or b""))
    return messages


async def tally_bus(
    settings: BusSettings,
    tally: BusTally,
    *,
    name: str = "harness",
    connect_timeout_s: float = 10.0,
    task_status: TaskStatus[Bus] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Every ``coevolve.>`` message into ``tally`` until cancelled (see :func:`watch_bus`)."""
    await watch_bus(
        settings,
        [f"{PREFIX}.>"],
        tally.observe,
        name=name,
        pending_bytes=TALLY_PENDING_BYTES,
        connect_timeout_s=connect_timeout_s,
        task_status=task_status,
    )


async def until_signalled(
    work: Callable[[], Awaitable[None]],
    signals: tuple[signal.Signals, ...] = (signal.SIGINT, signal.SIGTERM),
    prefix: str = "harness",
) -> signal.Signals | None:
    """Run ``work``; on one of ``signals`` cancel it and return that signal (else None),
    so Ctrl-C ends a watch early and the caller still stops the run and reports."""
    received: list[signal.Signals] = []
    async with anyio.create_task_group() as tg:

        async def watch_signals() -> None:
            with anyio.open_signal_receiver(*signals) as incoming:
                async for signum in incoming:
                    print(f"[{prefix}] {signal.Signals(signum).name}: stopping early", flush=True)
                    received.append(signal.Signals(signum))
                    tg.cancel_scope.cancel()
                    return

        tg.start_soon(watch_signals)
        await work()
        tg.cancel_scope.cancel()
    return received[0] if received else None
