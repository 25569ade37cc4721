"""The data loop of the lockstep schedule: the last steps' rollout groups in, new tasks out.

What the asynchronous services do over NATS, here in this process and in order, with the
services' own handlers and configuration sections (so a setting means the same in both
schedules):

1. signal-monitor: :class:`SignalMonitor` over every group (section ``signal_monitor``);
2. explorer, for at most ``max_signals`` of the signals: ``explore_signal`` (``explorer``);
3. abstractor: ``abstract`` on each exploration, de-duplicating against the pool file
   (``abstractor``);
4. judge: ``judge_candidate`` on each candidate (``judge``).

Every verdict is recorded in the pool with ``PoolStore.record_verdict``, as pool-store
records those on the bus: an accepted task joins the pool with its lineage and is sampled
from the next rollout on. The LLM roles come from the ``llm`` section, as for
``coevolve up``. An unreachable LLM ends the synthesis early (what was judged is kept);
the next due synthesis tries again.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field

import anyio
from anyio.from_thread import BlockingPortal, start_blocking_portal

from coevolve.services.abstractor.config import AbstractorConfig
from coevolve.services.abstractor.handler import AbstractorDeps, abstract, similarity_cache_dir
from coevolve.services.explorer.config import ExplorerConfig
from coevolve.services.explorer.handler import ExplorerDeps, explore_signal
from coevolve.services.judge.config import JudgeConfig
from coevolve.services.judge.handler import JudgeDeps, judge_candidate
from coevolve.services.pool_store.store import PoolStore
from coevolve.services.signal_monitor.config import SignalMonitorConfig
from coevolve.services.signal_monitor.handler import SignalMonitor
from coevolve.shared.config import Settings
from coevolve.shared.llm import LLMUnavailable, RoleClients
from coevolve.shared.messages import PoolStats, RolloutGroup, Signal, Task, Verdict
from coevolve.shared.structured import RejectionCounter

log = logging.getLogger(__name__)

DEFAULT_MAX_SIGNALS = 2


@dataclass
class SynthesisStats:
    """Counts over every synthesis of this run, by what happened."""

    signals: Counter[str] = field(default_factory=Counter)  # by kind, all detected
    explorations: Counter[str] = field(default_factory=Counter)  # by outcome
    dropped: Counter[str] = field(default_factory=Counter)  # drafts, by reason
    verdicts: Counter[str] = field(default_factory=Counter)  # by outcome
    skipped: Counter[str] = field(default_factory=Counter)  # groups and signals left out


@dataclass
class PoolFile:
    """The abstractor's ``DedupSource`` over the pool file (pool-store's answers, without
    the bus)."""

    store: PoolStore

    async def stats(self) -> PoolStats:
        return await anyio.to_thread.run_sync(self.store.stats)

    async def sample(
        self, size: int, mix: dict[str, float] | None = None, seed: int | None = None
    ) -> list[Task]:
        return await anyio.to_thread.run_sync(
            lambda: self.store.sample_batch(size, mix=mix, seed=seed)
        )


class LockstepSynthesis:
    """A ``Synthesizer`` for :class:`~coevolve.schedules.lockstep.LockstepLoop`: groups ->
    signals -> explorations -> candidates -> verdicts recorded in ``pool``; returns the
    accepted tasks the pool did not hold yet (origin "synthesized", with lineage).

    The LLM clients live on one event loop (a blocking portal) for the object's lifetime;
    :meth:`close` ends both (``contextlib.closing`` does it for a ``with`` block).
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
        self._own_llm = llm is None
        self.llm = llm or RoleClients.from_section(settings.services.get("llm"), settings.run_dir)
        self.explorer = ExplorerDeps(
            summarizer=self.llm["summarizer"],
            explorer=self.llm["explorer"],
            config=settings.section("explorer", ExplorerConfig),
            summaries=RejectionCounter(),
            actions=RejectionCounter(),
            labelled=settings.labels != "none",
        )
        abstractor = settings.section("abstractor", AbstractorConfig)
        self.abstractor = AbstractorDeps(
            llm=self.llm["abstractor"],
            config=abstractor,
            pool=PoolFile(pool),
            cache_dir=similarity_cache_dir(abstractor, settings.run_dir),
        )
        self.judge = JudgeDeps(
            llm=self.llm["judge"],
            config=settings.section("judge", JudgeConfig),
            judgments=RejectionCounter(),
        )
        self.stats = SynthesisStats()
        self.verdicts: list[Verdict] = []  # of the last call
        self._exit = ExitStack()
        self._portal: BlockingPortal | None = None

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
                explored = await explore_signal(signal, self.explorer)
                self.stats.explorations[explored.outcome] += 1
                for exploration in explored.explorations:  # variants, then composed turns
                    abstraction = await abstract(exploration, self.abstractor)
                    self.stats.dropped.update(reason for reason, _ in abstraction.dropped)
                    for candidate in abstraction.candidates:
                        judged = await judge_candidate(candidate, self.judge)
                        self.stats.verdicts[judged.outcome] += 1
                        verdicts.append(judged.verdict)
        except LLMUnavailable as exc:
            self.stats.skipped["llm_unavailable"] += 1
            log.error("synthesis stopped early, the LLM is unavailable: %s", exc)
        return verdicts

    def close(self) -> None:
        if self._own_llm:
            if self._portal is not None:
                self._portal.call(self.llm.aclose)
            else:
                anyio.run(self.llm.aclose)
        self._portal = None
        self._exit.close()
