"""Chaos benchmark: ``coevolve up`` on the defaults under a fault schedule, then an audit.

The bench runs its own nats-server (``up`` uses it through ``NATS_URL``) so it can stop
and restart it with its store kept. At a random moment of the run (seeded), each of these
happens once:

- ``kill -9`` of every service's process group, each waiting (until ``BUSY_UNTIL`` of the
  run at most) for the service to be busy: the learner in a GRPO step (heartbeat phase
  ``GRPO_STEP_PHASE``), the others with ``in_flight > 0`` (rollout in a group, the
  explorer in an exploration, pool-store in a write);
- NATS stopped for ``NATS_DOWN_S`` and restarted on the same port and store;
- the LLM endpoint (a ``llama_cpp.server`` process under ``up``) killed, when there is one.

``up`` runs on the defaults, or on the file ``COEVOLVE_CONFIG`` names. Then ``up`` is
stopped and JetStream, DuckDB and the checkpoints are audited:
``groups_lost`` (published, yet neither consumed by a learner step, which trains a group
or counts it as dropped for staleness, nor still waiting in the stream, nor to be made
again by its job, still queued: ``groups_requeued``),
``duplicate_tasks`` / ``duplicate_verdicts`` / ``duplicate_results`` in DuckDB,
``versions_non_monotonic`` (announced versions not strictly increasing, or a digest
announced twice), ``learner_resumed_from_checkpoint``, ``services_alive_at_end`` (the
supervisor's view just before the stop) and the dead letters by reason. Writes
``result.json`` and ``up.log`` under ``RUN_DIR/bench/chaos-<stamp>``.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import random
import signal
import subprocess
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import anyio
import duckdb

from coevolve.bench import tables
from coevolve.bench.flood import reason_of
from coevolve.processes import descendant_commands
from coevolve.shared.config import DEFAULT_RUN_DIR, BusSettings
from coevolve.shared.messages import (
    GRPO_STEP_PHASE,
    DeadLetter,
    DecodeError,
    Heartbeat,
    Metric,
    PolicyVersion,
    RolloutGroup,
    RolloutJob,
    decode,
    derived_id,
)
from coevolve.shared.runtime.bus import MSG_ID_HEADER, Bus
from coevolve.shared.runtime.nats_server import NatsServer
from coevolve.shared.runtime.subjects import (
    DEFAULT_SERVICES,
    HEARTBEATS,
    ROLLOUT_GROUPS,
    metrics_subject,
)
from coevolve.up_state import supervised_services

BUSY_UNTIL = 0.9  # a fault waits for its target to be busy until this share of the run
NATS_DOWN_S = 5.0
LEARNER_CHECKPOINT_GROUPS = Path("checkpoints/learner.groups.json")


@dataclass
class Fault:
    at_s: float
    kind: str  # "kill" | "nats_restart" | "llm_restart"
    target: str = ""
    done_at_s: float | None = None
    pid: int | None = None
    busy: bool | None = None
    outcome: str = "pending"


def fault_schedule(minutes: float, seed: int) -> list[Fault]:
    """One fault of each kind at a random moment in the middle 60% of the run."""
    rng = random.Random(seed)
    total = minutes * 60.0
    faults = [Fault(0.0, "kill", name) for name in DEFAULT_SERVICES]
    faults += [Fault(0.0, "nats_restart"), Fault(0.0, "llm_restart")]
    for fault in faults:
        fault.at_s = round(rng.uniform(0.2 * total, 0.8 * total), 1)
    return sorted(faults, key=lambda f: f.at_s)


@dataclass
class BusView:
    """What a core-NATS listener saw: heartbeats, groups published, learner drops."""

    beats: dict[str, Heartbeat] = field(default_factory=dict)
    groups: set[str] = field(default_factory=set)
    dropped_stale: dict[int, float] = field(default_factory=dict)

    def on_message(self, subject: str, data: bytes, headers: dict[str, str]) -> None:
        try:
            if subject.startswith(f"{HEARTBEATS}."):
                beat = decode(data, Heartbeat)
                self.beats[beat.service] = beat
            elif subject == ROLLOUT_GROUPS:
                self.groups.add(headers.get(MSG_ID_HEADER) or decode(data, RolloutGroup).id)
            elif subject == metrics_subject("learner"):
                metric = decode(data, Metric)
                if metric.name == "dropped_stale":
                    self.dropped_stale[metric.step] = metric.value
        except DecodeError:
            pass


async def watch(url: str, view: BusView) -> None:
    bus = await Bus.connect(BusSettings(url=url, connect_timeout_s=30.0), "chaos-bench")
    try:
        subjects = (f"{HEARTBEATS}.>", ROLLOUT_GROUPS, metrics_subject("learner"))

        async def pump(subject: str) -> None:
            subscription = await bus.nc.subscribe(subject)
            async for msg in subscription.messages:
                view.on_message(msg.subject, msg.data, dict(msg.headers or {}))

        async with anyio.create_task_group() as tg:
            for subject in subjects:
                tg.start_soon(pump, subject)
    finally:
        with anyio.move_on_after(2, shield=True):
            await bus.close(timeout=1.0)


# --------------------------------------------------------------------------- faults


def is_busy(beat: Heartbeat | None) -> bool:
    """Whether a service is mid-work: the learner in a GRPO step, another with work in
    hand."""
    if beat is None:
        return False
    if beat.service == "learner":
        return beat.phase == GRPO_STEP_PHASE
    return beat.in_flight > 0


async def inject(
    busy_deadline: float,
    fault: Fault,
    started: float,
    run_dir: Path,
    up: subprocess.Popen[bytes],
    view: BusView,
    server: NatsServer,
) -> None:
    if fault.kind == "kill":
        while time.monotonic() < busy_deadline and not is_busy(view.beats.get(fault.target)):
            await anyio.sleep(0.2)
        fault.busy = is_busy(view.beats.get(fault.target))
        child = supervised_services(run_dir).get(fault.target, {})
        pid = child.get("pid")
        if not isinstance(pid, int):
            fault.outcome = f"not running ({child.get('state', 'unknown')})"
        else:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
            fault.pid, fault.outcome = pid, "killed"
    elif fault.kind == "nats_restart":
        server.stop()
        await anyio.sleep(NATS_DOWN_S)
        await anyio.to_thread.run_sync(server.start)
        fault.outcome = f"stopped {NATS_DOWN_S:.0f} s, restarted on the same store"
    else:
        servers = [pid for pid, cmd in descendant_commands(up.pid) if "llama_cpp.server" in cmd]
        for pid in servers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        fault.pid = servers[0] if servers else None
        fault.outcome = "killed" if servers else "no LLM endpoint process under up"
    fault.done_at_s = round(time.monotonic() - started, 1)


# --------------------------------------------------------------------------- audit


async def stream_messages(bus: Bus, stream: str) -> list[tuple[str, bytes]]:
    info = await bus.js.stream_info(stream)
    messages = []
    for seq in range(int(info.state.first_seq), int(info.state.last_seq) + 1):
        with contextlib.suppress(Exception):  # deleted (acked) messages leave gaps
            raw = await bus.js.get_msg(stream, seq)
            messages.append((raw.subject or "", raw.data or b""))
    return messages


async def audit_bus(url: str, view: BusView) -> dict[str, Any]:
    bus = await Bus.connect(BusSettings(url=url, connect_timeout_s=30.0), "chaos-audit")
    try:
        waiting = {
            decode(data, RolloutGroup).id
            for _, data in await stream_messages(bus, "COEVOLVE_ROLLOUT_GROUPS")
        }
        # a job still queued makes its group again, under the same id: a group whose
        # publish the stream refused (seen on the subject, never stored) is not lost
        requeued = {
            derived_id("group", decode(data, RolloutJob).id)
            for _, data in await stream_messages(bus, "COEVOLVE_ROLLOUT_JOBS")
        }
        updates = [
            decode(d, PolicyVersion) for _, d in await stream_messages(bus, "COEVOLVE_POLICY")
        ]
        letters = [
            decode(d, DeadLetter) for _, d in await stream_messages(bus, "COEVOLVE_DEAD_LETTERS")
        ]
    finally:
        await bus.close()
    versions = [u.version for u in updates]
    digests = [u.sha256 for u in updates if u.sha256]
    non_monotonic = sum(1 for a, b in itertools.pairwise(versions) if b <= a)
    return {
        "waiting_groups": waiting,
        "requeued_groups": requeued,
        "policy_versions": versions,
        "versions_non_monotonic": non_monotonic + len(digests) - len(set(digests)),
        "dead_letters_by_reason": dict(Counter(reason_of(x) for x in letters).most_common()),
        "dead_letters_by_service": dict(Counter(x.service for x in letters).most_common()),
    }


def audit_pool(db_path: Path) -> dict[str, int]:
    if not db_path.exists():
        return {"duplicate_tasks": 0, "duplicate_verdicts": 0, "duplicate_results": 0}
    with contextlib.closing(duckdb.connect(str(db_path), read_only=True)) as db:

        def count(sql: str) -> int:
            row = db.execute(sql).fetchone()
            return int(row[0]) if row and row[0] is not None else 0

        return {
            "duplicate_tasks": count("SELECT count(*) - count(DISTINCT content_hash) FROM tasks"),
            "duplicate_verdicts": count(
                "SELECT count(*) - count(DISTINCT candidate_id) FROM verdicts"
            ),
            "duplicate_results": count(
                "SELECT count(*) - count(DISTINCT (group_id, sample_index)) FROM rollout_results"
            ),
        }


def trained_groups(run_dir: Path) -> set[str]:
    with contextlib.suppress(OSError, ValueError):
        return set(json.loads((run_dir / LEARNER_CHECKPOINT_GROUPS).read_text()))
    return set()


# what the learner logs when it restarts from its checkpoint, by the phase it was in
RESUME_LINES = {"grpo": "resumed at step", "warm_start": "warm start resumes at"}


def learner_resumes(run_dir: Path) -> list[str]:
    """The phases (grpo, warm_start) a restarted learner resumed from its checkpoint."""
    with contextlib.suppress(OSError):
        log = (run_dir / "logs" / "learner.log").read_text(errors="replace")
        return [phase for phase, line in RESUME_LINES.items() if line in log]
    return []


# --------------------------------------------------------------------------- the bench


def start_up(run_dir: Path, nats_url: str, log_path: Path) -> subprocess.Popen[bytes]:
    from coevolve.processes import spawn_up

    env = {**os.environ, "NATS_URL": nats_url}
    env.pop("COEVOLVE_RUN_DIR", None)  # COEVOLVE_CONFIG, when set, is the run's config
    return spawn_up(["--run-dir", str(run_dir)], env, log_path)


async def chaos(run_dir: Path, out_dir: Path, minutes: float, seed: int) -> dict[str, Any]:
    # imported here: dataloop imports the CLI, which lists the benchmarks
    from coevolve.processes import stop_process_group

    # outside the run directory: kill_leftovers(run_dir) must not take it down before the audit
    server = NatsServer(out_dir / "nats", log_file=out_dir / "nats.log").start()
    up = start_up(run_dir, server.url, out_dir / "up.log")
    started = time.monotonic()
    view = BusView()
    faults = fault_schedule(minutes, seed)
    alive_at_end: dict[str, str] = {}
    try:
        busy_deadline = started + BUSY_UNTIL * minutes * 60

        async def fire(fault: Fault) -> None:
            await anyio.sleep(max(0.0, started + fault.at_s - time.monotonic()))
            if up.poll() is not None:
                raise RuntimeError(f"coevolve up exited with {up.returncode}")
            await inject(busy_deadline, fault, started, run_dir, up, view, server)

        async with anyio.create_task_group() as tg:
            tg.start_soon(watch, server.url, view)
            # each fault waits for its own moment and target, so one wait delays no other
            async with anyio.create_task_group() as faulting:
                for fault in faults:
                    faulting.start_soon(fire, fault)
            await anyio.sleep(max(0.0, started + minutes * 60 - time.monotonic()))
            alive_at_end = service_states(run_dir)
            tg.cancel_scope.cancel()
        shutdown, bus_audit = await stop_and_audit(up, run_dir, server.url, view)
    finally:
        if up.poll() is None:
            stop_process_group(up)
        server.stop()
    return {
        "benchmark": "chaos",
        "minutes": minutes,
        "seed": seed,
        "fault_schedule": [asdict(f) for f in faults],
        **run_audit(run_dir, view, bus_audit),
        "learner_resumed_from_checkpoint": bool(learner_resumes(run_dir)),
        "learner_resumed_in": learner_resumes(run_dir),
        "services_alive_at_end": alive_at_end,
        "shutdown": asdict(shutdown),
    }


def service_states(run_dir: Path) -> dict[str, str]:
    """Each supervised service's state (``running``, ``backing_off``...) right now."""
    return {name: str(child.get("state")) for name, child in supervised_services(run_dir).items()}


async def stop_and_audit(
    up: subprocess.Popen[bytes], run_dir: Path, url: str, view: BusView
) -> tuple[Any, dict[str, Any]]:
    """Stop ``up`` (and whatever it left), then audit the bus: (shutdown, bus audit)."""
    from coevolve.processes import kill_leftovers, stop_process_group

    shutdown = await anyio.to_thread.run_sync(stop_process_group, up)
    kill_leftovers(str(run_dir))
    return shutdown, await audit_bus(url, view)


def run_audit(run_dir: Path, view: BusView, bus_audit: dict[str, Any]) -> dict[str, Any]:
    """What became of every group published, and the duplicates and version order."""
    trained = trained_groups(run_dir)
    # the learner records every group a step consumed, stale ones (dropped) included
    unaccounted = view.groups - trained - bus_audit["waiting_groups"]
    requeued = unaccounted & bus_audit["requeued_groups"]
    return {
        "groups_published": len(view.groups),
        "groups_trained": len(trained & view.groups),
        "groups_dropped_stale": int(sum(view.dropped_stale.values())),
        "groups_requeued": len(requeued),
        "groups_lost": len(unaccounted - requeued),
        **audit_pool(run_dir / "pool.duckdb"),
        "versions_non_monotonic": bus_audit["versions_non_monotonic"],
        "policy_versions": bus_audit["policy_versions"],
        "dead_letters_by_reason": bus_audit["dead_letters_by_reason"],
        "dead_letters_by_service": bus_audit["dead_letters_by_service"],
    }


def run(quick: bool = False, minutes: float | None = None, seed: int = 13) -> dict[str, Any]:
    minutes = minutes if minutes is not None else (4.0 if quick else 30.0)
    out_dir, run_dir = bench_run_dirs("chaos")
    result = anyio.run(chaos, run_dir, out_dir, minutes, seed)
    result["quick"] = quick
    (out_dir / "result.json").write_text(json.dumps(result, indent=2))
    _print(result, out_dir)
    return result


def bench_run_dirs(name: str) -> tuple[Path, Path]:
    """``RUN_DIR/bench/<name>-<stamp>`` and the run directory of the ``up`` under it, which
    shares the base run's converted models."""
    # imported here: dataloop imports the CLI, which lists the benchmarks
    from coevolve.processes import share_model_cache

    base = Path(os.environ.get("COEVOLVE_RUN_DIR", DEFAULT_RUN_DIR))
    out_dir = base / "bench" / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"
    run_dir = out_dir / "run"
    run_dir.mkdir(parents=True, exist_ok=True)
    share_model_cache(run_dir, base)
    return out_dir, run_dir


def _print(result: dict[str, Any], out_dir: Path) -> None:
    tables.print_table(
        f"chaos benchmark: {result['minutes']} min, seed {result['seed']} ({out_dir})",
        ("at (s)", "fault", "outcome", "busy"),
        [
            (
                f"{fault['at_s']:.1f}",
                f"{fault['kind']} {fault['target']}".strip(),
                fault["outcome"],
                fault["busy"],
            )
            for fault in result["fault_schedule"]
        ],
        left=(1, 2, 3),
    )
    keys = (
        "groups_published",
        "groups_trained",
        "groups_dropped_stale",
        "groups_requeued",
        "groups_lost",
        "duplicate_tasks",
        "duplicate_verdicts",
        "duplicate_results",
        "versions_non_monotonic",
        "learner_resumed_from_checkpoint",
    )
    tables.print_table(
        None,
        ("audit", "value"),
        [(key, result[key]) for key in keys],
        note=f"services at the end: {result['services_alive_at_end']}\n"
        f"dead letters by reason: {result['dead_letters_by_reason']}",
        left=(0, 1),
    )
