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
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import anyio

from coevolve.bench import tables
from coevolve.bench.flood import reason_of
from coevolve.bus_tally import BusTally
from coevolve.cli.up import supervised_services
from coevolve.harness import EXTERNAL_ENDPOINTS, UpRun, output_dir, tally_bus
from coevolve.processes import descendant_commands
from coevolve.run_figures import pool_duplicates, service_states
from coevolve.shared.config import BusSettings
from coevolve.shared.messages import (
    GRPO_STEP_PHASE,
    DeadLetter,
    Heartbeat,
    PolicyVersion,
    RolloutGroup,
    RolloutJob,
    decode,
    derived_id,
)
from coevolve.shared.runtime.bus import Bus
from coevolve.shared.runtime.nats_server import NatsServer
from coevolve.shared.runtime.subjects import (
    DEFAULT_SERVICES,
)

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


async def watch(url: str, view: BusTally, name: str = "chaos-bench") -> None:
    """Tally the run's bus (heartbeats, groups, the learner's drops) until cancelled."""
    await tally_bus(BusSettings(url=url, connect_timeout_s=30.0), view, name=name)


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
    up: UpRun,
    view: BusTally,
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
        servers = [
            pid for pid, cmd in descendant_commands(up.process.pid) if "llama_cpp.server" in cmd
        ]
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


async def audit_bus(url: str, view: BusTally) -> dict[str, Any]:
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


def start_up(run_dir: Path, nats_url: str, log_path: Path) -> UpRun:
    """``coevolve up`` on the bench's own NATS; ``COEVOLVE_CONFIG``, when set, is its config."""
    keep = ("COEVOLVE_CONFIG", *EXTERNAL_ENDPOINTS)
    return UpRun.start(run_dir, log_path, nats_url=nats_url, keep_env=keep)


async def chaos(run_dir: Path, out_dir: Path, minutes: float, seed: int) -> dict[str, Any]:
    # outside the run directory: the stop's clean-up must not take it down before the audit
    server = NatsServer(out_dir / "nats", log_file=out_dir / "nats.log").start()
    view = BusTally()
    faults = fault_schedule(minutes, seed)
    alive_at_end: dict[str, str] = {}
    try:
        with start_up(run_dir, server.url, out_dir / "up.log") as up:
            busy_deadline = up.started + BUSY_UNTIL * minutes * 60

            async def fire(fault: Fault) -> None:
                await anyio.sleep(max(0.0, up.started + fault.at_s - time.monotonic()))
                if not up.running:
                    raise RuntimeError(f"coevolve up exited with {up.process.returncode}")
                await inject(busy_deadline, fault, up.started, run_dir, up, view, server)

            async with anyio.create_task_group() as tg:
                tg.start_soon(watch, server.url, view)
                # each fault waits for its own moment and target, so one wait delays no other
                async with anyio.create_task_group() as faulting:
                    for fault in faults:
                        faulting.start_soon(fire, fault)
                await anyio.sleep(max(0.0, up.started + minutes * 60 - time.monotonic()))
                alive_at_end = service_states(run_dir)
                tg.cancel_scope.cancel()
            bus_audit = await stop_and_audit(up, server.url, view)
    finally:
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
        "shutdown": up.stop_report(),
    }


async def stop_and_audit(up: UpRun, url: str, view: BusTally) -> dict[str, Any]:
    """Stop ``up`` (and whatever it left), then audit the bus."""
    await anyio.to_thread.run_sync(up.stop)
    return await audit_bus(url, view)


def run_audit(run_dir: Path, view: BusTally, bus_audit: dict[str, Any]) -> dict[str, Any]:
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
        **pool_duplicates(run_dir / "pool.duckdb"),
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
    """``RUN_DIR/bench/<name>-<stamp>`` and the run directory of the ``up`` under it."""
    out_dir = output_dir(name)
    return out_dir, out_dir / "run"


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
