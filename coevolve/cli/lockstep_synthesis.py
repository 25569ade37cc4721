"""The data loop of the lockstep schedule: the last step's rollout groups in, new tasks out.

What the asynchronous services do over NATS, here in this process and in order, with the
services' own functions and configuration sections (so a setting means the same in both
schedules):

1. signal-monitor: :class:`SignalMonitor` over every group (same detectors, thresholds and
   per-task rate limits; section ``signal_monitor``);
2. explorer, for at most ``max_signals`` of the signals: the summarizer's context, then
   exploration rounds in fresh environments (section ``explorer``);
3. abstractor: drafts from each exploration, less those calling unknown functions, those
   close to an evaluation query (the leak guard) and near copies of the pool's tasks or of
   earlier candidates (section ``abstractor``);
4. judge: replay checks, then the LLM's verdict (section ``judge``).

Every verdict is recorded in the pool with ``PoolStore.record_verdict``, as pool-store
records those on the bus: an accepted task joins the pool with its lineage (signal,
context, exploration, candidate, verdict) and is sampled from the next rollout on. The
LLM roles come from the ``llm`` section (``RoleClients.from_section``), as for
``coevolve up``. An unreachable LLM ends the synthesis early (what was judged is kept);
the next due synthesis tries again.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from types import TracebackType

import anyio
from anyio.from_thread import BlockingPortal, start_blocking_portal

from coevolve.services.abstractor.actor import (
    AbstractorConfig,
    PoolQueries,
    abstract_exploration,
    dedup_sample_sizes,
    eval_leak,
    near_duplicate,
    query_texts,
    similarity_cache_dir,
    tools_for,
    unusable_draft,
)
from coevolve.services.abstractor.prompts import draft_to_task
from coevolve.services.explorer.actor import (
    ExplorerConfig,
    exploration_limits,
    exploration_message,
    guided_goal,
    summarize_signal,
)
from coevolve.services.explorer.exploration import explore
from coevolve.services.judge.actor import (
    JudgeConfig,
    ask_judgment,
    judgment_outcome,
    verdict_of,
)
from coevolve.services.judge.replay import replay_candidate
from coevolve.services.pool_store.store import PoolStore
from coevolve.services.signal_monitor.actor import SignalMonitorConfig
from coevolve.services.signal_monitor.detectors import SignalMonitor
from coevolve.shared.config import Settings
from coevolve.shared.envs import Environment, make_environment
from coevolve.shared.llm import LLMUnavailable, RoleClients
from coevolve.shared.messages import (
    Exploration,
    RolloutGroup,
    Signal,
    Task,
    TaskCandidate,
    Verdict,
    derived_id,
)
from coevolve.shared.similarity import LeakGuard
from coevolve.shared.structured import Rejection, RejectionCounter, tool_names

log = logging.getLogger(__name__)

DEFAULT_MAX_SIGNALS = 2


@dataclass
class SynthesisStats:
    """Counts over every synthesis of this run, by what happened."""

    signals: Counter[str] = field(default_factory=Counter)  # by kind, all detected
    explorations: Counter[str] = field(default_factory=Counter)
    dropped: Counter[str] = field(default_factory=Counter)  # drafts, by reason
    verdicts: Counter[str] = field(default_factory=Counter)  # by outcome
    skipped: Counter[str] = field(default_factory=Counter)  # groups and signals left out


class LockstepSynthesis:
    """A ``Synthesizer`` for :class:`~coevolve.shared.lockstep.LockstepLoop`: groups ->
    signals -> explorations -> candidates -> verdicts recorded in ``pool``; returns the
    accepted tasks the pool did not hold yet (origin "synthesized", with lineage).

    The LLM clients live on one event loop (a blocking portal) for the object's lifetime;
    :meth:`close` ends both.
    """

    def __init__(
        self,
        settings: Settings,
        pool: PoolStore,
        *,
        max_signals: int = DEFAULT_MAX_SIGNALS,
        llm: RoleClients | None = None,
    ) -> None:
        if max_signals < 1:
            raise ValueError(f"max_signals must be >= 1, got {max_signals}")
        self.pool = pool
        self.max_signals = max_signals
        detectors = settings.section("signal_monitor", SignalMonitorConfig).detectors
        self.monitor = SignalMonitor(detectors)
        self.explorer = settings.section("explorer", ExplorerConfig)
        self.abstractor = settings.section("abstractor", AbstractorConfig)
        self.judge = settings.section("judge", JudgeConfig)
        self.limits = exploration_limits(self.explorer)
        self.cache_dir = similarity_cache_dir(self.abstractor, settings.run_dir)
        self.queries = PoolQueries(
            self.abstractor.dedup_threshold, self.abstractor.dedup_backend, self.cache_dir
        )
        self._leak_guard: LeakGuard | None = None
        self._own_llm = llm is None
        self.llm = llm or RoleClients.from_section(settings.services.get("llm"), settings.run_dir)
        self.summaries = RejectionCounter()
        self.actions = RejectionCounter()
        self.abstractions = RejectionCounter()
        self.judgments = RejectionCounter()
        self.stats = SynthesisStats()
        self.verdicts: list[Verdict] = []  # of the last call
        self._exit = ExitStack()
        self._portal: BlockingPortal | None = None

    # ------------------------------------------------------------------ the hook

    def __call__(self, groups: list[RolloutGroup]) -> list[Task]:
        """Synthesize from ``groups``, record every verdict; the tasks newly in the pool."""
        signals = self.detect(groups)
        if not signals:
            self.verdicts = []
            return []
        if self._portal is None:
            self._portal = self._exit.enter_context(start_blocking_portal())
        self.verdicts = self._portal.call(self.judged, signals)
        added: list[Task] = []
        for verdict in self.verdicts:
            _, added_task_id = self.pool.record_verdict(verdict)
            if added_task_id is not None:
                added.append(verdict.task)
        return added

    def detect(self, groups: Sequence[RolloutGroup]) -> list[Signal]:
        """The signals of ``groups`` (every group updates the monitor's state), at most
        ``max_signals`` of them, in group order."""
        signals: list[Signal] = []
        for group in groups:
            task = self.pool.get_task(group.task_id)
            if task is None:
                self.stats.skipped["unknown_task"] += 1
                log.warning("group %s: task %s is not in the pool", group.id, group.task_id)
                continue
            signals.extend(self.monitor.process(group, task))
        self.stats.signals.update(signal.kind for signal in signals)
        if len(signals) > self.max_signals:
            self.stats.skipped["signals_over_limit"] += len(signals) - self.max_signals
        return signals[: self.max_signals]

    async def judged(self, signals: Sequence[Signal]) -> list[Verdict]:
        """Explore, abstract and judge each signal in turn: the verdicts."""
        verdicts: list[Verdict] = []
        try:
            for signal in signals:
                exploration = await self.explore(signal)
                if exploration is None:
                    continue
                for candidate in await self.candidates(exploration):
                    verdicts.append(await self.verdict(candidate))
        except LLMUnavailable as exc:
            self.stats.skipped["llm_unavailable"] += 1
            log.error("synthesis stopped early, the LLM is unavailable: %s", exc)
        return verdicts

    # ------------------------------------------------------------------ explorer

    async def explore(self, signal: Signal) -> Exploration | None:
        summary = await summarize_signal(
            self.llm["summarizer"], signal, self.explorer.summary_max_tokens, self.summaries
        )
        context = None if isinstance(summary, Rejection) else summary
        if isinstance(summary, Rejection):
            log.warning("signal %s: summary rejected (%s)", signal.id, summary.kind)
            if self.explorer.on_context_rejection == "drop":
                self.stats.explorations["dropped_without_context"] += 1
                return None
        environment = signal.task.environment

        def make_env() -> Environment:
            return make_environment(environment)

        rounds, explored = await explore(
            self.llm["explorer"],
            make_env,
            signal.task,
            guided_goal(signal, context),
            self.limits,
            self.actions,
        )
        if explored.steps == 0:
            self.stats.explorations["empty"] += 1
            return None
        self.stats.explorations["explored"] += 1
        return exploration_message(
            derived_id("exploration", signal.id),
            "guided",
            signal.task,
            rounds,
            context=context,
            signal=signal,
        )

    # ------------------------------------------------------------------ abstractor

    async def candidates(self, exploration: Exploration) -> list[TaskCandidate]:
        config = self.abstractor
        tools = await anyio.to_thread.run_sync(tools_for, exploration.task)
        outcome = await abstract_exploration(
            self.llm["abstractor"], exploration, tools, config, self.abstractions
        )
        if isinstance(outcome, Rejection):
            log.warning("exploration %s: abstractor output rejected (%s)", exploration.id, outcome)
            return []
        await anyio.to_thread.run_sync(self._refresh_pool_queries)
        known = tool_names(tools)
        for _extra in outcome.tasks[config.max_tasks :]:
            self._drop(exploration, "over_limit", "more drafts than max_tasks")
        candidates: list[TaskCandidate] = []
        for index, draft in enumerate(outcome.tasks[: config.max_tasks]):
            unusable = unusable_draft(draft, known)
            if unusable is not None:
                self._drop(exploration, *unusable)
                continue
            task = draft_to_task(
                draft, exploration, index, signal_evidence=exploration.signal_evidence
            )
            leak = await anyio.to_thread.run_sync(self._leak, task)
            if leak is not None:
                self._drop(exploration, "eval_leak", leak)
                continue
            duplicate = await anyio.to_thread.run_sync(near_duplicate, self.queries, task)
            if duplicate is not None:
                self._drop(exploration, "near_duplicate", duplicate)
                continue
            candidate_id = task.lineage.candidate_id
            assert candidate_id is not None
            candidates.append(
                TaskCandidate(id=candidate_id, exploration_id=exploration.id, task=task)
            )
            self.queries.add(query_texts(task))
        return candidates

    def _drop(self, exploration: Exploration, reason: str, detail: str) -> None:
        self.stats.dropped[reason] += 1
        log.info("exploration %s: draft dropped (%s): %s", exploration.id, reason, detail)

    def _leak(self, task: Task) -> str | None:
        if not self.abstractor.leak_guard:
            return None
        if self._leak_guard is None:
            self._leak_guard = LeakGuard(
                backend=self.abstractor.leak_backend, cache_dir=self.cache_dir
            )
        return eval_leak(self._leak_guard, task)

    def _refresh_pool_queries(self) -> None:
        if time.monotonic() - self.queries.refreshed_at < self.abstractor.dedup_refresh_s:
            return
        self.queries.replace_pool(
            [text for task in pool_sample(self.pool, self.abstractor) for text in query_texts(task)]
        )

    # ------------------------------------------------------------------ judge

    async def verdict(self, candidate: TaskCandidate) -> Verdict:
        task = candidate.task
        environment = task.environment

        def make_env() -> Environment:
            return make_environment(environment)

        check = await anyio.to_thread.run_sync(replay_candidate, task, make_env)
        criteria = dict(check.criteria)
        if not check.passed:
            accepted, reasons, outcome = False, check.problems(), "rejected_by_replay"
        else:
            judged = await ask_judgment(
                self.llm["judge"], task, check, self.judge.max_tokens, self.judgments
            )
            accepted, reasons, llm_criteria, outcome = judgment_outcome(judged)
            criteria.update(llm_criteria)
        self.stats.verdicts[outcome] += 1
        log.info("candidate %s: %s (%s)", candidate.id, outcome, "; ".join(reasons)[:200])
        return verdict_of(candidate, accepted, reasons, criteria, trace_id=None)

    # ------------------------------------------------------------------ lifetime

    def close(self) -> None:
        if self._own_llm:
            if self._portal is not None:
                self._portal.call(self.llm.aclose)
            else:
                anyio.run(self.llm.aclose)
        self._portal = None
        self._exit.close()

    def __enter__(self) -> LockstepSynthesis:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()


def pool_sample(pool: PoolStore, config: AbstractorConfig) -> list[Task]:
    """The pool's tasks the abstractor de-duplicates against: a sample per origin, at
    most ``dedup_pool_limit`` each (as the abstractor asks pool-store for them)."""
    tasks: list[Task] = []
    for origin, size in dedup_sample_sizes(pool.stats().tasks_by_origin, config):
        tasks.extend(pool.sample_batch(size, mix={origin: 1.0}, seed=0))
    return tasks
