"""Data-loop benchmark: what ``coevolve up`` (async schedule) does in a fixed wall time.

``coevolve up`` runs on the harness (``coevolve.harness``) as a user starts it: embedded
defaults, a fresh run directory, a NATS server of its own, one torch thread per service,
for 20 minutes (3 with ``--quick``; ``--minutes`` or ``COEVOLVE_BENCH_MINUTES`` override),
counted from its spawn, so model loading and seeding count as they would for a user.
Measured live from a core-NATS subscription to ``coevolve.>`` (a ``BusTally``): messages
per subject family and each family's first time, signals by kind, verdicts accepted and
rejected, when each service first reported ``running``; a progress line every 60 s. Once
``up`` is stopped, its pool (read-only) gives the outcome: tasks by origin (the growth),
verdicts, acceptance rate, the top rejection reasons, and the policy versions written.

``COEVOLVE_BENCH_SEED_EXPLORATIONS=N`` also publishes N seed-mode exploration requests
(train-split tasks, as ``coevolve explore -n N`` does) once the bus is up: a base policy
that never calls a tool raises no signal, so a short run on a CPU may otherwise show no
data-loop activity. Writes ``result.json`` and ``up.log`` to
``RUN_DIR/bench/dataloop-<stamp>`` (each service logs under ``run/logs``).
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import anyio
from anyio.abc import TaskStatus

from coevolve.bench import tables
from coevolve.bus_tally import BusTally
from coevolve.cli.explore_cmd import choose_tasks
from coevolve.exploration import publish_requests
from coevolve.harness import EXTERNAL_ENDPOINTS, UpRun, output_dir, tally_bus, until_signalled
from coevolve.run_figures import policy_versions, pool_summary
from coevolve.shared.config import BusSettings
from coevolve.shared.runtime.bus import BusError

FULL_MINUTES = 20.0
QUICK_MINUTES = 3.0
MINUTES_ENV = "COEVOLVE_BENCH_MINUTES"
SEED_EXPLORATIONS_ENV = "COEVOLVE_BENCH_SEED_EXPLORATIONS"
PROGRESS_EVERY_S = 60.0

# the data loop's milestones: label, result key, the tally's first-seen name
MILESTONES = (
    ("warm start done (v1)", "first_warm_start_s", "warm_start"),
    ("first GRPO update", "first_policy_update_s", "grpo_update"),
    ("first signal", "first_signal_s", "signals"),
    ("first exploration", "first_exploration_s", "explorations"),
    ("first candidate", "first_candidate_s", "candidates"),
    ("first accepted task", "first_accepted_s", "accepted_verdict"),
)
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


def progress_line(counter: BusTally) -> str:
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


async def watch_loop(
    settings: BusSettings,
    counter: BusTally,
    duration_s: float,
    *,
    should_stop: Callable[[], bool] = lambda: False,
    progress_every_s: float = PROGRESS_EVERY_S,
    seed_explorations: int = 0,
    task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Count every ``coevolve.>`` message until ``duration_s`` after ``counter.started_at``
    or until ``should_stop()``; ``task_status`` is set once the subscription is live.
    With ``seed_explorations``, that many seed-mode exploration requests (train-split
    tasks, as ``coevolve explore`` sends them) are published once it is."""
    async with anyio.create_task_group() as tg:
        bus = await tg.start(functools.partial(tally_bus, name="bench-dataloop"), settings, counter)
        if seed_explorations:
            await bus.ensure_streams()
            await publish_requests(bus, choose_tasks(seed_explorations, seed=0), rounds=1)
        task_status.started()
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


def summarize(
    counter: BusTally,
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
        **{key: first.get(seen) for _, key, seen in MILESTONES},
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
    out = output_dir("dataloop", base_run_dir)
    run_dir = out / "run"
    print(f"[dataloop] coevolve up (async) for {minutes:g} min; run directory {run_dir}")
    error: str | None = None
    interrupted = False
    # an LLM endpoint or credentials the caller's shell names are the run's too
    with UpRun.start(run_dir, out / "up.log", keep_env=EXTERNAL_ENDPOINTS, base=base_run_dir) as up:
        counter = BusTally(started_at=up.started)
        try:
            watch = functools.partial(
                watch_loop,
                up.bus_settings(),
                counter,
                minutes * 60,
                should_stop=lambda: not up.running,
                seed_explorations=seeds,
            )
            received = anyio.run(functools.partial(until_signalled, watch, prefix="dataloop"))
            interrupted = received is not None
        except (RuntimeError, TimeoutError, BusError) as exc:
            error = str(exc)
        stopped = up.stop()
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
        "shared_model_cache": up.shared_models,
        "seed_explorations": seeds,
        **summarize(counter, pool, policy_versions(run_dir), minutes),
        "interrupted": interrupted,
        "up": {
            "exited_early": stopped.exited_early,
            "error": error,
            "graceful_stop": stopped.graceful,
            "returncode": stopped.returncode,
            "stop_s": stopped.stop_s,
            "leftover_pids_killed": stopped.killed,
        },
        "log": str(up.log_path),
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
        [(label, seconds(result[key])) for label, key, _ in MILESTONES],
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
