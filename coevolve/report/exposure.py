"""Exposure: do the learner's steps see tasks made from recent failures?

Two measures, from the run directory (``RunData``):

- the share of the trained groups with a gradient (the target agent's, rewards not all
  equal, in steps that updated the weights) that are on synthesized tasks, or on the
  labelled turns an experiment's ``labelled_control`` arm adds in their place, in the
  first and in the second half of the learner steps (``learner/steps.jsonl``);
- per accepted child of a signal whose lineage names the policy version that raised the
  signal: how many versions passed before it was first drawn (the lowest policy version
  among its recorded results, minus ``signal_version``), their median, and how many were
  never drawn.

``exposure.json`` adds, per accepted synthesized task, its request and calls beside its
parent's, with ``label`` and ``reason`` left empty for a reader to fill in.
"""

from __future__ import annotations

import contextlib
import json
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from coevolve.report.run_data import (
    LEARNER_STEPS,
    POOL_FILE,
    RunData,
    StepRecord,
    TaskRow,
    load_pool,
    read_steps,
)
from coevolve.shared.failures import call_text
from coevolve.shared.pacing import PacingSettings

if TYPE_CHECKING:
    from coevolve.shared.messages import Task, ToolCall

EXPOSURE_FILE = "exposure.json"
SYNTHESIZED = "synthesized"
# a run's configuration, where the experiment commands write it
RUN_CONFIG = "coevolve.yaml"
DEFAULT_CONTRACT = PacingSettings().max_versions_to_first_draw


@dataclass(frozen=True)
class Exposure:
    """The exposure figures of one run; a share is None without trained groups."""

    learner_steps: int  # steps that updated the weights
    first_half: float | None
    second_half: float | None
    # accepted synthesized task -> versions to its first draw (None: never drawn, or no
    # signal version), in the order the tasks joined the pool
    versions_to_first_draw: dict[str, int | None]
    # the tasks with a signal version, of them those never drawn
    with_signal_version: int
    never_drawn: int
    # the never drawn ones past the contract: the versions each waited at least
    overdue: tuple[int, ...] = ()
    # labelled turns an experiment's labelled_control arm added, counted in the shares
    control_turns: int = 0

    @property
    def median_versions_to_first_draw(self) -> float | None:
        drawn = [v for v in self.versions_to_first_draw.values() if v is not None]
        waits = [*drawn, *self.overdue]
        return float(statistics.median(waits)) if waits else None


def synthesized_share(
    steps: Sequence[StepRecord], control_turns: frozenset[str] = frozenset()
) -> float | None:
    """Of the target agent's trained groups with a gradient in ``steps``, the share on
    synthesized tasks or on ``control_turns`` (the ids of a labelled_control run's added
    turns) (None: no such group)."""
    groups = [
        group
        for step in steps
        if step.published
        for group in step.groups
        if group.agent == "target" and not group.uniform
    ]
    if not groups:
        return None
    added = sum(g.origin == SYNTHESIZED or g.task_id in control_turns for g in groups)
    return added / len(groups)


def step_halves(steps: Sequence[StepRecord]) -> tuple[list[StepRecord], list[StepRecord]]:
    """The first and second half of the steps (the first takes the odd one)."""
    middle = (len(steps) + 1) // 2
    return list(steps[:middle]), list(steps[middle:])


def first_draws(data: RunData) -> dict[str, int]:
    """Task -> the lowest policy version among its recorded results."""
    lowest: dict[str, int] = {}
    for group in data.groups:
        version = group.first_version
        lowest[group.task_id] = min(version, lowest.get(group.task_id, version))
    return lowest


def synthesized_tasks(data: RunData) -> list[TaskRow]:
    return [task for task in data.tasks if task.origin == SYNTHESIZED]


def last_version(data: RunData) -> int | None:
    """The newest policy version the run's steps or groups name."""
    versions = [step.version for step in data.steps] + [g.policy_version for g in data.groups]
    return max(versions) if versions else None


def exposure(data: RunData, contract: int = DEFAULT_CONTRACT) -> Exposure:
    """The figures, from ``data``'s steps, tasks and groups; ``contract``: the versions
    a child may wait for its first draw (``pacing.max_versions_to_first_draw``)."""
    trained = [step for step in data.steps if step.published]
    first, second = step_halves(trained)
    drawn_at = first_draws(data)
    last = last_version(data)
    versions: dict[str, int | None] = {}
    for task in synthesized_tasks(data):
        drawn = drawn_at.get(task.task_id)
        if drawn is None or task.signal_version is None:
            versions[task.task_id] = None
        else:
            versions[task.task_id] = drawn - task.signal_version
    timed = [task for task in synthesized_tasks(data) if task.signal_version is not None]
    control_turns = frozenset(task.task_id for task in data.tasks if task.labelled_control)
    overdue = tuple(
        last - task.signal_version + 1
        for task in timed
        if task.task_id not in drawn_at
        and last is not None
        and task.signal_version is not None
        and last - task.signal_version > contract
    )
    return Exposure(
        learner_steps=len(trained),
        first_half=synthesized_share(first, control_turns),
        second_half=synthesized_share(second, control_turns),
        versions_to_first_draw=versions,
        with_signal_version=len(timed),
        never_drawn=sum(task.task_id not in drawn_at for task in timed),
        overdue=overdue,
        control_turns=len(control_turns),
    )


# ---------------------------------------------------------------------- exposure.json


def run_setting(run_dir: Path, data: RunData) -> str:
    """``labelled`` or ``no_labels``: the ``labels`` of the run's configuration file when
    it has one, else whether the pool holds seed tasks (labelled ones) other than the
    turns a labelled_control arm added to a run with no labels."""
    labels = _configured_labels(run_dir / RUN_CONFIG)
    if labels is not None:
        return "no_labels" if labels == "none" else "labelled"
    seeded = any(task.origin == "seed" and not task.labelled_control for task in data.tasks)
    return "labelled" if seeded else "no_labels"


def _configured_labels(path: Path) -> str | None:
    import yaml

    with contextlib.suppress(OSError, yaml.YAMLError):
        loaded = yaml.safe_load(path.read_text())
        if isinstance(loaded, dict) and loaded.get("labels") is not None:
            return str(loaded["labels"])
    return None


def _calls(turns: Sequence[Sequence[ToolCall]]) -> list[str]:
    return [call_text(call) for turn in turns for call in turn]


def _first_turn(task: Task | None) -> str | None:
    return task.user_turns[0] if task is not None and task.user_turns else None


def exposure_record(data: RunData, tasks: dict[str, Task], setting: str) -> dict[str, Any]:
    """What ``exposure.json`` holds; ``tasks``: the pool's synthesized tasks and their
    parents, by id (a task missing from it has no request or calls)."""
    figures = exposure(data)
    children = synthesized_tasks(data)
    truths = [tasks[t.task_id].ground_truth for t in children if t.task_id in tasks]
    multi_call = sum(len(_calls(truth)) >= 2 for truth in truths)
    rows = []
    for child in children:
        task = tasks.get(child.task_id)
        parent = tasks.get(child.parent_task_id or "")
        rows.append(
            {
                "task_id": child.task_id,
                "parent_request": _first_turn(parent),
                "parent_calls": _calls(parent.ground_truth) if parent is not None else [],
                "request": _first_turn(task),
                "calls": _calls(task.ground_truth) if task is not None else [],
                "versions_to_first_draw": figures.versions_to_first_draw[child.task_id],
                "label": None,
                "reason": None,
            }
        )
    return {
        "setting": setting,
        "learner_steps": figures.learner_steps,
        "accepted": len(children),
        "multi_call_share": multi_call / len(truths) if truths else None,
        "distinct_parents": len({t.parent_task_id for t in children if t.parent_task_id}),
        "exposure_first_half": figures.first_half,
        "exposure_second_half": figures.second_half,
        "median_versions_to_first_draw": figures.median_versions_to_first_draw,
        "never_drawn": figures.never_drawn,
        "tasks": rows,
    }


def write_exposure(data: RunData, out: Path) -> Path:
    """Write ``out/exposure.json`` for the run of ``data``."""
    # imported here: repair's statistics load scipy, which `coevolve status` does not need
    from coevolve.report.repair import pool_tasks

    children = synthesized_tasks(data)
    wanted = {t.task_id for t in children} | {
        t.parent_task_id for t in children if t.parent_task_id
    }
    tasks = pool_tasks(data.run_dir, sorted(wanted)) if wanted else {}
    record = exposure_record(data, tasks, run_setting(data.run_dir, data))
    path = out / EXPOSURE_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return path


# ---------------------------------------------------------------------- words


def _share(value: float | None) -> str:
    """A share in percent; n/a where no group was trained."""
    return "n/a" if value is None else f"{100 * value:.0f}%"


def exposure_text(figures: Exposure) -> str:
    """The report's Exposure section."""
    if not figures.learner_steps:
        halves = "No `learner/steps.jsonl`: what the learner trained on is not recorded."
    else:
        halves = (
            f"Of the trained groups with a gradient (the target's, in steps that updated the "
            f"weights), on {_added(figures)}: {_share(figures.first_half)} in the first half "
            f"of the {figures.learner_steps} learner steps, {_share(figures.second_half)} in "
            "the second."
        )
    if not figures.with_signal_version:
        return f"{halves}\n\nNo accepted synthesized task names the policy version of its signal."
    median = figures.median_versions_to_first_draw
    overdue = len(figures.overdue)
    counted = f" ({overdue} never drawn past the contract count as waiting longer)"
    after = (
        ""
        if median is None
        else f"; the median child waited {median:g} versions from its signal"
        + (counted if overdue else "")
    )
    drawn = figures.with_signal_version - figures.never_drawn
    return (
        f"{halves}\n\nOf {figures.with_signal_version} accepted children that name their "
        f"signal's policy version, {drawn} were drawn, {figures.never_drawn} never{after}. "
        f"Per task in `{EXPOSURE_FILE}`."
    )


def _added(figures: Exposure) -> str:
    if figures.control_turns:
        return f"synthesized tasks or the {figures.control_turns} labelled turns added"
    return "synthesized tasks"


def status_line(figures: Exposure, pool_unread: str | None) -> str:
    """One line for ``coevolve status``; ``pool_unread``: why the pool was not read."""
    what = "synthesized and labelled-control" if figures.control_turns else "synthesized"
    line = (
        f"exposure: {what} share of trained groups with a gradient "
        f"{_share(figures.first_half)} (first half of {figures.learner_steps} steps), "
        f"{_share(figures.second_half)} (second half)"
    )
    if pool_unread is not None:
        return f"{line}; versions to first draw not read ({pool_unread})"
    median = figures.median_versions_to_first_draw
    return (
        f"{line}; median versions to first draw {'-' if median is None else f'{median:g}'} "
        f"({figures.never_drawn} of {figures.with_signal_version} never drawn)"
    )


def status_exposure(run_dir: Path) -> tuple[Exposure, str | None]:
    """The figures ``coevolve status`` shows, and why the pool was not read (None: it
    was). The steps are always read; the pool only when it opens read-only, that is when
    no pool-store holds it: it is never copied here."""
    data = RunData(run_dir=run_dir)
    data.steps = read_steps(run_dir / LEARNER_STEPS)
    if not (run_dir / POOL_FILE).exists():
        return exposure(data), f"no {POOL_FILE}"
    load_pool(data, copy_when_locked=False)
    if data.pool_error is None:
        return exposure(data), None
    held = "lock" in data.pool_error.lower()
    return exposure(data), "a running pool-store holds the pool" if held else data.pool_error


def status_record(figures: Exposure, pool_unread: str | None) -> dict[str, Any]:
    """The ``exposure`` key of ``coevolve status --json``."""
    read = pool_unread is None
    return {
        "learner_steps": figures.learner_steps,
        "exposure_first_half": figures.first_half,
        "exposure_second_half": figures.second_half,
        "median_versions_to_first_draw": figures.median_versions_to_first_draw if read else None,
        "never_drawn": figures.never_drawn if read else None,
        "pool_unread": pool_unread,
    }
