"""abstractor: explorations in, task candidates out (``coevolve.candidates``).

Code picks the calls (``call_units.py``): each round of the exploration gives at most one
unit, its successful calls replayed from the start state and cut to the minimal sequence
(a question of one call when none changes the state), at most ``max_tasks`` units. For
each unit one LLM call writes the user's request and a description
(``request_schema``), so the calls of a candidate are always calls the exploration made,
never ones the LLM invented. A unit is dropped, with a counted reason, when

- no call of the exploration replays: ``no_calls``;
- its request is malformed (empty, under three plain words, a function's name):
  ``malformed_request``;
- it asks what an evaluation query asks (the eval ``LeakGuard``): ``eval_leak``;
- it asks nothing new: every user turn of at least ``MIN_WORDS`` words is within
  ``dedup_threshold`` of a user turn already in the pool, or of a candidate this instance
  published since its last look at the pool: ``near_duplicate``.

Before those checks each request gets the argument values it leaves out
(``completion.py``). Survivors become :class:`TaskCandidate` s with ids derived from the
exploration id and the unit's position, their lineage filled by ``unit_task``. The pool's
user turns are fetched from pool-store (one ``SampleBatch`` per origin, capped at
``dedup_pool_limit``) every ``dedup_refresh_s``; without pool-store the exploration is
retried later.

The work is ``handler.abstract`` (no bus); this actor publishes the candidates it returns
and reports the counts.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence
from typing import Any

from coevolve.services.abstractor.config import AbstractorConfig
from coevolve.services.abstractor.handler import (
    AbstractorDeps,
    PoolQueries,
    abstract,
    query_texts,
    similarity_cache_dir,
)
from coevolve.shared.config import Settings
from coevolve.shared.llm import RoleClients
from coevolve.shared.llm.role_actor import RoleActor
from coevolve.shared.messages import Exploration
from coevolve.shared.pool_client import PoolClient
from coevolve.shared.runtime.actor import Actor, Consumer, Delivery
from coevolve.shared.runtime.subjects import ABSTRACTOR_CONSUMER, CANDIDATES
from coevolve.shared.structured import RejectionCounter, report_rejection

__all__ = ["AbstractorActor", "PoolQueries", "build", "query_texts"]

log = logging.getLogger(__name__)


class AbstractorActor(RoleActor):
    name = "abstractor"
    roles = ("abstractor",)

    def __init__(self, settings: Settings, llm: RoleClients | None = None) -> None:
        super().__init__(settings, llm)
        self.config = settings.section(self.name, AbstractorConfig)
        self.cache_dir = similarity_cache_dir(self.config, settings.run_dir)
        self.outputs = RejectionCounter()
        self.dropped: Counter[str] = Counter()
        self.candidates = 0
        self._deps: AbstractorDeps | None = None

    async def setup(self) -> None:
        self._deps = AbstractorDeps(
            llm=self.llm["abstractor"],
            config=self.config,
            pool=PoolClient(self.bus),
            cache_dir=self.cache_dir,
            outputs=self.outputs,
            tracer=self.tracer,
        )

    def consumers(self) -> Sequence[Consumer[Any]]:
        return (
            Consumer(
                ABSTRACTOR_CONSUMER, Exploration, self.on_exploration, self.config.concurrency
            ),
        )

    async def on_exploration(self, exploration: Exploration, _: Delivery) -> None:
        assert self._deps is not None
        result = await abstract(exploration, self._deps)
        for rejection in result.rejections:
            about = f"exploration {exploration.id}"
            await report_rejection(self.metric, "abstractor", self.outputs, rejection, about)
        for reason, _detail in result.dropped:
            self.dropped[reason] += 1
            await self.metric("drafts_dropped", self.dropped[reason], reason=reason)
        for position, candidate in enumerate(result.candidates):
            try:
                await self.publish(CANDIDATES, candidate)
            except BaseException:
                # unpublished candidates must not count as near copies when the
                # exploration comes back
                unpublished = result.candidates[position:]
                texts = [text for c in unpublished for text in query_texts(c.task)]
                self._deps.queries.forget(texts)  # not awaited: it runs when cancelled too
                raise
            self.candidates += 1
            await self.metric("candidates", self.candidates)
        log.info(
            "exploration %s: %d call units, %d candidates so far, dropped %s",
            exploration.id,
            result.drafts,
            self.candidates,
            dict(self.dropped),
        )


def build(settings: Settings) -> Actor:
    return AbstractorActor(settings)
