"""Everything a report shows about one run, read from its directory and nothing else.

Sources, each optional (a missing one leaves its part empty):

- ``pool.duckdb``: tasks (origin, created_at), verdicts (accepted, reasons, signal kind)
  and rollout results (scores, policy versions). A file still held by a running
  pool-store is copied (with its WAL) to a temporary directory and read there.
- ``tensorboard/learner``: the learner's ``learner/<name>`` scalars; and the evaluator's
  ``eval/<name>`` scalars (step: the policy version evaluated) from any directory under
  ``tensorboard/``.
- ``traces/*.jsonl``: finished spans; their durations per service give the time per
  stage, and the explorer's spans for ``coevolve.signals.<kind>`` give signals over time
  (the signals stream is a work queue, so its messages are gone once handled); a span's
  ``coevolve.outcome`` attribute says what became of its work (the distiller's advice:
  kept, or why not).
- ``signal_monitor/state.json``: signals emitted and suppressed per kind, in total, and
  which tasks raised a signal of which kind (its rate-limit record, ``last_signal_at``).
- ``learner/steps.jsonl``: one line per GRPO step, the groups it trained on and those it
  dropped as stale (``services/learner/handler.py``, ``step_record``).
- ``policies/v<N>.safetensors``, ``up.json`` (when ``up`` started) and ``logs/*.log``.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import tempfile
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import duckdb

from coevolve.services.distiller.config import OUTCOME_ATTRIBUTE

POOL_FILE = "pool.duckdb"
TENSORBOARD = "tensorboard"
LEARNER_TENSORBOARD = f"{TENSORBOARD}/learner"
EVAL_PREFIX = "eval/"
SIGNAL_STATE = "signal_monitor/state.json"
SIGNAL_SUBJECT_PREFIX = "coevolve.signals."
LEARNER_STEPS = "learner/steps.jsonl"


@dataclass(frozen=True)
class Scalar:
    wall_time: float
    step: int
    value: float


@dataclass(frozen=True)
class TaskRow:
    # when the task joined the pool: the time of the verdict that added it (a seed task: 0)
    added_at: float
    origin: str
    task_id: str = ""
    # from its lineage: the task whose rollout raised the signal, the signal's kind and
    # the synthesis generation (a seed task: None, None, 0)
    parent_task_id: str | None = None
    signal_kind: str | None = None
    depth: int = 0
    # the policy version whose rollout raised the signal (a child of a signal, when known)
    signal_version: int | None = None
    # a labelled turn the experiment's labelled_control arm added during the run (its
    # added_at: when it joined)
    labelled_control: bool = False

    @property
    def from_start(self) -> bool:
        """In the pool before the run's data loop added anything: a seed task, or a task
        no verdict of this run added (a committed D0 task of the no-label setting); not a
        labelled-control turn, which joined during the run."""
        if self.labelled_control:
            return False
        return self.origin == "seed" or self.added_at == 0


@dataclass(frozen=True)
class VerdictRow:
    created_at: float
    accepted: bool
    reasons: list[str]
    signal_kind: str | None
    origin: str
    parent_task_id: str | None = None


@dataclass(frozen=True)
class GroupRow:
    """One recorded rollout group: when, at which policy version (its newest
    trajectory's), its score range, its task, its scores (in sample order), its id (the
    learner's steps name it) and its oldest trajectory's policy version."""

    recorded_at: float
    policy_version: int
    mean_score: float
    uniform: bool
    task_id: str = ""
    scores: tuple[float, ...] = ()
    group_id: str = ""
    lowest_version: int | None = None

    @property
    def first_version(self) -> int:
        """The lowest policy version among the group's trajectories."""
        return self.policy_version if self.lowest_version is None else self.lowest_version


@dataclass(frozen=True)
class ExperienceRow:
    """One experience the distiller drew (self-navigating), and how many rollout jobs
    carried it."""

    created_at: float
    experience_id: str
    task_id: str
    text: str
    retrieved: int


@dataclass(frozen=True)
class StepGroup:
    """A group as a learner step record names it (``learner/steps.jsonl``)."""

    group_id: str
    task_id: str
    origin: str
    policy_version: int
    uniform: bool
    # step credit (rollout.step_credit): the attributor's seconds, its labelled
    # trajectories and steps labelled GOOD / BAD; navigation: navigated trajectories
    label_s: float = 0.0
    labelled: int = 0
    good: int = 0
    bad: int = 0
    navigated: int = 0
    # the policy that rolled it, and (the failure agent's groups) its rewards
    agent: str = "target"
    rewards: tuple[float, ...] = ()


@dataclass(frozen=True)
class StepRecord:
    """One GRPO step: the version after it, whether it updated (and so published) the
    weights, the groups it trained on and those it dropped as stale."""

    step: int
    version: int
    published: bool
    at: float
    groups: tuple[StepGroup, ...]
    stale: tuple[StepGroup, ...]


@dataclass(frozen=True)
class SpanRow:
    service: str
    name: str
    start_s: float
    seconds: float
    # its OUTCOME_ATTRIBUTE, where the service set one
    outcome: str | None = None


@dataclass
class RunData:
    run_dir: Path
    started_at: float | None = None
    pool_error: str | None = None
    tasks: list[TaskRow] = field(default_factory=list)
    verdicts: list[VerdictRow] = field(default_factory=list)
    groups: list[GroupRow] = field(default_factory=list)
    experiences: list[ExperienceRow] = field(default_factory=list)
    scalars: dict[str, list[Scalar]] = field(default_factory=dict)
    spans: list[SpanRow] = field(default_factory=list)
    signal_totals: dict[str, int] = field(default_factory=dict)
    signals_suppressed: dict[str, int] = field(default_factory=dict)
    # kind -> the tasks that raised a signal of that kind; None: the monitor's state does
    # not say (no state file, or one from before it recorded them)
    signal_tasks: dict[str, set[str]] | None = None
    steps: list[StepRecord] = field(default_factory=list)
    policy_files: dict[int, float] = field(default_factory=dict)
    log_problems: dict[str, LogProblems] = field(default_factory=dict)

    # ------------------------------------------------------------------ derived

    @property
    def origin(self) -> float:
        """Time zero of the plots: when ``up`` started, else the earliest event seen."""
        if self.started_at is not None:
            return self.started_at
        times = [t.added_at for t in self.tasks if t.added_at > 0]
        times += [v.created_at for v in self.verdicts]
        times += [g.recorded_at for g in self.groups]
        times += [s.start_s for s in self.spans]
        times += [points[0].wall_time for points in self.scalars.values() if points]
        times += list(self.policy_files.values())
        return min(times) if times else 0.0

    def minutes(self, at: float) -> float:
        return max(0.0, (at - self.origin) / 60.0)

    def signal_events(self) -> list[tuple[float, str]]:
        """(time, kind) of each signal the explorer received, oldest first."""
        events = [
            (span.start_s, span.name.rsplit(SIGNAL_SUBJECT_PREFIX, 1)[1])
            for span in self.spans
            if span.service == "explorer" and SIGNAL_SUBJECT_PREFIX in span.name
        ]
        return sorted(events)

    def signals_by_kind(self) -> dict[str, int]:
        """Emitted per kind: the monitor's own totals, else what the explorer received."""
        if self.signal_totals:
            return dict(self.signal_totals)
        return dict(Counter(kind for _, kind in self.signal_events()))

    def policy_versions(self) -> list[int]:
        return sorted(self.policy_files)

    def learner_steps(self) -> int:
        points = self.scalars.get("learner/groups", [])
        return max((p.step for p in points), default=0)

    def duration_s(self) -> float:
        """From time zero to the last event seen."""
        times = [t.added_at for t in self.tasks if t.added_at > 0]
        times += [v.created_at for v in self.verdicts]
        times += [g.recorded_at for g in self.groups]
        times += [s.start_s + s.seconds for s in self.spans]
        times += [p.wall_time for points in self.scalars.values() for p in points]
        times += list(self.policy_files.values())
        return max(0.0, max(times, default=self.origin) - self.origin)


# ---------------------------------------------------------------------- loading


def load_run(run_dir: Path) -> RunData:
    """Read every source there is under ``run_dir``; missing ones stay empty."""
    data = RunData(run_dir=run_dir, started_at=_up_started_at(run_dir))
    load_pool(data)
    data.scalars = read_scalars(run_dir / LEARNER_TENSORBOARD)
    data.scalars.update(read_eval_scalars(run_dir / TENSORBOARD, data.scalars))
    data.spans = read_spans(run_dir / "traces")
    data.signal_totals, data.signals_suppressed, data.signal_tasks = _signal_state(
        run_dir / SIGNAL_STATE
    )
    data.steps = read_steps(run_dir / LEARNER_STEPS)
    data.policy_files = policy_files(run_dir)
    data.log_problems = log_problems(run_dir / "logs")
    return data


def _up_started_at(run_dir: Path) -> float | None:
    with contextlib.suppress(OSError, ValueError, TypeError, KeyError):
        return float(json.loads((run_dir / "up.json").read_text())["at"])
    return None


@contextlib.contextmanager
def readable_pool(
    path: Path, *, copy_when_locked: bool = True
) -> Iterator[duckdb.DuckDBPyConnection]:
    """A read-only connection to ``path``; to a copy of it when a writer holds its lock
    (unless ``copy_when_locked`` is False: then the lock's error is raised)."""
    with contextlib.ExitStack() as stack:
        try:
            connection = duckdb.connect(str(path), read_only=True)
        except duckdb.Error:
            if not copy_when_locked:
                raise
            connection = duckdb.connect(str(pool_copy(path, stack)), read_only=True)
        stack.callback(connection.close)
        yield connection


def pool_copy(path: Path, stack: contextlib.ExitStack) -> Path:
    """A copy of the pool file ``path`` (with its WAL) in a temporary directory that
    ``stack`` removes."""
    scratch = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="coevolve-")))
    copy = scratch / path.name
    shutil.copy2(path, copy)
    wal = path.with_name(path.name + ".wal")
    if wal.exists():
        shutil.copy2(wal, copy.with_name(copy.name + ".wal"))
    return copy


def load_pool(data: RunData, *, copy_when_locked: bool = True) -> None:
    """Fill ``data``'s pool parts from ``RUN_DIR/pool.duckdb``; ``pool_error`` says why
    not (``copy_when_locked`` False: a file a running pool-store holds is left alone)."""
    path = data.run_dir / POOL_FILE
    if not path.exists():
        data.pool_error = f"no {POOL_FILE}"
        return
    try:
        with readable_pool(path, copy_when_locked=copy_when_locked) as db:
            # one clock for every pool event: the judge's verdict time (a task's own
            # created_at is when the abstractor drafted it, before any verdict); a task
            # no verdict added (a seed, a D0 task drafted days before the run) is there
            # from the start: 0; a labelled-control turn joined at its created_at
            data.tasks = [
                TaskRow(float(at), str(origin), str(task_id), *_lineage_fields(lineage))
                for at, origin, task_id, lineage in db.execute(
                    "SELECT coalesce(min(v.created_at), CASE WHEN coalesce(json_extract("
                    "any_value(t.lineage), '$.labelled_control')::BOOLEAN, false) "
                    "THEN t.created_at ELSE 0 END) AS added_at, t.origin, "
                    "t.id, any_value(t.lineage) "
                    "FROM tasks t LEFT JOIN verdicts v ON v.pool_task_id = t.id AND v.added "
                    "GROUP BY t.id, t.origin, t.created_at ORDER BY added_at, t.id"
                ).fetchall()
            ]
            data.verdicts = [
                VerdictRow(
                    float(at),
                    bool(ok),
                    json.loads(reasons),
                    kind,
                    str(origin),
                    _lineage_fields(lineage)[0],
                )
                for at, ok, reasons, kind, origin, lineage in db.execute(
                    "SELECT created_at, accepted, reasons, signal_kind, origin, lineage "
                    "FROM verdicts ORDER BY created_at"
                ).fetchall()
            ]
            data.groups = [
                GroupRow(
                    float(at),
                    int(version),
                    float(mean),
                    bool(uniform),
                    str(task_id),
                    tuple(float(x) for x in scores),
                    str(group_id),
                    int(lowest),
                )
                for at, version, mean, uniform, task_id, scores, group_id, lowest in db.execute(
                    "SELECT max(recorded_at), max(policy_version), avg(score), "
                    "min(score) = max(score), min(task_id), "
                    "list(score ORDER BY sample_index), group_id, min(policy_version) "
                    "FROM rollout_results GROUP BY group_id ORDER BY 1, group_id"
                ).fetchall()
            ]
            data.experiences = _experiences(db)
    except (duckdb.Error, OSError) as exc:
        data.pool_error = f"{type(exc).__name__}: {exc}"


def _experiences(db: duckdb.DuckDBPyConnection) -> list[ExperienceRow]:
    """The experiences table; empty in a pool file written before it existed."""
    if not db.execute(
        "SELECT 1 FROM information_schema.tables WHERE table_name = 'experiences'"
    ).fetchall():
        return []
    return [
        ExperienceRow(float(at), str(eid), str(task_id), str(text), int(retrieved))
        for at, eid, task_id, text, retrieved in db.execute(
            "SELECT created_at, id, task_id, text, retrieved FROM experiences ORDER BY created_at"
        ).fetchall()
    ]


def read_scalars(directory: Path) -> dict[str, list[Scalar]]:
    """Every scalar series in the event files under ``directory``, by tag."""
    if not directory.is_dir() or not any(directory.glob("events.out.tfevents.*")):
        return {}
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(directory), size_guidance={"scalars": 0})
    accumulator.Reload()
    series: dict[str, list[Scalar]] = {}
    for tag in accumulator.Tags().get("scalars", []):
        series[tag] = [
            Scalar(event.wall_time, int(event.step), float(event.value))
            for event in accumulator.Scalars(tag)
        ]
    return series


def read_eval_scalars(root: Path, learner: dict[str, list[Scalar]]) -> dict[str, list[Scalar]]:
    """The ``eval/`` series from every event directory under ``root`` (the learner's
    included, whose series are ``learner``), merged by tag in step order."""
    learner_dir = root / LEARNER_TENSORBOARD.removeprefix(f"{TENSORBOARD}/")
    found = {tag: list(points) for tag, points in learner.items() if tag.startswith(EVAL_PREFIX)}
    event_dirs = sorted({f.parent for f in root.rglob("events.out.tfevents.*")})
    for directory in event_dirs if root.is_dir() else []:
        if directory == learner_dir:
            continue
        for tag, points in read_scalars(directory).items():
            if tag.startswith(EVAL_PREFIX):
                found.setdefault(tag, []).extend(points)
    return {
        tag: sorted(points, key=lambda p: (p.step, p.wall_time)) for tag, points in found.items()
    }


def read_spans(directory: Path) -> list[SpanRow]:
    """Finished spans from every ``*.jsonl`` trace file (unreadable lines are skipped)."""
    spans: list[SpanRow] = []
    for file in sorted(directory.glob("*.jsonl")) if directory.is_dir() else []:
        with file.open() as lines:
            for line in lines:
                try:
                    record = json.loads(line)
                    start, end = int(record["start_ns"]), int(record["end_ns"])
                    outcome = (record.get("attributes") or {}).get(OUTCOME_ATTRIBUTE)
                    spans.append(
                        SpanRow(
                            str(record.get("service") or file.name.split("-", 1)[0]),
                            str(record["name"]),
                            start / 1e9,
                            max(0.0, (end - start) / 1e9),
                            None if outcome is None else str(outcome),
                        )
                    )
                except (ValueError, KeyError, TypeError):
                    continue
    spans.sort(key=lambda span: span.start_s)
    return spans


def _lineage_fields(
    lineage: str | None,
) -> tuple[str | None, str | None, int, int | None, bool]:
    """(parent task id, signal kind, depth, signal version, labelled control) of a stored
    lineage (JSON)."""
    try:
        chain = json.loads(lineage) if lineage else {}
    except ValueError:
        chain = {}
    if not isinstance(chain, dict):
        chain = {}
    parent, kind = chain.get("parent_task_id"), chain.get("signal_kind")
    try:
        depth = int(chain.get("depth") or 0)
    except (TypeError, ValueError):
        depth = 0
    version = chain.get("signal_version")
    return (
        str(parent) if parent else None,
        str(kind) if kind else None,
        depth,
        version if isinstance(version, int) and not isinstance(version, bool) else None,
        chain.get("labelled_control") is True,
    )


def _signal_state(
    path: Path,
) -> tuple[dict[str, int], dict[str, int], dict[str, set[str]] | None]:
    """(emitted per kind, suppressed per reason, kind -> tasks that raised one). The
    tasks come from the monitor's rate-limit record: ``last_signal_at`` keys every signal
    it let out as ``kind:task_id`` (``services/signal_monitor/state.py``)."""
    try:
        state: dict[str, Any] = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}, {}, None
    emitted = {str(k): int(v) for k, v in (state.get("emitted") or {}).items()}
    suppressed = {str(k): int(v) for k, v in (state.get("suppressed") or {}).items()}
    raised = state.get("last_signal_at")
    if not isinstance(raised, dict):
        return emitted, suppressed, None
    tasks: dict[str, set[str]] = {}
    for key in raised:
        kind, _, task_id = str(key).partition(":")
        if task_id:
            tasks.setdefault(kind, set()).add(task_id)
    return emitted, suppressed, tasks


def read_steps(path: Path) -> list[StepRecord]:
    """The learner's step records, in file order (unreadable lines are skipped)."""
    steps: list[StepRecord] = []
    if not path.is_file():
        return steps
    with path.open(errors="replace") as lines:
        for line in lines:
            try:
                record = json.loads(line)
                steps.append(
                    StepRecord(
                        step=int(record["step"]),
                        version=int(record["version"]),
                        published=bool(record["published"]),
                        at=float(record["time"]),
                        groups=tuple(_step_group(g) for g in record.get("groups") or ()),
                        stale=tuple(_step_group(g) for g in record.get("stale") or ()),
                    )
                )
            except (ValueError, KeyError, TypeError, AttributeError):
                continue
    return steps


def _step_group(entry: dict[str, Any]) -> StepGroup:
    return StepGroup(
        group_id=str(entry["group_id"]),
        task_id=str(entry["task_id"]),
        origin=str(entry["origin"]),
        policy_version=int(entry["policy_version"]),
        uniform=bool(entry["uniform"]),
        label_s=float(entry.get("label_s", 0.0)),
        labelled=int(entry.get("labelled", 0)),
        good=int(entry.get("good", 0)),
        bad=int(entry.get("bad", 0)),
        navigated=int(entry.get("navigated", 0)),
        agent=str(entry.get("agent", "target")),
        rewards=tuple(float(r) for r in entry.get("rewards", ())),
    )


def policy_files(run_dir: Path) -> dict[int, float]:
    """Policy version -> modification time of ``policies/v<N>.safetensors``."""
    files: dict[int, float] = {}
    directory = run_dir / "policies"
    for file in directory.glob("v*.safetensors") if directory.is_dir() else []:
        number = file.stem.removeprefix("v")
        if number.isdigit():
            files[int(number)] = file.stat().st_mtime
    return files


@dataclass
class LogProblems:
    """Counts of WARNING / ERROR (or CRITICAL) / Traceback lines, and the first error."""

    warnings: int = 0
    errors: int = 0
    tracebacks: int = 0
    first_error: str = ""

    @property
    def any(self) -> bool:
        return bool(self.warnings or self.errors or self.tracebacks)


def log_problems(directory: Path) -> dict[str, LogProblems]:
    """Per log file (by service): its warnings, errors and tracebacks."""
    problems: dict[str, LogProblems] = {}
    for file in sorted(directory.glob("*.log")) if directory.is_dir() else []:
        found = problems[file.stem] = LogProblems()
        with file.open(errors="replace") as lines:
            for line in lines:
                if " WARNING " in line:
                    found.warnings += 1
                elif " ERROR " in line or " CRITICAL " in line:
                    found.errors += 1
                    if not found.first_error:
                        found.first_error = line.strip()
                elif line.startswith("Traceback"):
                    found.tracebacks += 1
    return problems
