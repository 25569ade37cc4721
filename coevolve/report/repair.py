"""What repaired what: where the rollout draws went, and whether training on a child task
raised the parent task whose failure produced it.

Three measures, all from the run directory:

- **Draws** (``draw_rows``): rollout groups per origin, and how concentrated they are: the
  most-drawn task's groups against the median drawn task's; beside them, the groups the
  learner trained on per origin (``learner/steps.jsonl``, when the learner wrote it).
- **Repair, from the rollouts** (``child_rows``, ``parent_groups``): every accepted task
  with a parent in its lineage, whether it was trained on, and its parent's rollout scores
  at the earliest policy version the parent was rolled out at against the latest. Parents
  are grouped by the kind of signal that produced their children, beside tasks that
  raised a signal but got no accepted child and seed tasks that raised none (the same
  selection without the repair: failing tasks regress towards their mean either way).
  Cheap, but the rollouts choose which tasks are drawn when, so the versions differ.
- **Repair, measured** (``measure_repair``, opt-in): the parents and as many no-signal seed
  tasks (chosen deterministically) played N times each by policy v1 and by the last
  policy, sampled like rollout; success and partial credit per group at both versions,
  with the paired change per task. Saved as JSON beside the report, not recomputed.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import statistics
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from coevolve.report.run_data import POOL_FILE, RunData, StepGroup, pool_copy
from coevolve.report.stats import paired_delta
from coevolve.shared.messages import ORIGINS

if TYPE_CHECKING:
    from coevolve.shared.config import EngineKind, Settings
    from coevolve.shared.messages import Task

SOLVED = 1.0  # BFCL's success; an unsolved episode earns partial credit below 1
NO_SIGNAL = "no signal (seed)"
RAISED_NO_CHILD = "raised a signal, no accepted child"
CANDIDATE_NO_CHILD = "parent of a candidate, none accepted"
UNGUIDED = "unguided"  # an accepted task with a parent but no signal (seed-mode exploration)
MEASURED_FILE = "repair-measured.json"
ALL = "all"


# ---------------------------------------------------------------------- draws


@dataclass(frozen=True)
class DrawRow:
    """Rollout groups of one origin (or of all): how many, over how many tasks, the
    most-drawn task's and the median drawn task's groups, and what the learner trained on
    (None: no step record)."""

    origin: str
    groups: int
    tasks_drawn: int
    tasks_in_pool: int
    largest_task: str | None
    largest_groups: int
    median_groups: float
    trained: int | None = None
    trained_with_gradient: int | None = None
    stale: int | None = None

    @property
    def largest_share(self) -> float | None:
        return self.largest_groups / self.groups if self.groups else None

    @property
    def median_share(self) -> float | None:
        return self.median_groups / self.groups if self.groups else None

    @property
    def ratio(self) -> float | None:
        return self.largest_groups / self.median_groups if self.median_groups else None


def draw_rows(data: RunData) -> list[DrawRow]:
    """One row per origin with tasks or groups (pool order), then ``all``. The median is
    over the tasks drawn at least once; shares are of the row's own groups."""
    origin_of = {task.task_id: task.origin for task in data.tasks}
    in_pool = Counter(task.origin for task in data.tasks)
    per_task = Counter(group.task_id for group in data.groups)
    trained, with_gradient, stale = _trained_counts(data, lambda group: group.origin)
    recorded = bool(data.steps)
    drawn_origins = {origin_of.get(task_id, "unknown") for task_id in per_task}
    origins: list[str] = [o for o in ORIGINS if in_pool[o] or o in drawn_origins]
    origins += sorted(drawn_origins - set(origins))

    def row(origin: str, counts: dict[str, int], pool: int, picked: Sequence[str]) -> DrawRow:
        largest = max(sorted(counts), key=lambda task_id: counts[task_id], default=None)
        return DrawRow(
            origin=origin,
            groups=sum(counts.values()),
            tasks_drawn=len(counts),
            tasks_in_pool=pool,
            largest_task=largest,
            largest_groups=counts[largest] if largest is not None else 0,
            median_groups=float(statistics.median(counts.values())) if counts else 0.0,
            trained=sum(trained[o] for o in picked) if recorded else None,
            trained_with_gradient=sum(with_gradient[o] for o in picked) if recorded else None,
            stale=sum(stale[o] for o in picked) if recorded else None,
        )

    rows = [
        row(
            origin,
            {t: n for t, n in per_task.items() if origin_of.get(t, "unknown") == origin},
            in_pool[origin],
            [origin],
        )
        for origin in origins
    ]
    every = set(trained) | set(stale) | set(origins)
    rows.append(row(ALL, dict(per_task), len(data.tasks), sorted(every)))
    return rows


def _trained_counts(
    data: RunData, key: Callable[[StepGroup], str]
) -> tuple[Counter[str], Counter[str], Counter[str]]:
    """Per ``key`` of a step's group: groups trained on (in steps that updated the
    weights), of them those with unequal rewards (a gradient), and groups dropped stale."""
    trained: Counter[str] = Counter()
    with_gradient: Counter[str] = Counter()
    stale: Counter[str] = Counter()
    for step in data.steps:
        for group in step.stale:
            stale[key(group)] += 1
        if step.published:
            for group in step.groups:
                trained[key(group)] += 1
                with_gradient[key(group)] += not group.uniform
    return trained, with_gradient, stale


# ---------------------------------------------------------------------- repair (rollouts)


@dataclass(frozen=True)
class Scores:
    """A task's rollout samples at one policy version."""

    version: int
    samples: int
    mean: float
    solved: int

    @classmethod
    def of(cls, version: int, scores: Sequence[float]) -> Scores:
        return cls(
            version, len(scores), sum(scores) / len(scores), sum(s >= SOLVED for s in scores)
        )


@dataclass(frozen=True)
class TaskChange:
    """A task's samples at the earliest policy version it was rolled out at, and at the
    latest (None: never rolled out at a later version)."""

    task_id: str
    before: Scores
    after: Scores | None

    @property
    def change(self) -> float | None:
        return None if self.after is None else self.after.mean - self.before.mean


def task_changes(data: RunData) -> dict[str, TaskChange]:
    by_task: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    for group in data.groups:
        by_task[group.task_id][group.policy_version].extend(group.scores)
    changes = {}
    for task_id, versions in by_task.items():
        first, last = min(versions), max(versions)
        changes[task_id] = TaskChange(
            task_id,
            Scores.of(first, versions[first]),
            Scores.of(last, versions[last]) if last > first else None,
        )
    return changes


@dataclass(frozen=True)
class ChildRow:
    """An accepted task with a parent: the parent, the signal kind, how often the child
    was rolled out and trained on (None: no step record), and the parent's change."""

    child: str
    parent: str
    kind: str
    depth: int
    child_groups: int
    trained: int | None
    trained_with_gradient: int | None
    parent_change: TaskChange | None


def child_rows(data: RunData) -> list[ChildRow]:
    changes = task_changes(data)
    rolled = Counter(group.task_id for group in data.groups)
    trained, with_gradient, _ = _trained_counts(data, lambda group: group.task_id)
    recorded = bool(data.steps)
    rows = [
        ChildRow(
            child=task.task_id,
            parent=task.parent_task_id,
            kind=task.signal_kind or UNGUIDED,
            depth=task.depth,
            child_groups=rolled[task.task_id],
            trained=trained[task.task_id] if recorded else None,
            trained_with_gradient=with_gradient[task.task_id] if recorded else None,
            parent_change=changes.get(task.parent_task_id),
        )
        for task in data.tasks
        if not task.from_start and task.parent_task_id
    ]
    return sorted(rows, key=lambda r: (r.kind, r.parent, r.child))


def parents_by_kind(data: RunData) -> dict[str, list[str]]:
    """Signal kind -> the distinct parents of accepted tasks of that kind, sorted; only
    parents in the pool (an unguided task's parent is an initial state, never rolled out)."""
    in_pool = {task.task_id for task in data.tasks}
    parents: dict[str, set[str]] = defaultdict(set)
    for task in data.tasks:
        if not task.from_start and task.parent_task_id in in_pool:
            parents[task.signal_kind or UNGUIDED].add(task.parent_task_id)
    return {kind: sorted(ids) for kind, ids in sorted(parents.items())}


@dataclass(frozen=True)
class SignalSource:
    """The tasks that raised a signal, and where that came from."""

    raised: set[str]
    source: str
    no_child_label: str


def signal_source(data: RunData) -> SignalSource:
    """The monitor's record when its state has one; else the parents of every candidate
    the judge saw (a signal that produced no candidate is then not known)."""
    if data.signal_tasks is not None:
        raised = {task for tasks in data.signal_tasks.values() for task in tasks}
        return SignalSource(raised, "signal_monitor/state.json", RAISED_NO_CHILD)
    raised = {v.parent_task_id for v in data.verdicts if v.parent_task_id}
    return SignalSource(raised, "the parents of judged candidates", CANDIDATE_NO_CHILD)


@dataclass(frozen=True)
class ParentGroup:
    """Tasks of one kind of parent: before and after pooled over those rolled out at two
    versions (``paired``), and the mean of each paired task's change in mean score."""

    label: str
    tasks: int
    paired: list[TaskChange] = field(default_factory=list)

    def pooled(self, side: str) -> tuple[int, float | None, float | None]:
        """(samples, mean score, solved share) of ``before`` or ``after`` over paired tasks."""
        parts = [getattr(change, side) for change in self.paired]
        samples = sum(p.samples for p in parts)
        if not samples:
            return 0, None, None
        return (
            samples,
            sum(p.mean * p.samples for p in parts) / samples,
            sum(p.solved for p in parts) / samples,
        )

    @property
    def mean_change(self) -> float | None:
        values = [c.change for c in self.paired if c.change is not None]
        return sum(values) / len(values) if values else None


def parent_groups(data: RunData) -> tuple[list[ParentGroup], SignalSource]:
    """Per signal kind, the parents of accepted tasks; then tasks that raised a signal but
    have no accepted child; then seed tasks that raised none."""
    changes = task_changes(data)
    source = signal_source(data)
    by_kind = parents_by_kind(data)
    parents = {task for tasks in by_kind.values() for task in tasks}
    candidates = {v.parent_task_id for v in data.verdicts if v.parent_task_id}
    seeds = {task.task_id for task in data.tasks if task.from_start}
    no_child = sorted(source.raised - parents)
    quiet = sorted(seeds - source.raised - parents - candidates)

    def group(label: str, task_ids: Iterable[str]) -> ParentGroup:
        ids = list(task_ids)
        paired = [changes[t] for t in ids if t in changes and changes[t].after is not None]
        return ParentGroup(label, len(ids), paired)

    groups = [group(f"{kind}: parents of accepted tasks", ids) for kind, ids in by_kind.items()]
    groups += [group(source.no_child_label, no_child), group(NO_SIGNAL, quiet)]
    return groups, source


# ---------------------------------------------------------------------- repair (measured)


@dataclass(frozen=True)
class MeasuredSample:
    """One episode of the measured repair: a task played by one policy version."""

    task_id: str
    version: int
    success: float
    partial_credit: float | None


# (policy version, tasks) -> one (success, partial credit) per task, in order
Play = Callable[[int, list["Task"]], list[tuple[float, float | None]]]


def no_signal_controls(data: RunData, count: int) -> list[str]:
    """``count`` tasks there from the start (seeds, or D0) that raised no signal and are
    no parent, chosen by the sha256 of their id (the same run gives the same tasks); those
    the rollouts drew come first, so the cheap and the measured tables speak of the same
    tasks where they can."""
    source = signal_source(data)
    parents = {t for ids in parents_by_kind(data).values() for t in ids}
    candidates = {v.parent_task_id for v in data.verdicts if v.parent_task_id}
    drawn = {group.task_id for group in data.groups}
    quiet = [
        task.task_id
        for task in data.tasks
        if task.from_start and task.task_id not in source.raised | parents | candidates
    ]

    def key(task_id: str) -> tuple[bool, str]:
        return task_id not in drawn, hashlib.sha256(task_id.encode()).hexdigest()

    return sorted(quiet, key=key)[:count]


def repair_task_sets(data: RunData) -> dict[str, list[str]]:
    """Label -> task ids: the parents per signal kind, then as many no-signal seed tasks
    as there are distinct parents."""
    sets = dict(parents_by_kind(data))
    distinct = {t for ids in sets.values() for t in ids}
    if distinct:
        sets[NO_SIGNAL] = no_signal_controls(data, len(distinct))
    return sets


def aggregate_measured(
    samples: Sequence[MeasuredSample],
    task_sets: dict[str, list[str]],
    first: int,
    last: int,
) -> list[dict[str, Any]]:
    """Per label: tasks, samples, success share and mean partial credit at ``first`` and
    ``last``, and the paired change (per task: its share at ``last`` minus at ``first``)
    with a bootstrap interval over tasks and a permutation p-value."""
    per: dict[tuple[str, int], list[MeasuredSample]] = defaultdict(list)
    for sample in samples:
        per[(sample.task_id, sample.version)].append(sample)

    def mean(values: Sequence[float]) -> float | None:
        return sum(values) / len(values) if values else None

    rows = []
    for label, task_ids in task_sets.items():
        row: dict[str, Any] = {"label": label, "tasks": len(task_ids)}
        per_task: dict[str, dict[int, tuple[float, float | None]]] = defaultdict(dict)
        for version, side in ((first, "first"), (last, "last")):
            played = [s for t in task_ids for s in per[(t, version)]]
            credits = [s.partial_credit for s in played if s.partial_credit is not None]
            row[f"samples_{side}"] = len(played)
            row[f"success_{side}"] = mean([s.success for s in played])
            row[f"partial_credit_{side}"] = mean(credits)
            for task_id in task_ids:
                mine = per[(task_id, version)]
                if mine:
                    task_credits = [s.partial_credit for s in mine if s.partial_credit is not None]
                    per_task[task_id][version] = (
                        sum(s.success for s in mine) / len(mine),
                        mean(task_credits),
                    )
        paired = [t for t in task_ids if first in per_task[t] and last in per_task[t]]
        for index, measure in ((0, "success"), (1, "partial_credit")):
            before = [per_task[t][first][index] for t in paired]
            after = [per_task[t][last][index] for t in paired]
            pairs = [
                (a, b)
                for a, b in zip(after, before, strict=True)
                if a is not None and b is not None
            ]
            if pairs:
                delta = paired_delta([a for a, _ in pairs], [b for _, b in pairs])
                row[f"{measure}_change"] = asdict(delta)
            else:
                row[f"{measure}_change"] = None
        rows.append(row)
    return rows


def measure_repair(
    data: RunData,
    samples_per_task: int,
    play: Play,
    out_file: Path,
    *,
    describe: dict[str, Any] | None = None,
    log: Callable[[str], None] = lambda line: print(line, file=sys.stderr),
) -> dict[str, Any]:
    """Play the repair sets at v1 (the first policy) and at the last policy, each task
    ``samples_per_task`` times; write and return the result. A saved result for the same
    samples, versions and tasks is returned as it is."""
    versions = data.policy_versions()
    if len(versions) < 2:
        raise ValueError(f"the measured repair needs two policy versions; found {versions}")
    first = 1 if 1 in versions else versions[0]
    last = versions[-1]
    task_sets = repair_task_sets(data)
    if not task_sets:
        raise ValueError("no accepted task names a parent: nothing to measure")
    key = {
        "samples_per_task": samples_per_task,
        "first_version": first,
        "last_version": last,
        "task_sets": task_sets,
    }
    saved = read_measured(out_file)
    if saved is not None and all(saved.get(k) == v for k, v in key.items()):
        log(f"repair: reusing {out_file}")
        return saved
    task_ids = sorted({t for ids in task_sets.values() for t in ids})
    tasks = pool_tasks(data.run_dir, task_ids)
    missing = [t for t in task_ids if t not in tasks]
    if missing:
        raise ValueError(f"tasks not in the pool: {', '.join(missing)}")
    played: list[MeasuredSample] = []
    started = time.time()
    for version in (first, last):
        batch = [tasks[t] for t in task_ids for _ in range(samples_per_task)]
        log(
            f"repair: policy v{version}: {len(task_ids)} tasks x {samples_per_task} samples "
            f"= {len(batch)} episodes"
        )
        outcomes = play(version, batch)
        played += [
            MeasuredSample(task.id, version, float(success), partial)
            for task, (success, partial) in zip(batch, outcomes, strict=True)
        ]
    result = {
        **key,
        **(describe or {}),
        "seconds": round(time.time() - started, 1),
        "rows": aggregate_measured(played, task_sets, first, last),
        "samples": [asdict(s) for s in played],
    }
    out_file.parent.mkdir(parents=True, exist_ok=True)
    out_file.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    log(f"repair: written to {out_file}")
    return result


def read_measured(path: Path) -> dict[str, Any] | None:
    try:
        result = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return result if isinstance(result, dict) and "rows" in result else None


def pool_tasks(run_dir: Path, task_ids: Sequence[str]) -> dict[str, Task]:
    """The tasks ``task_ids`` as the pool stores them (read from a copy while a
    pool-store holds the file)."""
    import duckdb

    from coevolve.services.pool_store.store import PoolStore

    path = run_dir / POOL_FILE
    with contextlib.ExitStack() as stack:
        try:
            store = PoolStore.open_readonly(path)
        except duckdb.Error:
            store = PoolStore.open_readonly(pool_copy(path, stack))
        stack.callback(store.close)
        found = {task_id: store.get_task(task_id) for task_id in task_ids}
    return {task_id: task for task_id, task in found.items() if task is not None}


def policy_play(
    run_dir: Path, settings: Settings, engine_kind: EngineKind, batch_size: int | None = None
) -> Play:
    """Play tasks with policy ``version`` of ``run_dir`` the way rollout samples (the
    rollout section's sampling and step budget), through ``coevolve eval``'s loading and
    ``shared.evaluation``'s player: one outcome (BFCL success, partial credit) a task."""
    from coevolve.cli.eval_cmd import (
        EVAL_BATCH_SIZE,
        EVAL_KV_LAYOUT,
        EVAL_SEQUENCE_TOKENS,
        load_policy_choice,
        resolve_policy_choice,
    )
    from coevolve.services.learner.config import LearnerServiceConfig
    from coevolve.services.rollout.config import RolloutConfig
    from coevolve.services.rollout.handler import sampling_params
    from coevolve.shared.envs import make_environment
    from coevolve.shared.envs.rendering import configured_tool_rendering
    from coevolve.shared.evaluation import policy_player, run_suite
    from coevolve.shared.policy.factory import engine_for_policy

    rollout = settings.section("rollout", RolloutConfig)
    model = settings.section("learner", LearnerServiceConfig).model
    size = batch_size or EVAL_BATCH_SIZE[engine_kind]

    def play(version: int, tasks: list[Task]) -> list[tuple[float, float | None]]:
        choice = resolve_policy_choice(str(version), run_dir)
        loaded = load_policy_choice(choice, model, run_dir)
        options: dict[str, Any] = {}
        if engine_kind == "llama_cpp":
            options = {
                "kv_layout": EVAL_KV_LAYOUT,
                "sequences": size,
                "context_tokens": size * EVAL_SEQUENCE_TOKENS[configured_tool_rendering()],
            }
        engine = engine_for_policy(engine_kind, loaded, run_dir=run_dir, **options)
        outcomes: dict[int, tuple[float, float | None]] = {}
        try:
            for environment in sorted({task.environment for task in tasks}):
                positions = [i for i, task in enumerate(tasks) if task.environment == environment]
                player = policy_player(
                    engine,
                    functools.partial(make_environment, environment),
                    sampling_params(rollout),
                    rollout.max_steps_per_turn,
                )
                report = run_suite(
                    [tasks[i] for i in positions],
                    player,
                    suite="repair",
                    split=f"v{version}",
                    policy=str(version),
                    batch_size=size,
                )
                errors = [entry.error for entry in report.entries if entry.error]
                if errors and len(errors) == len(report.entries):
                    raise RuntimeError(f"policy v{version}: every episode failed: {errors[0]}")
                if errors:
                    print(
                        f"repair: policy v{version}: {len(errors)} episodes failed "
                        f"(scored 0), the first: {errors[0]}",
                        file=sys.stderr,
                    )
                for position, entry in zip(positions, report.entries, strict=True):
                    outcomes[position] = (entry.score, entry.partial_credit)
        finally:
            close = getattr(engine, "close", None)
            if callable(close):
                close()
        return [outcomes[i] for i in range(len(tasks))]

    return play
