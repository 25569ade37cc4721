"""Fault benchmarks: ``coevolve up`` on a NATS of the bench's own, struck by faults while
it runs, then stopped and audited. ``up`` runs on the defaults, or on the file
``COEVOLVE_CONFIG`` names.

- ``chaos`` (:func:`run_chaos`): at a random moment of the run (seeded, in its middle 60%),
  each of these happens once: ``kill -9`` of every service's process group, each waiting
  (until ``BUSY_UNTIL`` of the run at most) for the service to be busy (the learner in a
  GRPO step, the others with ``in_flight > 0``); NATS stopped for ``NATS_DOWN_S`` and
  restarted on the same port and store; the LLM endpoint (a ``llama_cpp.server`` under
  ``up``) killed. Also reported: ``learner_resumed_from_checkpoint``.
- ``failover`` (:func:`run_failover`): a 3-node JetStream cluster (streams and buckets with
  3 copies, through ``COEVOLVE_NATS_REPLICAS``). Once groups flow, the node leading the
  rollout-groups stream is killed (``failover_s``: until a new group is published) and
  restarted ``RESTART_AFTER_S`` later; at ``QUORUM_AT`` of the run the leader and a second
  node are killed together, so the streams take no writes and the services must say so
  (``quorum_loss_reported_by``); both come back after ``QUORUM_DOWN_S`` (``recovered_s``:
  until groups flow again).

The audit (:func:`audit_bus`, :func:`run_audit`): ``groups_lost`` (published, yet neither
consumed by a learner step, which trains a group or counts it as dropped for staleness,
nor still waiting in the stream, nor to be made again by its job, still queued:
``groups_requeued``), ``duplicate_tasks`` / ``duplicate_verdicts`` / ``duplicate_results``
in DuckDB, ``versions_non_monotonic`` (announced versions not strictly increasing, or a
digest announced twice), ``services_alive_at_end`` (the supervisor's view just before the
stop) and the dead letters by reason. Writes ``result.json`` and ``up.log`` under
``RUN_DIR/bench/<chaos|failover>-<stamp>``.
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
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import anyio

from coevolve.bench import tables
from coevolve.bench.flood import reason_of
from coevolve.bus_tally import BusTally
from coevolve.harness import (
    EXTERNAL_ENDPOINTS,
    UpRun,
    output_dir,
    stream_messages,
    tally_bus,
    wait_for,
)
from coevolve.processes import descendant_commands
from coevolve.run_figures import logs_mentioning, pool_duplicates, service_states
from coevolve.shared.config import REPLICAS_ENV, BusSettings
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
from coevolve.shared.runtime.nats_server import NatsCluster, NatsServer
from coevolve.shared.runtime.subjects import DEFAULT_SERVICES, ROLLOUT_GROUPS, stream_for
from coevolve.up_state import supervised_services

BUSY_UNTIL = 0.9  # a fault waits for its target to be busy until this share of the run
NATS_DOWN_S = 5.0
LEARNER_CHECKPOINT_GROUPS = Path("checkpoints/learner.groups.json")
NODES = 3
RESTART_AFTER_S = 20.0
QUORUM_AT = 0.6
QUORUM_DOWN_S = 30.0
GROUPS_WAIT_S = 600.0  # the warm start comes first: groups flow after a few minutes
QUORUM_TEXT = "lost quorum"


# --------------------------------------------------------------------------- the run


def start_up(run_dir: Path, nats_url: str, log_path: Path) -> UpRun:
    """``coevolve up`` on the bench's own NATS; ``COEVOLVE_CONFIG``, when set, is its config."""
    keep = ("COEVOLVE_CONFIG", *EXTERNAL_ENDPOINTS)
    return UpRun.start(run_dir, log_path, nats_url=nats_url, keep_env=keep)


Strike = Callable[[UpRun, BusTally], Awaitable[object]]


async def under_faults(
    url: str, run_dir: Path, out_dir: Path, minutes: float, strike: Strike, name: str
) -> dict[str, Any]:
    """``up`` on the NATS at ``url`` for ``minutes`` from its spawn while ``strike`` runs
    its faults, its bus tallied; then stopped and audited."""
    view = BusTally()
    with start_up(run_dir, url, out_dir / "up.log") as up:
        async with anyio.create_task_group() as tg:
            tg.start_soon(tally_bus, BusSettings(url=url, connect_timeout_s=30.0), view, name=name)
            await strike(up, view)
            await anyio.sleep(max(0.0, up.started + minutes * 60 - time.monotonic()))
            alive_at_end = service_states(run_dir)
            tg.cancel_scope.cancel()
        await anyio.to_thread.run_sync(up.stop)
        bus_audit = await audit_bus(url, view)
    return {
        **run_audit(run_dir, view, bus_audit),
        "services_alive_at_end": alive_at_end,
        "shutdown": up.stop_report(),
    }


AUDIT_KEYS = (
    "groups_published",
    "groups_trained",
    "groups_dropped_stale",
    "groups_requeued",
    "groups_lost",
    "duplicate_tasks",
    "duplicate_verdicts",
    "duplicate_results",
    "versions_non_monotonic",
)


def print_audit(result: dict[str, Any], first: tuple[str, ...]) -> None:
    """The audit's table, after the benchmark's own ``first`` figures."""
    tables.print_table(
        None,
        ("audit", "value"),
        [(key, result[key]) for key in (*first, *AUDIT_KEYS)],
        note=f"services at the end: {result['services_alive_at_end']}\n"
        f"dead letters by reason: {result['dead_letters_by_reason']}",
        left=(0, 1),
    )


def finished(quick: bool, out_dir: Path, result: dict[str, Any]) -> dict[str, Any]:
    """The result with ``quick`` and the bench directory, written to ``result.json``."""
    result.update(quick=quick, run_dir=str(out_dir))
    (out_dir / "result.json").write_text(json.dumps(result, indent=2))
    return result


# --------------------------------------------------------------------------- chaos


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


async def chaos(run_dir: Path, out_dir: Path, minutes: float, seed: int) -> dict[str, Any]:
    # outside the run directory: the stop's clean-up must not take it down before the audit
    server = NatsServer(out_dir / "nats", log_file=out_dir / "nats.log").start()
    faults = fault_schedule(minutes, seed)

    async def strike(up: UpRun, view: BusTally) -> None:
        busy_deadline = up.started + BUSY_UNTIL * minutes * 60

        async def fire(fault: Fault) -> None:
            await anyio.sleep(max(0.0, up.started + fault.at_s - time.monotonic()))
            if not up.running:
                raise RuntimeError(f"coevolve up exited with {up.process.returncode}")
            await inject(busy_deadline, fault, up.started, run_dir, up, view, server)

        # each fault waits for its own moment and target, so one wait delays no other
        async with anyio.create_task_group() as faulting:
            for fault in faults:
                faulting.start_soon(fire, fault)

    try:
        audit = await under_faults(server.url, run_dir, out_dir, minutes, strike, "chaos-bench")
    finally:
        server.stop()
    return {
        "benchmark": "chaos",
        "minutes": minutes,
        "seed": seed,
        "fault_schedule": [asdict(f) for f in faults],
        **audit,
        "learner_resumed_from_checkpoint": bool(learner_resumes(run_dir)),
        "learner_resumed_in": learner_resumes(run_dir),
    }


def run_chaos(quick: bool = False, minutes: float | None = None, seed: int = 13) -> dict[str, Any]:
    minutes = minutes if minutes is not None else (4.0 if quick else 30.0)
    out_dir = output_dir("chaos")
    result = finished(quick, out_dir, anyio.run(chaos, out_dir / "run", out_dir, minutes, seed))
    print_chaos(result, out_dir)
    return result


def print_chaos(result: dict[str, Any], out_dir: Path) -> None:
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
    print_audit(result, ("learner_resumed_from_checkpoint",))


# --------------------------------------------------------------------------- failover


@dataclass
class NodeFault:
    kind: str
    nodes: list[str]
    at_s: float
    restarted_at_s: float | None = None
    groups_flowing_again_s: float | None = None


async def stream_leader(url: str) -> str:
    bus = await Bus.connect(BusSettings(url=url, connect_timeout_s=30.0), "failover-bench")
    try:
        with anyio.fail_after(30):
            while True:
                with contextlib.suppress(Exception):
                    info = await bus.js.stream_info(stream_for(ROLLOUT_GROUPS).name)
                    if info.cluster is not None and info.cluster.leader:
                        return str(info.cluster.leader)
                await anyio.sleep(0.5)
    finally:
        await bus.close()


def kill_node(node: NatsServer) -> None:
    if node.process is not None and node.process.poll() is None:
        os.kill(node.process.pid, signal.SIGKILL)
        node.process.wait(5)


async def until_groups_grow(view: BusTally, timeout_s: float) -> float | None:
    """Seconds until a group not seen before is published (None: not within the time)."""
    seen = len(view.groups)
    return await wait_for(lambda: len(view.groups) > seen, timeout_s)


async def lose_leader(cluster: NatsCluster, view: BusTally, at: Callable[[], float]) -> NodeFault:
    """Kill the rollout-groups stream's leader; restart it ``RESTART_AFTER_S`` later."""
    leader = cluster.node(await stream_leader(cluster.url))
    assert leader.cluster is not None
    fault = NodeFault("leader killed", [leader.cluster.node], at())
    kill_node(leader)
    fault.groups_flowing_again_s = await until_groups_grow(view, 300)
    await anyio.sleep(max(0.0, fault.at_s + RESTART_AFTER_S - at()))
    await anyio.to_thread.run_sync(leader.start)
    fault.restarted_at_s = at()
    return fault


async def lose_quorum(cluster: NatsCluster, view: BusTally, at: Callable[[], float]) -> NodeFault:
    """Kill the leader and a second node together, restart both ``QUORUM_DOWN_S`` later."""
    first = cluster.node(await stream_leader(cluster.url))
    second = next(n for n in cluster.nodes if n is not first)
    names = [n.cluster.node for n in (first, second) if n.cluster is not None]
    fault = NodeFault("quorum lost", names, at())
    kill_node(first)
    kill_node(second)
    await anyio.sleep(QUORUM_DOWN_S)
    for node in (first, second):
        await anyio.to_thread.run_sync(node.start)
    fault.restarted_at_s = at()
    fault.groups_flowing_again_s = await until_groups_grow(view, 300)
    return fault


async def failover(run_dir: Path, out_dir: Path, minutes: float) -> dict[str, Any]:
    cluster = NatsCluster(out_dir / "nats", NODES, log_dir=out_dir / "nats-logs")
    await anyio.to_thread.run_sync(cluster.start)
    faults: list[NodeFault] = []

    async def strike(up: UpRun, view: BusTally) -> None:
        def at() -> float:
            return round(up.elapsed_s(), 1)

        if await wait_for(lambda: bool(view.groups), GROUPS_WAIT_S, 1.0) is not None:
            faults.append(await lose_leader(cluster, view, at))
            await anyio.sleep(max(0.0, QUORUM_AT * minutes * 60 - at()))
            faults.append(await lose_quorum(cluster, view, at))

    os.environ[REPLICAS_ENV] = str(NODES)  # up and its services keep 3 copies
    try:
        audit = await under_faults(cluster.url, run_dir, out_dir, minutes, strike, "failover-bench")
    finally:
        os.environ.pop(REPLICAS_ENV, None)
        cluster.stop()
    first_fault = faults[0] if faults else None
    return {
        "benchmark": "failover",
        "minutes": minutes,
        "nodes": NODES,
        "faults": [asdict(f) for f in faults],
        "failover_s": first_fault.groups_flowing_again_s if first_fault else None,
        "quorum_loss_reported_by": logs_mentioning(run_dir, QUORUM_TEXT),
        "recovered_s": faults[1].groups_flowing_again_s if len(faults) > 1 else None,
        **audit,
    }


def run_failover(quick: bool = False, minutes: float | None = None) -> dict[str, Any]:
    minutes = minutes if minutes is not None else (8.0 if quick else 20.0)
    out_dir = output_dir("failover")
    result = finished(quick, out_dir, anyio.run(failover, out_dir / "run", out_dir, minutes))
    print_failover(result)
    return result


def print_failover(result: dict[str, Any]) -> None:
    tables.print_table(
        f"failover benchmark: {result['minutes']} min on {result['nodes']} nodes",
        ("at (s)", "fault", "restarted at (s)", "groups again after (s)"),
        [
            (
                f"{fault['at_s']:.1f}",
                f"{fault['kind']} ({', '.join(fault['nodes'])})",
                fault["restarted_at_s"],
                fault["groups_flowing_again_s"],
            )
            for fault in result["faults"]
        ],
        left=(1,),
    )
    print_audit(result, ("failover_s", "recovered_s", "quorum_loss_reported_by"))


# --------------------------------------------------------------------------- audit


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
