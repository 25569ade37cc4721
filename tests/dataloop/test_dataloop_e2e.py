"""The data loop end to end on real NATS: a rollout group with mixed rewards becomes a
boundary signal, a context, an exploration, candidates and verdicts, and an accepted task
lands in DuckDB with its whole lineage, all in one trace.

The LLM is a well-formed remote endpoint (real HTTP on loopback, ``tests.support.fake_llm``);
the same chain with the local model is ``test_dataloop_local_model.py`` (slow).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import msgspec
import pytest

from coevolve.services.abstractor.actor import AbstractorActor
from coevolve.services.explorer.actor import ExplorerActor
from coevolve.services.judge.actor import JudgeActor
from coevolve.services.pool_store.actor import PoolStoreActor
from coevolve.services.pool_store.store import PoolStore
from coevolve.services.signal_monitor.actor import SignalMonitorActor
from coevolve.shared.config import Settings
from coevolve.shared.envs.bfcl.tasks import seed_pool
from coevolve.shared.messages import Exploration, ExplorationRequest, Task, decode, derived_id
from coevolve.shared.runtime.subjects import EXPLORATION_REQUESTS, EXPLORATIONS, ROLLOUT_GROUPS
from coevolve.shared.runtime.telemetry import read_spans
from tests.dataloop.dataloop_harness import (
    POOL_WITH_ENTRIES,
    WellFormedBrain,
    data_loop,
    explorer_alone,
    mixed_group,
    serve_data_loop,
)
from tests.support.fake_llm import Answer, RoleFakeLLM
from tests.support.wait import wait_until

pytestmark = pytest.mark.anyio


def no_llm(role: str, request: dict[str, Any]) -> Answer:
    raise AssertionError(f"the {role} role was asked: substitution asks no LLM")


async def test_a_failed_turn_becomes_variant_turns_with_no_llm_call(
    settings: Settings, tmp_path: Path
) -> None:
    # "I need details on the performance of a particular stock, 'SYNX', ... It should be
    # added to my watchlist." The group's trajectories look the stock up and stop there
    task = next(t for t in seed_pool(classes=None) if t.id == "multi_turn_base_132#t0")
    fake = RoleFakeLLM(no_llm).start()
    settings.services.update(
        llm=fake.llm_section(), pool_store=POOL_WITH_ENTRIES, abstractor={"leak_backend": "ngram"}
    )
    explorer, abstractor, judge = (
        ExplorerActor(settings),
        AbstractorActor(settings),
        JudgeActor(settings),
    )
    actors = [PoolStoreActor(settings), SignalMonitorActor(settings), explorer, abstractor, judge]
    async with data_loop(settings, fake, actors) as loop:
        await loop.bus.publish(ROLLOUT_GROUPS, mixed_group(task))

        async def all_judged() -> bool:
            published = loop.published
            return bool(published.candidates) and len(published.judged) == len(published.candidates)

        await wait_until(all_judged, 60, "every candidate judged")
    assert sum(fake.calls.values()) == 0
    with PoolStore.open_readonly(settings.run_dir / "pool.duckdb") as store:
        accepted = store.list_tasks(origin="synthesized")
    assert accepted, (judge.outcomes, abstractor.dropped)
    parent_request = task.user_turns[0]
    # the failed turn's own children (others come from sibling parents, other turns that
    # call a function it got wrong)
    own = [
        child
        for child in accepted
        if child.lineage.parent_task_id == task.id or task.id in child.lineage.composed_from
    ]
    variants = [child for child in own if child.lineage.replaced]
    assert variants
    for child in variants:
        calls = child.ground_truth[0]
        assert [c.name for c in calls] == ["get_stock_info", "add_to_watchlist"]
        symbol = calls[0].arguments["symbol"]
        assert symbol != "SYNX" and calls[1].arguments["stock"] == symbol
        assert child.user_turns == [parent_request.replace("SYNX", symbol)]
        assert child.lineage.parent_task_id == task.id
        assert "add_to_watchlist" in child.lineage.target_functions
    # composed turns (a first turn, so joined with pool tasks of its setting): the failed
    # turn's calls, or a variant's, are part of each
    for child in own:
        if child.lineage.varied_state:  # the same calls on another state
            assert [c.name for c in child.ground_truth[0]] == [c.name for c in task.ground_truth[0]]
            assert child.initial_state != task.initial_state
    for child in own:
        if child.lineage.composed_from:
            names = [c.name for c in child.ground_truth[0]]
            assert len(names) > 2 and "add_to_watchlist" in names
            assert task.id in child.lineage.composed_from


async def test_rollout_group_to_accepted_task_with_lineage_in_one_trace(
    settings: Settings, seed_task: Task
) -> None:
    brain = WellFormedBrain(parent=seed_task)
    fake = serve_data_loop(settings, brain)
    monitor, explorer = SignalMonitorActor(settings), ExplorerActor(settings)
    abstractor, judge = AbstractorActor(settings), JudgeActor(settings)
    actors = [PoolStoreActor(settings), monitor, explorer, abstractor, judge]
    group = mixed_group(seed_task)
    async with data_loop(settings, fake, actors) as loop:
        started = time.monotonic()
        await loop.bus.publish(ROLLOUT_GROUPS, group)

        async def verdict_recorded() -> bool:
            stats = await loop.pool.stats()
            return stats.accepted_candidates + stats.rejected_candidates >= 1

        await wait_until(verdict_recorded, 60, "a verdict in pool-store")
        elapsed = time.monotonic() - started
        stats = await loop.pool.stats()
    print(f"rollout group -> a verdict in DuckDB: {elapsed:.2f} s")
    published = loop.published

    signal_id = derived_id("signal", group.id, "boundary")
    [record] = (settings.run_dir / "explorer").glob("explorations-*.jsonl")
    lines = record.read_bytes().splitlines()
    [recorded] = [msgspec.json.decode(line, type=Exploration) for line in lines]
    assert recorded.id == published.explorations[0] and recorded.signal_id == signal_id
    assert monitor.published == {"boundary": 1}
    assert published.explorations == [derived_id("exploration", signal_id)]
    assert explorer.summaries.accepted == 1 and explorer.actions.accepted == 2
    assert fake.calls == {"summarizer": 1, "explorer": 2, "abstractor": 1, "judge": 1}
    # the failed attempts missed touch (among others), so the exploration made a file,
    # then listed it: the unit is the touch alone
    assert not abstractor.dropped
    assert published.candidates == published.judged and len(published.candidates) == 1
    assert judge.outcomes == {"accepted": 1}
    assert stats.accepted_candidates == 1 and stats.rejected_candidates == 0
    assert stats.tasks_by_origin["synthesized"] == 1

    with PoolStore.open_readonly(settings.run_dir / "pool.duckdb") as store:
        [accepted] = store.list_tasks(origin="synthesized")
        chain = store.lineage(accepted.id)
    lineage = accepted.lineage
    assert lineage.signal_id == signal_id and lineage.signal_kind == "boundary"
    assert lineage.parent_task_id == seed_task.id
    assert lineage.context is not None and lineage.context.focus_pattern
    assert lineage.exploration_id == published.explorations[0]
    assert lineage.exploration_mode == "guided" and lineage.exploration_steps == 2
    assert lineage.candidate_id in published.candidates
    assert lineage.verdict_id == derived_id("verdict", lineage.candidate_id)
    assert lineage.signal_evidence["successes"] == 2
    assert accepted.initial_state == seed_task.initial_state
    assert chain["verdict"]["accepted"] and chain["signal"]["kind"] == "boundary"
    assert chain["context"]["summary"] and chain["exploration"]["steps"] == 2
    [[call]] = accepted.ground_truth
    assert call.name == "touch" and call.arguments["file_name"] in accepted.user_turns[0]
    assert "touch" in lineage.target_functions and lineage.depth == 1
    assert any(f.expected.name == "touch" for f in lineage.failed_calls)

    # one trace: group handling, signal, exploration, candidate, verdict, pool-store
    trace_id = lineage.trace_id
    assert trace_id is not None
    spans = [s for s in read_spans(settings.run_dir / "traces") if s["trace_id"] == trace_id]
    services = {s["service"] for s in spans}
    assert {"signal_monitor", "explorer", "abstractor", "judge", "pool_store"} <= services
    names = {s["name"] for s in spans}
    assert {"explorer summarize", "explorer explore", "abstractor abstract", "judge replay"} <= (
        names
    )


async def test_unguided_exploration_request(settings: Settings, seed_task: Task) -> None:
    """Seed mode: an exploration request explores a train-split task without a signal."""
    fake = RoleFakeLLM(WellFormedBrain()).start()
    settings.services.update(llm=fake.llm_section(), explorer={"max_steps": 3})
    request = ExplorationRequest(task=seed_task, rounds=2)
    async with explorer_alone(settings, fake, ExplorerActor(settings)) as (bus, _, _):
        published = await bus.nc.subscribe(EXPLORATIONS)
        await bus.publish(EXPLORATION_REQUESTS, request)
        message = await published.next_msg(timeout=30)
    exploration = decode(message.data, Exploration)
    assert exploration.id == derived_id("exploration", request.id)
    assert exploration.mode == "unguided" and exploration.context is None
    assert exploration.signal_id is None and exploration.task == seed_task
    assert [len(r.steps) for r in exploration.rounds] == [3, 3]
    first, second = exploration.rounds[0].steps[:2]
    assert first.action.name == "mkdir" and second.action.name == "ls"
    assert "current_directory_content" in second.observation
    # each step's history is what came before it, from the task's first request on
    assert first.history[0].content == seed_task.user_turns[0]
    assert second.history[-2].tool_calls == [first.action]
    assert second.history[-1].content == first.observation
    assert fake.calls == {"explorer": 6}  # no summary without a signal
