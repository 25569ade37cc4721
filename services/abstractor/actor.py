"""abstractor: explorations in, task candidates out (``coevolve.candidates``).

One LLM call per exploration (``candidate_schema``: with ``constrain_calls`` each call is
constrained to a function the environment offers) returns up to ``max_tasks`` drafts. A
draft is dropped, with a counted reason, when it

- is malformed or calls a function that does not exist (``draft_problems``):
  ``malformed_draft`` / ``unknown_function``;
- asks what an evaluation query asks (the eval ``LeakGuard``): ``eval_leak``;
- asks nothing new: every user turn of at least ``MIN_WORDS`` words is within
  ``dedup_threshold`` of a user turn already in the pool, or of a candidate this instance
  published since its last look at the pool: ``near_duplicate``.

Survivors become :class:`TaskCandidate` s with ids derived from the exploration id and the
draft's position, their lineage filled by ``draft_to_task``. The pool's user turns are
fetched from pool-store (one ``SampleBatch`` per origin, capped at ``dedup_pool_limit``)
every ``dedup_refresh_s``; without pool-store the exploration is retried later.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import anyio
import msgspec

from coevolve.services.abstractor.prompts import (
    AbstractionOutput,
    CandidateDraft,
    abstraction_messages,
    candidate_schema,
    draft_problems,
    draft_to_task,
)
from coevolve.shared.actor import Actor, Consumer, Delivery
from coevolve.shared.config import Settings
from coevolve.shared.envs import make_environment
from coevolve.shared.llm import RoleClients, RoleLLM
from coevolve.shared.messages import Exploration, Task, TaskCandidate
from coevolve.shared.pool_client import PoolClient
from coevolve.shared.similarity import MIN_WORDS, LeakGuard, NearDuplicateIndex
from coevolve.shared.structured import (
    Rejection,
    RejectionCounter,
    ask_structured,
    report_rejection,
    tool_names,
)
from coevolve.shared.subjects import ABSTRACTOR_CONSUMER, CANDIDATES

log = logging.getLogger(__name__)

SimilarityBackend = Literal["auto", "embedding", "ngram"]

RECENT_TEXTS = 500


class AbstractorConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    max_tasks: int = 2
    max_turns: int = 3
    max_tokens: int = 600
    constrain_calls: bool = True
    dedup_threshold: float = 0.7
    dedup_backend: SimilarityBackend = "ngram"
    dedup_refresh_s: float = 120.0
    dedup_pool_limit: int = 2000
    leak_guard: bool = True
    leak_backend: SimilarityBackend = "auto"
    similarity_cache_dir: str | None = None
    concurrency: int = 1


def _long_enough(text: str) -> bool:
    return len(text.split()) >= MIN_WORDS


def query_texts(task: Task) -> list[str]:
    """What a task asks, for de-duplication: its substantial user turns, or all of them
    joined when none is substantial."""
    turns = [turn for turn in task.user_turns if _long_enough(turn)]
    return turns or ["\n".join(task.user_turns)]


class PoolQueries:
    """Near-duplicate search against the pool's user turns plus recently published ones.

    The pool part is rebuilt on refresh; the recent part (the last ``RECENT_TEXTS``) is
    small and rebuilt on every addition, so neither backend needs an incremental index.
    """

    def __init__(self, threshold: float, backend: SimilarityBackend, cache_dir: Path) -> None:
        self.threshold = threshold
        self.backend = backend
        self.cache_dir = cache_dir
        self.refreshed_at = float("-inf")
        self._pool = NearDuplicateIndex([], backend="ngram")
        self._recent_texts: list[str] = []
        self._recent = NearDuplicateIndex([], backend="ngram")

    def replace_pool(self, texts: Sequence[str]) -> None:
        self._pool = NearDuplicateIndex(
            list(dict.fromkeys(texts)), backend=self.backend, cache_dir=self.cache_dir
        )
        self.refreshed_at = time.monotonic()

    def add(self, texts: Sequence[str]) -> None:
        # Kept across pool refreshes: a candidate reaches the pool only after its verdict.
        self._recent_texts = [*self._recent_texts, *texts][-RECENT_TEXTS:]
        self._recent = NearDuplicateIndex(self._recent_texts, backend=self.backend)

    def nearest(self, text: str) -> tuple[float, str | None]:
        best: tuple[float, str | None] = (0.0, None)
        for index in (self._pool, self._recent):
            score, position = index.nearest(text)
            if position >= 0 and score > best[0]:
                best = (score, index.texts[position])
        return best

    def duplicate_of(self, task: Task) -> tuple[float, str] | None:
        """(similarity, matched pool text) of the least novel turn when every turn has
        a near copy; None when the task asks something new."""
        worst: tuple[float, str] | None = None
        for text in query_texts(task):
            score, match = self.nearest(text)
            if match is None or score < self.threshold:
                return None
            if worst is None or score < worst[0]:
                worst = (score, match)
        return worst


class AbstractorActor(Actor):
    name = "abstractor"

    def __init__(self, settings: Settings, llm: RoleClients | None = None) -> None:
        super().__init__(settings)
        self.config = settings.section(self.name, AbstractorConfig)
        self._own_llm = llm is None
        self.llm = llm or RoleClients.from_section(
            settings.services.get("llm"), settings.run_dir, roles=("abstractor",)
        )
        cache_dir = similarity_cache_dir(self.config, settings.run_dir)
        self.cache_dir = cache_dir
        self.queries = PoolQueries(
            self.config.dedup_threshold, self.config.dedup_backend, cache_dir
        )
        self.outputs = RejectionCounter()
        self.dropped: Counter[str] = Counter()
        # ids of recent candidates published (bounded: the service runs for days)
        self.published: deque[str] = deque(maxlen=RECENT_TEXTS * 20)
        self.candidates = 0
        self._leak_guard: LeakGuard | None = None
        self._similarity_lock = anyio.Lock()
        self._pool: PoolClient | None = None

    async def setup(self) -> None:
        self._pool = PoolClient(self.bus)

    async def teardown(self) -> None:
        if self._own_llm:
            await self.llm.aclose()

    def consumers(self) -> Sequence[Consumer[Any]]:
        return (
            Consumer(
                ABSTRACTOR_CONSUMER, Exploration, self.on_exploration, self.config.concurrency
            ),
        )

    async def on_exploration(self, exploration: Exploration, _: Delivery) -> None:
        tools = await anyio.to_thread.run_sync(tools_for, exploration.task)
        known = tool_names(tools)
        with self.tracer.start_as_current_span("abstractor abstract"):
            outcome = await abstract_exploration(
                self.llm["abstractor"], exploration, tools, self.config, self.outputs
            )
        if isinstance(outcome, Rejection):
            about = f"exploration {exploration.id}"
            await report_rejection(self.metric, "abstractor", self.outputs, outcome, about)
            return
        await self._refresh_pool_queries()
        drafts = outcome.tasks
        for _extra in drafts[self.config.max_tasks :]:
            await self._drop(exploration, "over_limit", "more drafts than max_tasks")
        for index, draft in enumerate(drafts[: self.config.max_tasks]):
            unusable = unusable_draft(draft, known)
            if unusable is not None:
                await self._drop(exploration, *unusable)
                continue
            task = draft_to_task(
                draft, exploration, index, signal_evidence=exploration.signal_evidence
            )
            leak = await self._leak(task)
            if leak is not None:
                await self._drop(exploration, "eval_leak", leak)
                continue
            duplicate = await anyio.to_thread.run_sync(near_duplicate, self.queries, task)
            if duplicate is not None:
                await self._drop(exploration, "near_duplicate", duplicate)
                continue
            candidate_id = task.lineage.candidate_id
            assert candidate_id is not None
            await self.publish(
                CANDIDATES,
                TaskCandidate(id=candidate_id, exploration_id=exploration.id, task=task),
            )
            await anyio.to_thread.run_sync(self.queries.add, query_texts(task))
            self.published.append(candidate_id)
            self.candidates += 1
            await self.metric("candidates", self.candidates)
        log.info(
            "exploration %s: %d drafts, %d candidates so far, dropped %s",
            exploration.id,
            len(drafts),
            self.candidates,
            dict(self.dropped),
        )

    async def _drop(self, exploration: Exploration, reason: str, detail: str) -> None:
        self.dropped[reason] += 1
        log.info("exploration %s: draft dropped (%s): %s", exploration.id, reason, detail)
        await self.metric("drafts_dropped", self.dropped[reason], reason=reason)

    async def _leak(self, task: Task) -> str | None:
        """Why ``task`` leaks an evaluation query; None when it does not."""
        if not self.config.leak_guard:
            return None
        async with self._similarity_lock:
            if self._leak_guard is None:
                # Building the embedding index takes a minute on a CPU the first time
                # (cached in the run directory afterwards): done on first use, not at start.
                self._leak_guard = await anyio.to_thread.run_sync(
                    lambda: LeakGuard(backend=self.config.leak_backend, cache_dir=self.cache_dir)
                )
        return await anyio.to_thread.run_sync(eval_leak, self._leak_guard, task)

    async def _refresh_pool_queries(self) -> None:
        if time.monotonic() - self.queries.refreshed_at < self.config.dedup_refresh_s:
            return
        assert self._pool is not None
        stats = await self._pool.stats()
        texts: list[str] = []
        for origin, size in dedup_sample_sizes(stats.tasks_by_origin, self.config):
            tasks = await self._pool.sample(size, mix={origin: 1.0}, seed=0)
            texts.extend(text for task in tasks for text in query_texts(task))
        async with self._similarity_lock:
            await anyio.to_thread.run_sync(self.queries.replace_pool, texts)
        log.info("de-duplicating against %d user turns of the pool", len(texts))


def similarity_cache_dir(config: AbstractorConfig, run_dir: Path) -> Path:
    """Where the similarity backends cache their indexes (embedding matrices)."""
    if config.similarity_cache_dir:
        return Path(config.similarity_cache_dir)
    return run_dir / "cache" / "similarity"


def tools_for(task: Task) -> list[dict[str, Any]]:
    """The functions a task's environment offers from its initial state."""
    environment = make_environment(task.environment)
    try:
        environment.reset(task)
        return environment.tools()
    finally:
        environment.close()


async def abstract_exploration(
    llm: RoleLLM,
    exploration: Exploration,
    tools: list[dict[str, Any]],
    config: AbstractorConfig,
    counter: RejectionCounter,
) -> AbstractionOutput | Rejection:
    """The abstractor role's drafts for ``exploration`` (calls constrained to ``tools``
    when ``config.constrain_calls``), or why its output is unusable (counted)."""
    return await ask_structured(
        llm,
        abstraction_messages(exploration, config.max_tasks),
        AbstractionOutput,
        schema=candidate_schema(
            tools if config.constrain_calls else None,
            max_tasks=config.max_tasks,
            max_turns=config.max_turns,
        ),
        max_tokens=config.max_tokens,
        temperature=llm.settings.temperature,
        counter=counter,
    )


def unusable_draft(draft: CandidateDraft, known_functions: set[str]) -> tuple[str, str] | None:
    """(drop reason, detail) when ``draft`` cannot become a task; None when it can."""
    problems = draft_problems(draft, known_functions)
    if not problems:
        return None
    reason = "unknown_function" if any("do not exist" in p for p in problems) else "malformed_draft"
    return reason, "; ".join(problems)


def eval_leak(guard: LeakGuard, task: Task) -> str | None:
    """Why ``task`` leaks an evaluation query (its first flagged turn); None when it does
    not. Blocking (run it in a worker thread)."""
    for turn in task.user_turns:
        flagged, score, match = guard.flags(turn)
        if flagged:
            return f"{score:.2f} similar to eval query {(match or '')[:80]!r}"
    return None


def near_duplicate(queries: PoolQueries, task: Task) -> str | None:
    """What ``task`` nearly copies, in words; None when it asks something new."""
    duplicate = queries.duplicate_of(task)
    if duplicate is None:
        return None
    score, match = duplicate
    return f"{score:.2f} similar to {match[:80]!r}"


def dedup_sample_sizes(
    tasks_by_origin: dict[str, int], config: AbstractorConfig
) -> list[tuple[str, int]]:
    """(origin, tasks to sample) for the de-duplication texts: every origin with tasks,
    at most ``dedup_pool_limit`` each."""
    return [
        (origin, min(count, config.dedup_pool_limit))
        for origin, count in sorted(tasks_by_origin.items())
        if count > 0
    ]


def build(settings: Settings) -> Actor:
    return AbstractorActor(settings)
