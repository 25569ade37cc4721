"""Malformed LLM output anywhere in the data loop is a counted rejection with its reason;
the services stay up and the next message goes through. An unreachable LLM endpoint makes
the explorer hand the signal back, and the work completes once the endpoint is up."""

from __future__ import annotations

import json
from typing import Any, ClassVar

import pytest

from coevolve.services.abstractor.actor import AbstractorActor
from coevolve.services.explorer.actor import ExplorerActor
from coevolve.services.judge.actor import JudgeActor
from coevolve.services.pool_store.actor import PoolStoreActor
from coevolve.services.pool_store.store import PoolStore
from coevolve.shared.config import Settings
from coevolve.shared.messages import Signal, Task, derived_id
from coevolve.shared.runtime.subjects import signal_subject
from tests.dataloop.dataloop_harness import (
    WellFormedBrain,
    data_loop,
    explorer_alone,
    filesystem_seed_tasks,
    mixed_group,
    serve_data_loop,
)
from tests.support.fake_llm import Answer, RoleFakeLLM
from tests.support.wait import wait_until

pytestmark = pytest.mark.anyio


def boundary_signal(task: Task) -> Signal:
    group = mixed_group(task)
    return Signal(
        id=derived_id("signal", group.id, "boundary"),
        kind="boundary",
        task=task,
        trajectory=group.trajectories[1],
        group_id=group.id,
        policy_version=1,
        evidence={"successes": 2, "failures": 2, "success_actions": ["cd"]},
    )


class FirstAnswerMalformed(WellFormedBrain):
    """The first answer of each role is broken in its own way, later ones are fine."""

    BROKEN: ClassVar[dict[str, Answer]] = {
        # cut off mid-document by the token limit
        "summarizer": Answer('{"summary":"The agent tried to crea', finish_reason="length"),
        # valid JSON, wrong fields
        "explorer": Answer('{"function":"ls","args":{}}'),
        # nothing at all
        "abstractor": Answer(""),
        # far more than any judgment: refused unread
        "judge": Answer(json.dumps({"reason": "x" * 50_000})),
    }

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[str] = set()

    def __call__(self, role: str, request: dict[str, Any]) -> Answer:
        if role not in self.seen:
            self.seen.add(role)
            return self.BROKEN[role]
        return super().__call__(role, request)


async def test_malformed_outputs_are_counted_rejections_and_services_go_on(
    settings: Settings,
) -> None:
    tasks = filesystem_seed_tasks(3, missing=("touch", "mkdir"))
    # the good drafts differ only in a folder name: no de-duplication between them
    fake = serve_data_loop(settings, FirstAnswerMalformed(), max_tasks=1, dedup_threshold=1.5)
    explorer, abstractor, judge = (
        ExplorerActor(settings),
        AbstractorActor(settings),
        JudgeActor(settings),
    )
    actors = [PoolStoreActor(settings), explorer, abstractor, judge]
    async with data_loop(settings, fake, actors) as loop:
        for task in tasks:
            await loop.bus.publish(signal_subject("boundary"), boundary_signal(task))

        async def two_verdicts() -> bool:
            stats = await loop.pool.stats()
            return stats.accepted_candidates + stats.rejected_candidates >= 2

        await wait_until(two_verdicts, 60, "two verdicts")
        stats = await loop.pool.stats()
        failed = sum(runner.stats.failed for runner in loop.runners)
        dead = sum(runner.stats.dead_lettered for runner in loop.runners)

    # signal 1: truncated summary -> explored without context; the first action had the
    # wrong fields (skipped step); the abstraction was empty -> no candidate.
    assert explorer.summaries.rejected == {"truncated": 1} and explorer.summaries.accepted == 2
    assert explorer.actions.rejected == {"wrong_schema": 1}
    assert explorer.outcomes == {"published": 3}
    assert abstractor.outputs.rejected == {"empty": 1} and abstractor.outputs.accepted == 2
    # signal 2: the judge's answer was too large -> rejected verdict with the reason;
    # signal 3: all well-formed -> accepted.
    assert judge.judgments.rejected == {"too_large": 1}
    assert judge.outcomes == {"judge_output_rejected": 1, "accepted": 1}
    assert stats.accepted_candidates == 1 and stats.rejected_candidates == 1
    assert failed == 0 and dead == 0  # nothing crashed, nothing was retried

    with PoolStore.open_readonly(settings.run_dir / "pool.duckdb") as store:
        [(reasons,)] = store._query("SELECT reasons FROM verdicts WHERE NOT accepted")
        contexts = store._query("SELECT lineage->>'context' FROM verdicts")
    assert json.loads(reasons)[0].startswith("judge output unusable (too_large)")
    assert all(context not in (None, "null") for (context,) in contexts)


async def test_unreachable_llm_hands_the_signal_back_until_it_answers(
    settings: Settings, seed_task: Task
) -> None:
    fake = RoleFakeLLM(WellFormedBrain())  # not started yet: connections are refused
    settings.services.update(
        llm=fake.llm_section(max_retries=1, give_up_after_s=0.5),
        explorer={"rounds": 1, "max_steps": 1, "summarize_aimed": True, "substitution_rounds": 0},
    )
    explorer = ExplorerActor(settings)
    signal = boundary_signal(seed_task)
    async with explorer_alone(settings, fake, explorer) as (bus, published, runner):
        await bus.publish(signal_subject("boundary"), signal)
        await wait_until(lambda: runner.stats.failed >= 1, 20, "a failed attempt")
        assert not published.explorations
        fake.start()
        await wait_until(lambda: published.explorations, 30, "the exploration after recovery")
    assert published.explorations == [derived_id("exploration", signal.id)]
    assert runner.stats.dead_lettered == 0 and runner.stats.processed == 1
    # the summary succeeded after the endpoint came back, not replaced by a fallback
    assert explorer.summaries.accepted == 1 and not explorer.summaries.rejected
