"""Build D0 with no labels: unguided exploration of an environment's initial states, each
exploration abstracted and judged as synthesized tasks are, the accepted tasks written to
one file (``shared/task_sets.py``).

The explorer, abstractor and judge are the services' own handlers with the run's
sections, in this process and in order (as the lockstep schedule's synthesis runs them).
Start states come from ``services/explorer/discovery.py``: they carry no user turn and no
ground truth, so nothing labelled reaches a prompt. Every finished exploration is
appended to ``<out>.partial.jsonl``; an interrupted build resumes from it.
"""

from __future__ import annotations

import copy
import logging
import os
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import anyio
import msgspec

from coevolve.code_version import code_version
from coevolve.services.abstractor.config import AbstractorConfig
from coevolve.services.abstractor.handler import AbstractorDeps, abstract, similarity_cache_dir
from coevolve.services.evaluator.config import heldout_every
from coevolve.services.explorer.config import ExplorerConfig
from coevolve.services.explorer.discovery import (
    calls_of,
    discovery_request,
    start_order,
    world_starts,
)
from coevolve.services.explorer.handler import ExplorerDeps, explore_request
from coevolve.services.judge.config import JudgeConfig
from coevolve.services.judge.handler import JudgeDeps, judge_candidate
from coevolve.shared.config import Settings
from coevolve.shared.llm import RoleClients
from coevolve.shared.llm.server import MODEL_ENV
from coevolve.shared.messages import PoolStats, Task
from coevolve.shared.structured import RejectionCounter
from coevolve.shared.task_sets import (
    D0Build,
    D0File,
    ExplorationRecord,
    partial_path,
    read_partial,
    split_heldout,
    write_d0,
)

log = logging.getLogger(__name__)


@dataclass
class AcceptedTasks:
    """The abstractor's de-duplication source: the tasks accepted so far."""

    tasks: list[Task] = field(default_factory=list)

    async def stats(self) -> PoolStats:
        return PoolStats(tasks_by_origin={"explored": len(self.tasks)}, results=0)

    async def sample(
        self, size: int, mix: dict[str, float] | None = None, seed: int | None = None
    ) -> list[Task]:
        return self.tasks[:size]


def build_llm_section(settings: Settings) -> dict[str, Any]:
    """The ``llm`` section with the local server's model set to ``d0.role_model``."""
    section = copy.deepcopy(settings.services.get("llm") or {})
    if settings.d0.role_model is not None:
        section.setdefault("server", {})["model"] = settings.d0.role_model
    return section


async def explore_once(
    index: int,
    start: Task,
    settings: Settings,
    deps: tuple[ExplorerDeps, AbstractorDeps, JudgeDeps],
    covered: list[str],
) -> ExplorationRecord:
    """One unguided exploration from ``start`` told which calls D0 ``covered`` already,
    abstracted and judged; a candidate making exactly covered calls is dropped unjudged
    (``duplicate_calls``)."""
    explorer, abstractor, judge = deps
    began = time.monotonic()
    explored = await explore_request(discovery_request(settings, index, start, covered), explorer)
    record = ExplorationRecord(index=index, start_id=start.id, outcome=explored.outcome)
    if explored.exploration is not None:
        abstraction = await abstract(explored.exploration, abstractor)
        record.candidates = len(abstraction.candidates)
        record.dropped = [reason for reason, _ in abstraction.dropped]
        record.dropped_details = [detail[:300] for _, detail in abstraction.dropped]
        for candidate in abstraction.candidates:
            if calls_of(candidate.task) in covered:
                record.dropped.append("duplicate_calls")
                record.dropped_details.append(calls_of(candidate.task)[:300])
                continue
            judged = await judge_candidate(candidate, judge)
            record.verdicts.append(judged.outcome)
            if judged.verdict.accepted:
                record.accepted.append(judged.verdict.task)
    record.seconds = time.monotonic() - began
    return record


async def discover(
    settings: Settings,
    out: Path,
    on_progress: Callable[[str], None] = log.info,
    first_tasks_of: int = 0,
) -> D0File:
    """Build D0 into ``out`` (resuming ``<out>.partial.jsonl``) within the ``d0`` section's
    budgets; the partial file is removed once D0 is written. ``first_tasks_of``: the set is
    the first tasks of a D0 of that many, completed beside training (``D0Build``)."""
    config = settings.d0
    starts, classes = world_starts(settings)
    if not starts:
        raise ValueError(f"environment {config.environment!r} offers no start state in this world")
    order = start_order(starts, config.max_explorations, config.seed)
    partial = partial_path(out)
    records = read_partial(partial)
    done = {record.index for record in records}
    accepted = AcceptedTasks([task for record in records for task in record.accepted])
    every = heldout_every(settings)
    on_progress(
        f"budget: {config.tasks} tasks, {config.max_explorations} explorations, "
        f"{config.max_minutes:g} min, from {len(starts)} start states of {config.environment}"
        + (f"; resumed: {len(records)} done, {len(accepted.tasks)} tasks ready" if records else "")
        + f"; role model {settings.d0.role_model or 'of the llm section'}"
        + (f"; 1 accepted task in {every} held out for the evaluator" if every else "")
    )
    llm = RoleClients.from_section(build_llm_section(settings), settings.run_dir)
    abstractor_config = settings.section("abstractor", AbstractorConfig)
    explorer = ExplorerDeps(
        summarizer=llm["summarizer"],
        explorer=llm["explorer"],
        config=settings.section("explorer", ExplorerConfig),
        summaries=RejectionCounter(),
        actions=RejectionCounter(),
        labelled=False,
    )
    abstractor = AbstractorDeps(
        llm=llm["abstractor"],
        config=abstractor_config,
        pool=accepted,
        cache_dir=similarity_cache_dir(abstractor_config, settings.run_dir),
    )
    judge = JudgeDeps(
        llm=llm["judge"],
        config=settings.section("judge", JudgeConfig),
        judgments=RejectionCounter(),
    )
    spent_s = sum(record.seconds for record in records)
    began = time.monotonic()
    ended_by = "max_explorations"

    def for_training() -> int:
        return len(split_heldout(accepted.tasks, every)[0])

    try:
        for index, start in enumerate(order):
            if for_training() >= config.tasks:
                ended_by = "tasks"
                break
            if spent_s + time.monotonic() - began >= config.max_minutes * 60:
                ended_by = "max_minutes"
                break
            if index in done:
                continue
            covered = [calls_of(task) for task in accepted.tasks]
            record = await explore_once(
                index, start, settings, (explorer, abstractor, judge), covered
            )
            with partial.open("ab") as handle:
                handle.write(msgspec.json.encode(record) + b"\n")
            records.append(record)
            accepted.tasks.extend(record.accepted)
            on_progress(
                f"exploration {index + 1}/{config.max_explorations} from {start.id}: "
                f"{record.outcome}, {record.candidates} candidates, {len(record.accepted)} "
                f"accepted ({for_training()}/{config.tasks} in all"
                + (f", {len(accepted.tasks) - for_training()} held out" if every else "")
                + f", {record.seconds:.0f} s)"
            )
        else:
            ended_by = "tasks" if for_training() >= config.tasks else "max_explorations"
    finally:
        await llm.aclose()
    minutes = (spent_s + time.monotonic() - began) / 60
    training, heldout = split_heldout(accepted.tasks, every)
    d0 = D0File(
        environment=config.environment,
        classes=classes,
        role_model=role_model(llm),
        code_version=code_version(),
        created_at=datetime.now(UTC).isoformat(timespec="seconds"),
        build=build_counts(records, minutes, len(starts), ended_by, first_tasks_of),
        sha256="",
        tasks=training[: config.tasks],
        heldout=heldout,
    )
    if not d0.tasks:
        raise ValueError(
            f"no task was accepted in {len(records)} explorations ({minutes:.1f} min); "
            f"see {partial}"
        )
    write_d0(out, d0)
    partial.unlink(missing_ok=True)
    return d0


def build_counts(
    records: list[ExplorationRecord],
    minutes: float,
    start_states: int,
    ended_by: str,
    first_tasks_of: int = 0,
) -> D0Build:
    return D0Build(
        minutes=round(minutes, 2),
        explorations=len(records),
        explorations_by_outcome=dict(Counter(record.outcome for record in records)),
        candidates=sum(record.candidates for record in records),
        dropped_by_reason=dict(Counter(r for record in records for r in record.dropped)),
        verdicts_by_outcome=dict(Counter(v for record in records for v in record.verdicts)),
        start_states=start_states,
        ended_by=ended_by,
        first_tasks_of=first_tasks_of,
    )


def role_model(llm: RoleClients) -> str:
    """The model the explorer role ran (the local server's when it names none)."""
    settings = llm["explorer"].settings
    if settings.model and not settings.local:
        return settings.model
    return os.environ.get(MODEL_ENV) or llm.own_server.server.alias


def run_discovery(
    settings: Settings,
    out: Path,
    on_progress: Callable[[str], None] = log.info,
    first_tasks_of: int = 0,
) -> D0File:
    """:func:`discover` from synchronous code."""
    return anyio.run(discover, settings, out, on_progress, first_tasks_of)
