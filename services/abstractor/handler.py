"""The abstractor's work without the bus: an exploration in, the task candidates to
publish out.

The abstractor service publishes what :func:`abstract` returns; the lockstep schedule hands
the candidates to the judge's handler itself. The pool's user turns (for de-duplication)
come from a :class:`DedupSource`: pool-store over the bus for the service, the pool file
for the lockstep schedule.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import anyio
from opentelemetry.trace import NoOpTracer, Tracer

from coevolve.services.abstractor.call_units import CallUnit, call_units
from coevolve.services.abstractor.completion import complete_requests, unstated_values
from coevolve.services.abstractor.config import AbstractorConfig, SimilarityBackend
from coevolve.services.abstractor.edits import (
    NO_WORDS,
    NamingWords,
    edit_unit_problems,
    edited_request,
    naming_spans,
    span_messages,
    span_schema,
)
from coevolve.services.abstractor.prompts import (
    MIN_REQUEST_WORDS,
    RequestDraft,
    lacks_plain_words,
    request_messages,
    request_problems,
    request_schema,
    rewrite_messages,
    unit_task,
)
from coevolve.shared.argument_values import salient_values
from coevolve.shared.envs import make_environment
from coevolve.shared.llm import RoleLLM
from coevolve.shared.messages import (
    ChatMessage,
    Exploration,
    PoolStats,
    Task,
    TaskCandidate,
    ToolCall,
)
from coevolve.shared.similarity import MIN_WORDS, LeakGuard, NearDuplicateIndex
from coevolve.shared.structured import Rejection, RejectionCounter, ask_structured, tool_names

log = logging.getLogger(__name__)

# added to the temperature for each rewrite: at the role's 0.7 the 0.5B wrote the same
# refused request three times in a row for 3 of run 26's units
REWRITE_WARMER = 0.3
# the words naming a value, as JSON
EDIT_MAX_TOKENS = 40


RECENT_TEXTS = 500


def _long_enough(text: str) -> bool:
    return len(text.split()) >= MIN_WORDS


def query_texts(task: Task) -> list[str]:
    """What a task asks, for de-duplication: its substantial user turns, or all of them
    joined when none is substantial."""
    turns = [turn for turn in task.user_turns if _long_enough(turn)]
    return turns or ["\n".join(task.user_turns)]


def ground_truth_calls(task: Task) -> list[ToolCall]:
    return [call for turn in task.ground_truth for call in turn]


def names_other_values(text: str, match: str, values: Sequence[Any]) -> bool:
    """Whether ``text`` names one of ``values`` that ``match`` does not name. The explorer's
    variant rounds call the failed function again with other values, and their requests
    differ from each other in those values alone (0.95 similar in n-grams)."""
    text, match = text.lower(), match.lower()
    named = [str(value).lower() for value in values if str(value).lower() in text]
    return any(value not in match for value in named)


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

    def forget(self, texts: Sequence[str]) -> None:
        """Drop recent texts again (of candidates that were never published)."""
        gone = set(texts)
        self._recent_texts = [text for text in self._recent_texts if text not in gone]
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
        a near copy; None when the task asks something new. A near copy in wording that
        names another value than the turn (GOOG for AAPL) is a variant, not a copy."""
        values = [value for _, _, value in salient_values(ground_truth_calls(task))]
        worst: tuple[float, str] | None = None
        for text in query_texts(task):
            score, match = self.nearest(text)
            if match is None or score < self.threshold or names_other_values(text, match, values):
                return None
            if worst is None or score < worst[0]:
                worst = (score, match)
        return worst


class DedupSource(Protocol):
    """Where the pool's tasks come from for de-duplication (``PoolClient`` has this shape)."""

    async def stats(self) -> PoolStats: ...

    async def sample(
        self, size: int, mix: dict[str, float] | None = None, seed: int | None = None
    ) -> list[Task]: ...


@dataclass
class AbstractorDeps:
    """What abstracting needs besides the exploration; kept from one exploration to the
    next (the de-duplication texts, the leak guard once built)."""

    llm: RoleLLM
    config: AbstractorConfig
    pool: DedupSource
    cache_dir: Path
    outputs: RejectionCounter = field(default_factory=RejectionCounter)
    tracer: Tracer = field(default_factory=NoOpTracer)
    queries: PoolQueries = field(init=False)
    leak_guard: LeakGuard | None = None
    lock: anyio.Lock = field(default_factory=anyio.Lock)  # the similarity indexes

    def __post_init__(self) -> None:
        config = self.config
        self.queries = PoolQueries(config.dedup_threshold, config.dedup_backend, self.cache_dir)


@dataclass
class MalformedDraft:
    """A request still unusable after its rewrites, and why."""

    draft: RequestDraft
    problems: list[str]


@dataclass
class Abstraction:
    drafts: int  # call units taken from the exploration, one request asked for each
    candidates: list[TaskCandidate] = field(default_factory=list)
    dropped: list[tuple[str, str]] = field(default_factory=list)  # (reason, detail) a unit
    rejections: list[Rejection] = field(default_factory=list)  # the role's unusable outputs


async def abstract(exploration: Exploration, deps: AbstractorDeps) -> Abstraction:
    """The candidates of ``exploration`` that survive the checks (see the service's
    docstring), in round order: code picks each round's calls (``call_units``), the
    abstractor role writes the request for them; a substitution round's request is the
    parent's, made by code or where the role points (``edit_request``). Each candidate's
    user turns join the de-duplication texts, so later ones (of this exploration and the
    next) are compared with it. Raises ``LLMUnavailable``, and what the pool raises when
    it cannot be reached."""
    config = deps.config
    environment = exploration.task.environment
    tools, conversation = await anyio.to_thread.run_sync(setting_of, exploration.task)
    units = await anyio.to_thread.run_sync(
        lambda: call_units(exploration, lambda: make_environment(environment), config.max_tasks)
    )
    result = Abstraction(drafts=len(units))

    def drop(reason: str, detail: str) -> None:
        result.dropped.append((reason, detail))
        log.info("exploration %s: dropped (%s): %s", exploration.id, reason, detail)

    if not units:
        drop("no_calls", "no call of the exploration replays from its start state")
        return result
    await refresh_pool_queries(deps)
    for index, unit in enumerate(units):
        if unit.calls in exploration.task.ground_truth:
            # the parent turn again: its request would be a copy (nothing asked of the LLM)
            drop("parent_calls", "the unit makes exactly a turn of the parent's calls")
            continue
        draft: RequestDraft | Rejection | MalformedDraft
        with deps.tracer.start_as_current_span("abstractor abstract"):
            if unit.request is not None:
                description = substitution_description(unit.request)
                draft = RequestDraft(description=description, request=unit.request)
            elif unit.replaced is not None:
                draft = await edit_request(
                    deps.llm, exploration, unit, config, deps.outputs, conversation
                )
            else:
                draft = await write_request(
                    deps.llm, exploration, unit, tools, config, deps.outputs, conversation
                )
        if isinstance(draft, Rejection):
            result.rejections.append(draft)
            continue
        if isinstance(draft, MalformedDraft):
            drop("malformed_request", f"{draft.draft.request!r}: " + "; ".join(draft.problems))
            continue
        task = unit_task(
            draft, unit, exploration, index, signal_evidence=exploration.signal_evidence
        )
        # a substitution's or a composition's request is its turns', which said what
        # their calls needed
        by_code = unit.replaced is not None or unit.composed_from or unit.varied_state
        if config.complete_values and not by_code:
            task, added = await anyio.to_thread.run_sync(complete_requests, task)
            if added:
                log.info("exploration %s: unit %d: %d values added", exploration.id, index, added)
        leak = await leak_of(deps, task)
        if leak is not None:
            drop("eval_leak", leak)
            continue
        duplicate = await anyio.to_thread.run_sync(near_duplicate, deps.queries, task)
        if duplicate is not None:
            drop("near_duplicate", duplicate)
            continue
        candidate_id = task.lineage.candidate_id
        assert candidate_id is not None
        result.candidates.append(
            TaskCandidate(id=candidate_id, exploration_id=exploration.id, task=task)
        )
        await anyio.to_thread.run_sync(deps.queries.add, query_texts(task))
    return result


async def leak_of(deps: AbstractorDeps, task: Task) -> str | None:
    """Why ``task`` leaks an evaluation query; None when it does not (or the guard is off)."""
    if not deps.config.leak_guard:
        return None
    async with deps.lock:
        if deps.leak_guard is None:
            # Building the embedding index takes a minute on a CPU the first time
            # (cached in the run directory afterwards): done on first use, not at start.
            deps.leak_guard = await anyio.to_thread.run_sync(
                lambda: LeakGuard(backend=deps.config.leak_backend, cache_dir=deps.cache_dir)
            )
    return await anyio.to_thread.run_sync(eval_leak, deps.leak_guard, task)


async def refresh_pool_queries(deps: AbstractorDeps) -> None:
    """Fetch the pool's user turns again when the last fetch is ``dedup_refresh_s`` old."""
    if time.monotonic() - deps.queries.refreshed_at < deps.config.dedup_refresh_s:
        return
    stats = await deps.pool.stats()
    texts: list[str] = []
    for origin, size in dedup_sample_sizes(stats.tasks_by_origin, deps.config):
        tasks = await deps.pool.sample(size, mix={origin: 1.0}, seed=0)
        texts.extend(text for task in tasks for text in query_texts(task))
    async with deps.lock:
        await anyio.to_thread.run_sync(deps.queries.replace_pool, texts)
    log.info("de-duplicating against %d user turns of the pool", len(texts))


def similarity_cache_dir(config: AbstractorConfig, run_dir: Path) -> Path:
    """Where the similarity backends cache their indexes (embedding matrices)."""
    if config.similarity_cache_dir:
        return Path(config.similarity_cache_dir)
    return run_dir / "cache" / "similarity"


def tools_for(task: Task) -> list[dict[str, Any]]:
    """The functions a task's environment offers from its initial state."""
    return setting_of(task)[0]


def setting_of(task: Task) -> tuple[list[dict[str, Any]], list[ChatMessage]]:
    """The functions a task's environment offers from its initial state, and the
    conversation before its request (the earlier turns the environment replays), which a
    candidate of the same state continues. Blocking (run it in a worker thread)."""
    environment = make_environment(task.environment)
    try:
        messages = environment.reset(task)
        return environment.tools(), [m for m in messages[:-1] if m.role != "system"]
    finally:
        environment.close()


async def write_request(
    llm: RoleLLM,
    exploration: Exploration,
    unit: CallUnit,
    tools: list[dict[str, Any]],
    config: AbstractorConfig,
    counter: RejectionCounter,
    conversation: Sequence[ChatMessage] = (),
) -> RequestDraft | Rejection | MalformedDraft:
    """The abstractor role's request for ``unit``, continuing ``conversation``; why its
    output is unusable (counted); or its last draft with the problems still left after
    ``config.rewrites`` retries. A request that leaves out a value its calls need (and
    the conversation does not give) is asked for again, naming the values."""
    messages = request_messages(exploration, unit, tools, conversation, config.show_results)
    known = tool_names(tools)
    context = "\n".join(m.content for m in conversation)
    needed = [value for _, value in unstated_values("", unit.calls, unit.observations, context)]
    # a unit whose values the conversation already says still gets the prose pattern: a
    # 0.5B copied "get_stock_info(symbol=NVDA); place_order(..." where none was set
    schema = request_schema(needed, prose=True) if config.constrain_values else request_schema()
    rewrites = 0
    while True:
        draft = await ask_structured(
            llm,
            messages,
            RequestDraft,
            schema=schema,
            max_tokens=config.max_tokens,
            temperature=llm.settings.temperature + REWRITE_WARMER * rewrites,
            counter=counter,
        )
        if isinstance(draft, Rejection):
            return draft
        problems = request_problems(draft, known, [call.name for call in unit.calls], tools)
        unstated = unstated_values(draft.request, unit.calls, unit.observations, context)
        if unstated:
            values = "; ".join(f"{p.replace('_', ' ')} {v!r}" for p, v in unstated)
            problems.append(f"it does not say these values the calls need: {values}")
        if not problems:
            return draft
        if rewrites == config.rewrites:
            return MalformedDraft(draft, problems)
        rewrites += 1
        log.info(
            "exploration %s: request %r rewritten: %s", exploration.id, draft.request, problems
        )
        if config.constrain_values and lacks_plain_words(problems):
            schema = request_schema(needed, prose=True, lead_words=MIN_REQUEST_WORDS)
        messages = rewrite_messages(messages, draft, problems)


def substitution_description(request: str) -> str:
    """A substitution's description is its request: the judge checks that a description's
    quoted values and numbers are used, and the old value no longer is."""
    return request


async def edit_request(
    llm: RoleLLM,
    exploration: Exploration,
    unit: CallUnit,
    config: AbstractorConfig,
    counter: RejectionCounter,
    conversation: Sequence[ChatMessage] = (),
) -> RequestDraft | Rejection | MalformedDraft:
    """The parent's request with the words the abstractor role says name the unit's old
    value written as its new one (``edits.py``); a choice that does not fit is taken out
    of the offered words and asked again, up to ``config.rewrites`` times."""
    assert unit.replaced is not None
    old, new = unit.replaced
    parent_request = exploration.task.user_turns[0]
    messages = span_messages(parent_request, exploration.task.ground_truth[0], old, conversation)
    spans = naming_spans(parent_request, exploration.task.ground_truth[0])
    draft = RequestDraft(description=parent_request, request=parent_request)
    problems = ["the request names no value in words"]
    for attempt in range(config.rewrites + 1):
        if not spans:
            break
        answer = await ask_structured(
            llm,
            messages,
            NamingWords,
            schema=span_schema(spans),
            max_tokens=EDIT_MAX_TOKENS,
            temperature=llm.settings.temperature + REWRITE_WARMER * attempt,
            counter=counter,
        )
        if isinstance(answer, Rejection):
            return answer
        if answer.words == NO_WORDS:
            return MalformedDraft(draft, [f"no words of the request name {old!r}"])
        edited = edited_request(parent_request, answer.words, new)
        draft = RequestDraft(substitution_description(edited), edited)
        problems = edit_unit_problems(unit, draft.request, answer.words, parent_request)
        if not problems:
            return draft
        spans = [span for span in spans if span != answer.words]
    return MalformedDraft(draft, problems)


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
    if task.lineage.composed_from and any(match != t and match in t for t in task.user_turns):
        return None  # a composed turn holds its atoms' requests: that is no copy
    if task.lineage.varied_state and match in task.user_turns:
        return None  # the parent's request on another state: another task
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
