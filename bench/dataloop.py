"""Data-loop benchmark: what ``coevolve up`` (async schedule) does in a fixed wall time.

Starts ``coevolve up`` exactly as a user would (``python -m coevolve up``, embedded default
configuration, a fresh run directory, a NATS server of its own on a free port, one torch
thread per service) and lets it run for 20 minutes (3 with ``--quick``; the environment
variable ``COEVOLVE_BENCH_MINUTES`` overrides both, a float, e.g. ``0.5``). The clock
starts when ``up`` is spawned, so model loading and seeding the pool count against the
run, as they would for a user.

Measured, live, from a plain core-NATS subscription to ``coevolve.>`` (it sees every
publish, JetStream or not, without taking part in any consumer):

- messages per subject family (rollout groups, policy updates, signals by kind,
  explorations, candidates, verdicts, tasks added, dead letters) and the time of each
  family's first message, in seconds since ``up`` was spawned;
- verdicts decoded with the message catalogue: accepted and rejected as they happen;
- when each service first reported ``running`` in its heartbeat.

A message re-published after a crash carries the same ``Nats-Msg-Id`` and is counted
once (the duplicates are reported). Every 60 s one progress line is printed.

At the end ``up`` gets SIGINT (it handles SIGINT and SIGTERM alike: stop every service,
then NATS), is SIGKILLed with its process group if it has not exited 60 s later, and any
process still carrying the run directory in its command line (a service or the NATS
server orphaned by a killed ``up``) is SIGKILLed too. Then the run's pool
(``RUN_DIR/pool.duckdb``, read-only) gives the outcome: tasks by origin (the pool starts
empty and is seeded by pool-store, so every explored or synthesized task was added during
the run: that is the pool growth), verdicts accepted and rejected, acceptance rate =
accepted / verdicts, the top rejection reasons, and the policy versions the learner wrote
to ``RUN_DIR/policies``.

``COEVOLVE_BENCH_SEED_EXPLORATIONS=N`` also publishes N seed-mode exploration requests
(train-split tasks, as ``coevolve explore -n N`` does) once the bus is up: a base policy
that never calls a tool raises no boundary or rare signal, so without them a short run
on a CPU may show no data-loop activity at all.

Writes ``result.json`` and ``up.log`` (``up``'s own output; each service logs under
``run/logs``) to ``RUN_DIR/bench/dataloop-<stamp>``. The run directory reuses the
de-quantized model cache of ``RUN_DIR/models`` when there is one (a symbolic link), so the
run does not spend its first minute converting the GGUF file again.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import duckdb
from anyio.abc import TaskStatus

from coevolve.bench import tables
from coevolve.cli.explore_cmd import choose_tasks
from coevolve.exploration import publish_requests
from coevolve.processes import (
    kill_leftovers,
    share_model_cache,
    spawn_up,
    stop_process_group,
    wait_for_nats_url,
)
from coevolve.shared.config import DEFAULT_RUN_DIR, BusSettings
from coevolve.shared.messages import (
    ORIGINS,
    DecodeError,
    Heartbeat,
    PolicyVersion,
    Verdict,
    decode,
)
from coevolve.shared.runtime.bus import MSG_ID_HEADER, Bus, BusError
from coevolve.shared.runtime.credentials import run_bus_settings
from coevolve.shared.runtime.nats_server import free_port
from coevolve.shared.runtime.subjects import (
    CANDIDATES,
    DEAD_LETTERS,
    EXPLORATION_REQUESTS,
    EXPLORATIONS,
    HEARTBEATS,
    METRICS,
    POLICY_UPDATES,
    PREFIX,
    ROLLOUT_GROUPS,
    ROLLOUT_JOBS,
    ROLLOUT_RESULTS,
    SIGNALS,
    TASK_ADDED,
    VERDICTS,
)

FULL_MINUTES = 20.0
QUICK_MINUTES = 3.0
MINUTES_ENV = "COEVOLVE_BENCH_MINUTES"
SEED_EXPLORATIONS_ENV = "COEVOLVE_BENCH_SEED_EXPLORATIONS"
PROGRESS_EVERY_S = 60.0
CONNECT_TIMEOUT_S = 10.0
# rollout groups are ~50 KB each; leave the subscription room for a burst
PENDING_BYTES = 512 * 1024 * 1024

EXACT_FAMILIES: dict[str, str] = {
    ROLLOUT_JOBS: "rollout_jobs",
    ROLLOUT_GROUPS: "rollout_groups",
    ROLLOUT_RESULTS: "rollout_results",
    POLICY_UPDATES: "policy_updates",
    EXPLORATION_REQUESTS: "exploration_requests",
    EXPLORATIONS: "explorations",
    CANDIDATES: "candidates",
    VERDICTS: "verdicts",
    TASK_ADDED: "tasks_added",
}
PREFIX_FAMILIES: dict[str, str] = {
    f"{SIGNALS}.": "signals",
    f"{DEAD_LETTERS}.": "dead_letters",
    f"{HEARTBEATS}.": "heartbeats",
    f"{METRICS}.": "metrics",
}
# the data loop in its order, as the table shows it
REPORTED_FAMILIES = (
    "rollout_groups",
    "policy_updates",
    "signals",
    "explorations",
    "candidates",
    "verdicts",
    "tasks_added",
    "dead_letters",
)


def bench_minutes(quick: bool, env: Mapping[str, str] = os.environ) -> float:
    """The wall time to run ``up`` for: the env override, else quick or full."""
    override = env.get(MINUTES_ENV, "").strip()
    if override:
        minutes = float(override)
        if minutes <= 0:
            raise ValueError(f"{MINUTES_ENV} must be positive, got {override!r}")
        return minutes
    return QUICK_MINUTES if quick else FULL_MINUTES


def family_of(subject: str) -> str:
    if subject in EXACT_FAMILIES:
        return EXACT_FAMILIES[subject]
    for prefix, family in PREFIX_FAMILIES.items():
        if subject.startswith(prefix):
            return family
    return "other"


@dataclass
class LoopCounter:
    """What the bus carried, by subject family, with the time of each family's first message."""

    started_at: float = field(default_factory=time.monotonic)
    counts: Counter[str] = field(default_factory=Counter)
    signals_by_kind: Counter[str] = field(default_factory=Counter)
    first_seen_s: dict[str, float] = field(default_factory=dict)
    verdicts: Counter[str] = field(default_factory=Counter)
    duplicates: int = 0
    undecodable: int = 0
    policy_version: int = 0
    services_running_s: dict[str, float] = field(default_factory=dict)
    _seen_ids: set[str] = field(default_factory=set, repr=False)

    def observe(
        self,
        subject: str,
        data: bytes,
        headers: Mapping[str, str] | None = None,
        at: float | None = None,
    ) -> None:
        elapsed = round((time.monotonic() if at is None else at) - self.started_at, 1)
        message_id = (headers or {}).get(MSG_ID_HEADER)
        if message_id is not None:
            if message_id in self._seen_ids:
                self.duplicates += 1
                return
            self._seen_ids.add(message_id)
        family = family_of(subject)
        self.counts[family] += 1
        self.first_seen_s.setdefault(family, elapsed)
        try:
            self._look_inside(family, subject, data, elapsed)
        except DecodeError:
            self.undecodable += 1

    def _look_inside(self, family: str, subject: str, data: bytes, elapsed: float) -> None:
        if family == "signals":
            kind = subject.removeprefix(f"{SIGNALS}.")
            self.signals_by_kind[kind] += 1
            self.first_seen_s.setdefault(f"signals.{kind}", elapsed)
        elif family == "verdicts":
            accepted = decode(data, Verdict).accepted
            self.verdicts["accepted" if accepted else "rejected"] += 1
            if accepted:
                self.first_seen_s.setdefault("accepted_verdict", elapsed)
        elif family == "policy_updates":
            version = decode(data, PolicyVersion).version
            self.policy_version = max(self.policy_version, version)
            # v1 is the warm start; a GRPO step makes v2 and later
            self.first_seen_s.setdefault("warm_start" if version <= 1 else "grpo_update", elapsed)
        elif family == "heartbeats":
            beat = decode(data, Heartbeat)
            if beat.phase == "running":
                self.services_running_s.setdefault(beat.service, elapsed)

    def elapsed_s(self) -> float:
        return time.monotonic() - self.started_at


def progress_line(counter: LoopCounter) -> str:
    counts = counter.counts
    kinds = ", ".join(f"{k} {n}" for k, n in sorted(counter.signals_by_kind.items()))
    return (
        f"[dataloop] {counter.elapsed_s() / 60:5.1f} min: "
        f"groups {counts['rollout_groups']}, policy v{counter.policy_version}, "
        f"signals {counts['signals']}" + (f" ({kinds})" if kinds else "") + ", "
        f"explorations {counts['explorations']}, candidates {counts['candidates']}, "
        f"verdicts {counts['verdicts']} ({counter.verdicts['accepted']} accepted), "
        f"services running {len(counter.services_running_s)}"
    )


async def watch_bus(
    settings: BusSettings,
    counter: LoopCounter,
    duration_s: float,
    *,
    should_stop: Callable[[], bool] = lambda: False,
    progress_every_s: float = PROGRESS_EVERY_S,
    connect_timeout_s: float = CONNECT_TIMEOUT_S,
    seed_explorations: int = 0,
    task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Count every ``coevolve.>`` message until ``duration_s`` after ``counter.started_at``
    or until ``should_stop()``; ``task_status`` is set once the subscription is live.
    With ``seed_explorations``, that many seed-mode exploration requests (train-split
    tasks, as ``coevolve explore`` sends them) are published once it is."""
    bus = await Bus.connect(settings, name="bench-dataloop")
    try:
        with anyio.fail_after(connect_timeout_s):
            subscription = await bus.nc.subscribe(f"{PREFIX}.>", pending_bytes_limit=PENDING_BYTES)
            await bus.nc.flush()
        if seed_explorations:
            await bus.ensure_streams()
            await publish_requests(bus, choose_tasks(seed_explorations, seed=0), rounds=1)
        task_status.started()

        async def read() -> None:
            async for message in subscription.messages:
                counter.observe(message.subject, message.data, message.headers)

        async with anyio.create_task_group() as tg:
            tg.start_soon(read)
            next_progress = progress_every_s
            while not should_stop():
                remaining = duration_s - counter.elapsed_s()
                if remaining <= 0:
                    break
                await anyio.sleep(min(1.0, remaining))
                if counter.elapsed_s() >= next_progress:
                    print(progress_line(counter), flush=True)
                    next_progress += progress_every_s
            tg.cancel_scope.cancel()
    finally:
        with anyio.move_on_after(5, shield=True):
            await bus.close(timeout=3.0)


async def until_signalled(
    work: Callable[[], Awaitable[None]],
    signals: tuple[signal.Signals, ...] = (signal.SIGINT, signal.SIGTERM),
) -> signal.Signals | None:
    """Run ``work``; on one of ``signals`` cancel it and return that signal (else None).

    Ctrl-C then ends the watch early and the caller still stops ``up`` and reports what
    was seen, instead of leaving ``up`` and its services running.
    """
    received: list[signal.Signals] = []
    async with anyio.create_task_group() as tg:

        async def watch_signals() -> None:
            with anyio.open_signal_receiver(*signals) as incoming:
                async for signum in incoming:
                    print(f"[dataloop] {signal.Signals(signum).name}: stopping early", flush=True)
                    received.append(signal.Signals(signum))
                    tg.cancel_scope.cancel()
                    return

        tg.start_soon(watch_signals)
        await work()
        tg.cancel_scope.cancel()
    return received[0] if received else None


# ---------------------------------------------------------------------- the up process


def start_up(run_dir: Path, nats_port: int, log_path: Path) -> subprocess.Popen[bytes]:
    """``coevolve up`` on embedded defaults and its own NATS."""
    env = dict(os.environ)
    for inherited in ("NATS_URL", "COEVOLVE_CONFIG", "COEVOLVE_RUN_DIR"):
        env.pop(inherited, None)
    return spawn_up(["--run-dir", str(run_dir), "--nats-port", str(nats_port)], env, log_path)


# ---------------------------------------------------------------------- the outcome


def pool_summary(db_path: Path, top_reasons: int = 5) -> dict[str, Any]:
    """Tasks by origin, verdicts and the commonest rejection reasons, read-only."""
    with contextlib.closing(duckdb.connect(str(db_path), read_only=True)) as db:
        origins = dict.fromkeys(ORIGINS, 0)
        origins.update(db.execute("SELECT origin, count(*) FROM tasks GROUP BY origin").fetchall())
        accepted, rejected, added = db.execute(
            "SELECT count(*) FILTER (WHERE accepted), count(*) FILTER (WHERE NOT accepted), "
            "count(*) FILTER (WHERE added) FROM verdicts"
        ).fetchone() or (0, 0, 0)
        reasons = db.execute(
            "SELECT reason, count(*) AS n FROM ("
            "  SELECT unnest(CAST(reasons AS VARCHAR[])) AS reason FROM verdicts"
            "  WHERE NOT accepted) GROUP BY reason ORDER BY n DESC, reason LIMIT ?",
            [top_reasons],
        ).fetchall()
        uniform = db.execute(
            "SELECT count(*), count(*) FILTER (WHERE lowest = highest) FROM ("
            "  SELECT min(score) AS lowest, max(score) AS highest FROM rollout_results"
            "  GROUP BY group_id)"
        ).fetchone() or (0, 0)
        by_kind = db.execute(
            "SELECT coalesce(signal_kind, 'none'), count(*) FILTER (WHERE accepted), count(*) "
            "FROM verdicts GROUP BY 1 ORDER BY 1"
        ).fetchall()
    verdicts = int(accepted) + int(rejected)
    groups, uniform_groups = int(uniform[0]), int(uniform[1])
    return {
        "groups": groups,
        "uniform_group_share": round(uniform_groups / groups, 3) if groups else None,
        "tasks_by_origin": {k: int(v) for k, v in origins.items()},
        "growth": sum(int(v) for k, v in origins.items() if k != "seed"),
        "verdicts": {
            "accepted": int(accepted),
            "rejected": int(rejected),
            "accepted_and_new": int(added),
        },
        "acceptance_rate": round(int(accepted) / verdicts, 3) if verdicts else None,
        "top_rejection_reasons": [[str(reason), int(n)] for reason, n in reasons],
        "verdicts_by_signal_kind": {
            str(kind): {"accepted": int(ok), "verdicts": int(n)} for kind, ok, n in by_kind
        },
    }


def policy_versions(run_dir: Path) -> list[int]:
    """Versions the learner wrote as ``RUN_DIR/policies/v<N>.safetensors``."""
    versions = []
    for file in (run_dir / "policies").glob("v*.safetensors"):
        number = file.stem.removeprefix("v")
        if number.isdigit():
            versions.append(int(number))
    return sorted(versions)


def bench_directory(base_run_dir: Path) -> Path:
    path = base_run_dir / "bench" / f"dataloop-{time.strftime('%Y%m%d-%H%M%S')}"
    path.mkdir(parents=True, exist_ok=True)
    return path


def summarize(
    counter: LoopCounter,
    pool: dict[str, Any] | None,
    versions: list[int],
    minutes: float,
) -> dict[str, Any]:
    """The result fields that come from the bus, the pool and the policy files."""
    live = {"accepted": counter.verdicts["accepted"], "rejected": counter.verdicts["rejected"]}
    live_total = live["accepted"] + live["rejected"]
    pool = pool or {}
    origins = pool.get("tasks_by_origin", {})
    rate = pool.get("acceptance_rate")
    if rate is None and live_total:
        rate = round(live["accepted"] / live_total, 3)
    first = counter.first_seen_s
    return {
        "minutes": minutes,
        "first_warm_start_s": first.get("warm_start"),
        "first_policy_update_s": first.get("grpo_update"),
        "first_signal_s": first.get("signals"),
        "first_exploration_s": first.get("explorations"),
        "first_candidate_s": first.get("candidates"),
        "first_accepted_s": first.get("accepted_verdict"),
        "uniform_group_share": pool.get("uniform_group_share"),
        "counts": {family: counter.counts[family] for family in REPORTED_FAMILIES},
        "other_counts": {
            k: v for k, v in sorted(counter.counts.items()) if k not in REPORTED_FAMILIES
        },
        "signals_by_kind": dict(sorted(counter.signals_by_kind.items())),
        "first_seen_s": dict(sorted(counter.first_seen_s.items(), key=lambda kv: kv[1])),
        "services_running_s": dict(sorted(counter.services_running_s.items())),
        "duplicates": counter.duplicates,
        "undecodable": counter.undecodable,
        "verdicts": {
            "live": live,
            "pool": pool.get("verdicts"),
            "top_rejection_reasons": pool.get("top_rejection_reasons", []),
            "by_signal_kind": pool.get("verdicts_by_signal_kind", {}),
        },
        "acceptance_rate": rate,
        "pool": {
            "seed": origins.get("seed"),
            "explored": origins.get("explored"),
            "synthesized": origins.get("synthesized"),
            "growth": pool.get("growth"),
        },
        "policy": {
            "announced_version": counter.policy_version,
            "files": len(versions),
            "latest_file_version": versions[-1] if versions else 0,
        },
    }


# ---------------------------------------------------------------------- the benchmark


def run(
    quick: bool, base_run_dir: Path | None = None, minutes: float | None = None
) -> dict[str, Any]:
    minutes = minutes if minutes is not None else bench_minutes(quick)
    if minutes <= 0:
        raise ValueError(f"--minutes must be positive, got {minutes}")
    seeds = int(os.environ.get(SEED_EXPLORATIONS_ENV) or 0)
    base = base_run_dir or Path(os.environ.get("COEVOLVE_RUN_DIR") or DEFAULT_RUN_DIR)
    out = bench_directory(base).resolve()
    run_dir = out / "run"
    log_path = out / "up.log"
    shared_models = share_model_cache(run_dir, base)
    print(f"[dataloop] coevolve up (async) for {minutes:g} min; run directory {run_dir}")
    counter = LoopCounter()
    process = start_up(run_dir, free_port(), log_path)
    error: str | None = None
    interrupted = False
    try:
        url = wait_for_nats_url(run_dir, process)
        watch = functools.partial(
            watch_bus,
            run_bus_settings(run_dir, url),
            counter,
            minutes * 60,
            should_stop=lambda: process.poll() is not None,
            seed_explorations=seeds,
        )
        interrupted = anyio.run(until_signalled, watch) is not None
    except (RuntimeError, TimeoutError, BusError) as exc:
        error = str(exc)
    finally:
        exited_early = process.poll() is not None
        shutdown = stop_process_group(process)
        leftovers = kill_leftovers(str(run_dir))
    pool_file = run_dir / "pool.duckdb"
    pool = pool_summary(pool_file) if pool_file.is_file() else None
    result: dict[str, Any] = {
        "benchmark": "dataloop",
        "quick": quick,
        "schedule": "async",
        "duration_s": round(minutes * 60, 1),
        "observed_s": round(counter.elapsed_s(), 1),
        "cpu_count": os.cpu_count(),
        "omp_num_threads": 1,
        "shared_model_cache": shared_models,
        "seed_explorations": seeds,
        **summarize(counter, pool, policy_versions(run_dir), minutes),
        "interrupted": interrupted,
        "up": {
            "exited_early": exited_early,
            "error": error,
            "graceful_stop": shutdown.graceful,
            "returncode": shutdown.returncode,
            "stop_s": shutdown.seconds,
            "leftover_pids_killed": leftovers,
        },
        "log": str(log_path),
        "service_logs": str(run_dir / "logs"),
        "run_dir": str(run_dir),
        "bench_dir": str(out),
    }
    (out / "result.json").write_text(json.dumps(result, indent=2))
    print_table(result)
    return result


def print_table(result: dict[str, Any]) -> None:
    first = result["first_seen_s"]

    def seconds(seen: float | None) -> str | None:
        return None if seen is None else f"{seen:.0f}"

    families = []
    for family, count in result["counts"].items():
        families.append((family, count, seconds(first.get(family))))
        if family == "signals":
            families += [
                (f"  {kind}", n, seconds(first.get(f"signals.{kind}")))
                for kind, n in result["signals_by_kind"].items()
            ]
    tables.print_table(
        f"coevolve up --schedule async, {result['minutes']:g} min, {result['cpu_count']} CPUs",
        ("family", "messages", "first at (s)"),
        families,
    )
    share = result["uniform_group_share"]
    tables.print_table(
        None,
        ("milestone", "at (s)"),
        [
            (label, seconds(result[key]))
            for label, key in (
                ("warm start done (v1)", "first_warm_start_s"),
                ("first GRPO update", "first_policy_update_s"),
                ("first signal", "first_signal_s"),
                ("first candidate", "first_candidate_s"),
                ("first accepted task", "first_accepted_s"),
            )
        ],
        note=f"uniform groups (equal rewards): {'n/a' if share is None else f'{share:.3f}'}",
    )
    verdicts = result["verdicts"]
    pool_verdicts = verdicts["pool"] or verdicts["live"]
    rate = result["acceptance_rate"]
    pool = result["pool"]
    policy = result["policy"]
    up = result["up"]
    stopped = "gracefully" if up["graceful_stop"] else "by SIGKILL"
    lines = [
        f"pool: seed {pool['seed']}, explored {pool['explored']}, "
        f"synthesized {pool['synthesized']}; growth +{pool['growth']}",
        f"policy: v{policy['announced_version']} announced, {policy['files']} weight files",
        f"up stopped {stopped} in {up['stop_s']} s (exit {up['returncode']})",
        *([f"error: {up['error']}"] if up["error"] else []),
        f"log: {result['log']}; result: {result['bench_dir']}/result.json",
    ]
    tables.print_table(
        f"verdicts: {pool_verdicts['accepted']} accepted, {pool_verdicts['rejected']} rejected; "
        f"acceptance rate {'n/a' if rate is None else f'{rate:.3f}'}",
        ("top rejection reasons", "verdicts"),
        [(reason[:100], n) for reason, n in verdicts["top_rejection_reasons"]],
        note="\n".join(lines),
    )


if __name__ == "__main__":
    print(json.dumps(run(quick="--quick" in sys.argv), indent=2))
