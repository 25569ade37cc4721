"""Three explorers and two judges share their work queues: every signal is explored once,
every candidate judged once, and DuckDB holds exactly one verdict per candidate, even
when rollout groups are delivered twice."""

from __future__ import annotations

import time
from collections import Counter

import anyio
import pytest

from coevolve.services.abstractor.actor import AbstractorActor
from coevolve.services.explorer.actor import ExplorerActor
from coevolve.services.judge.actor import JudgeActor
from coevolve.services.pool_store.actor import PoolStoreActor
from coevolve.services.pool_store.store import PoolStore
from coevolve.services.signal_monitor.actor import SignalMonitorActor
from coevolve.shared.config import Settings
from coevolve.shared.messages import derived_id, encode
from coevolve.shared.runtime.subjects import ROLLOUT_GROUPS
from tests.dataloop.dataloop_harness import (
    WellFormedBrain,
    data_loop,
    filesystem_seed_tasks,
    mixed_group,
    serve_data_loop,
)
from tests.support.wait import wait_until

pytestmark = pytest.mark.anyio

GROUPS = 6


async def test_three_explorers_two_judges_process_each_message_once(settings: Settings) -> None:
    tasks = filesystem_seed_tasks(GROUPS, missing=("touch", "mkdir"))
    # Slow answers keep each explorer and judge busy, so the queues spread the work.
    brain = WellFormedBrain(delays={"explorer": 0.15, "summarizer": 0.1, "judge": 0.2})
    # The requests differ only in a folder name; de-duplication is covered in
    # test_abstractor_units and would (rightly) drop all but the first here.
    fake = serve_data_loop(settings, brain, dedup_threshold=1.5)
    monitor = SignalMonitorActor(settings)
    explorers = [ExplorerActor(settings) for _ in range(3)]
    abstractor = AbstractorActor(settings)
    judges = [JudgeActor(settings) for _ in range(2)]
    actors = [PoolStoreActor(settings), monitor, *explorers, abstractor, *judges]
    groups = [mixed_group(task) for task in tasks]
    async with data_loop(settings, fake, actors) as loop:
        started = time.monotonic()
        for group in groups:
            await loop.bus.publish(ROLLOUT_GROUPS, group)
        # the same groups again, as a redelivery would bring them (new Nats-Msg-Id)
        for group in groups[:3]:
            await loop.bus.js.publish(
                ROLLOUT_GROUPS, encode(group), headers={"Nats-Msg-Id": f"again-{group.id}"}
            )

        async def all_judged() -> bool:
            stats = await loop.pool.stats()
            return stats.accepted_candidates + stats.rejected_candidates >= GROUPS

        await wait_until(all_judged, 90, f"{GROUPS} verdicts")
        elapsed = time.monotonic() - started
        await wait_until(lambda: monitor.monitor.state.groups_processed >= GROUPS, 10, "the groups")
        await anyio.sleep(1.5)  # room for a duplicate to (wrongly) show up
        stats = await loop.pool.stats()
    published = loop.published

    per_explorer = [explorer.outcomes["published"] for explorer in explorers]
    per_judge = [sum(judge.outcomes.values()) for judge in judges]
    print(
        f"{GROUPS} groups -> {len(published.judged)} verdicts in {elapsed:.2f} s; "
        f"explorations per explorer {per_explorer}, verdicts per judge {per_judge}"
    )
    signal_ids = {derived_id("signal", g.id, "boundary") for g in groups}
    assert monitor.published == {"boundary": GROUPS}
    assert sorted(published.explorations) == sorted(
        derived_id("exploration", s) for s in signal_ids
    )
    assert sum(1 for n in per_explorer if n) >= 2  # the work was shared
    assert sum(per_explorer) == GROUPS
    assert len(published.candidates) == GROUPS and abstractor.candidates == GROUPS
    assert sorted(published.judged) == sorted(published.candidates)
    assert all(per_judge) and sum(per_judge) == GROUPS
    assert stats.accepted_candidates == GROUPS and stats.rejected_candidates == 0
    assert fake.calls["summarizer"] == GROUPS and fake.calls["abstractor"] == GROUPS

    with PoolStore.open_readonly(settings.run_dir / "pool.duckdb") as store:
        rows = store._query("SELECT candidate_id, accepted, signal_id FROM verdicts")
        synthesized = store.list_tasks(origin="synthesized", limit=100)
    assert len(rows) == GROUPS
    assert Counter(candidate for candidate, _, _ in rows) == Counter(published.candidates)
    assert {signal for _, _, signal in rows} == signal_ids
    assert len(synthesized) == GROUPS
    assert {t.lineage.signal_id for t in synthesized} == signal_ids
