"""What a run of ``coevolve up`` leaves to count, read once it has stopped (the pool file
read-only): the pool's tasks and verdicts, rollout groups, learner steps, policy versions,
the supervisor's view of its services and its logs. Counts between two times take Unix
seconds, as the run's files record them (:class:`coevolve.harness.UpRun` keeps its
``started_at`` and ``stopped_at``)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import duckdb

from coevolve.report.run_data import (
    LEARNER_STEPS,
    LEARNER_TENSORBOARD,
    POOL_FILE,
    policy_files,
    read_scalars,
    read_steps,
)
from coevolve.shared.messages import ORIGINS

TRAINED_TAG = "learner/trained"


@contextlib.contextmanager
def read_only(db_path: Path) -> Iterator[duckdb.DuckDBPyConnection]:
    with contextlib.closing(duckdb.connect(str(db_path), read_only=True)) as db:
        yield db


def scalar(db: duckdb.DuckDBPyConnection, sql: str, params: list[Any] | None = None) -> int:
    row = db.execute(sql, params or []).fetchone()
    return int(row[0]) if row and row[0] is not None else 0


def pool_summary(db_path: Path, top_reasons: int = 5) -> dict[str, Any]:
    """Tasks by origin (pool growth: all but the seed tasks), verdicts, the commonest
    rejection reasons, verdicts by signal kind and the share of uniform groups."""
    with read_only(db_path) as db:
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


def pool_duplicates(db_path: Path) -> dict[str, int]:
    """Rows written twice: tasks (by content), verdicts (by candidate), results (by sample)."""
    if not db_path.exists():
        return {"duplicate_tasks": 0, "duplicate_verdicts": 0, "duplicate_results": 0}
    with read_only(db_path) as db:
        return {
            "duplicate_tasks": scalar(
                db, "SELECT count(*) - count(DISTINCT content_hash) FROM tasks"
            ),
            "duplicate_verdicts": scalar(
                db, "SELECT count(*) - count(DISTINCT candidate_id) FROM verdicts"
            ),
            "duplicate_results": scalar(
                db,
                "SELECT count(*) - count(DISTINCT (group_id, sample_index)) FROM rollout_results",
            ),
        }


@dataclass(frozen=True)
class VerdictCount:
    verdicts: int
    accepted: int
    accepted_and_new: int
    first_accepted_s: float | None  # from ``started_at``


def count_verdicts(db_path: Path, started_at: float, stopped_at: float) -> VerdictCount:
    """Verdicts created between the two times."""
    if not db_path.is_file():
        return VerdictCount(0, 0, 0, None)
    with read_only(db_path) as db:
        row = db.execute(
            "SELECT count(*), count(*) FILTER (WHERE accepted), "
            "count(*) FILTER (WHERE accepted AND added), min(created_at) FILTER (WHERE accepted) "
            "FROM verdicts WHERE created_at BETWEEN ? AND ?",
            [started_at, stopped_at],
        ).fetchone()
    total, accepted, added, first = row or (0, 0, 0, None)
    first_s = None if first is None else round(float(first) - started_at, 1)
    return VerdictCount(int(total), int(accepted), int(added), first_s)


def count_rollout_groups(db_path: Path, started_at: float, stopped_at: float) -> int:
    """Rollout groups pool-store recorded between the two times."""
    if not db_path.is_file():
        return 0
    with read_only(db_path) as db:
        return scalar(
            db,
            "SELECT count(DISTINCT group_id) FROM rollout_results "
            "WHERE recorded_at BETWEEN ? AND ?",
            [started_at, stopped_at],
        )


def count_groups_trained_on(run_dir: Path, started_at: float, stopped_at: float) -> int:
    """Groups the learner's steps between the two times trained on (``steps.jsonl``)."""
    records = read_steps(run_dir / LEARNER_STEPS)
    return sum(len(r.groups) for r in records if started_at <= r.at <= stopped_at)


@dataclass(frozen=True)
class LearnerCount:
    steps: int  # trained (optimizer stepped) before the stop
    calls: int  # GrpoLearner.step calls before the stop, trained or not
    first_step_s: float | None  # from ``started_at`` to the first trained step


def count_learner_steps(
    tensorboard_dir: Path, started_at: float, stopped_at: float
) -> LearnerCount:
    """Learner steps from the ``learner/trained`` scalars (one per ``GrpoLearner.step``,
    1.0 when the optimizer stepped) written between the two times."""
    events = [
        event
        for event in read_scalars(tensorboard_dir).get(TRAINED_TAG, [])
        if started_at <= event.wall_time <= stopped_at
    ]
    trained = sorted(event.wall_time for event in events if event.value > 0)
    first = round(trained[0] - started_at, 1) if trained else None
    return LearnerCount(steps=len(trained), calls=len(events), first_step_s=first)


def policy_versions(run_dir: Path) -> list[int]:
    """Versions the learner wrote as ``RUN_DIR/policies/v<N>.safetensors``, in order."""
    return sorted(policy_files(run_dir))


def service_states(run_dir: Path) -> dict[str, str]:
    """Each supervised service's state (``running``, ``backing_off``...) right now."""
    from coevolve.up_state import supervised_services

    return {name: str(child.get("state")) for name, child in supervised_services(run_dir).items()}


def logs_mentioning(run_dir: Path, text: str) -> list[str]:
    """The services whose log (``RUN_DIR/logs/<service>.log``) contains ``text``."""
    found = []
    for log in sorted((run_dir / "logs").glob("*.log")):
        with contextlib.suppress(OSError):
            if text in log.read_text(errors="replace"):
                found.append(log.stem)
    return found


def run_figures(
    run_dir: Path, started_at: float, stopped_at: float, tensorboard: str = LEARNER_TENSORBOARD
) -> dict[str, Any]:
    """The figures every run of the system has: its pool (None before pool-store wrote
    one), its verdicts and rollout groups in the window, learner steps and policy files.
    ``tensorboard``: where under ``run_dir`` the learner's scalars are (the lockstep
    schedule writes its own)."""
    pool = run_dir / POOL_FILE
    verdicts = count_verdicts(pool, started_at, stopped_at)
    learner = count_learner_steps(run_dir / tensorboard, started_at, stopped_at)
    return {
        "pool": pool_summary(pool) if pool.is_file() else None,
        "verdicts": verdicts,
        "learner": learner,
        "rollout_groups": count_rollout_groups(pool, started_at, stopped_at),
        "groups_trained_on": count_groups_trained_on(run_dir, started_at, stopped_at),
        "policy_versions": policy_versions(run_dir),
        "logs": str(run_dir / "logs"),
    }
