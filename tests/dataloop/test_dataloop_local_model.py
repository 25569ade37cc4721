"""The data loop end to end with the local model in every role.

Nothing stands in for the LLM: the summarizer, explorer, abstractor and judge talk to the
local llama.cpp server (started by the clients on first use) with schema-constrained
JSON. A small model writes poor tasks and judges
them erratically, so one signal may not yield an accepted task; the test feeds boundary
signals from several seed tasks (sampling seeded; one-turn tasks, which the small model
can pair with their calls) and stops at the first acceptance. On a shared 2-core CPU one
chain takes several minutes: marked slow.
"""

from __future__ import annotations

import time

import pytest

from coevolve.services.abstractor.actor import AbstractorActor
from coevolve.services.explorer.actor import ExplorerActor
from coevolve.services.judge.actor import JudgeActor
from coevolve.services.pool_store.actor import PoolStoreActor
from coevolve.services.pool_store.store import PoolStore
from coevolve.services.signal_monitor.actor import SignalMonitorActor
from coevolve.shared.config import Settings
from coevolve.shared.llm import RoleClients, role_settings
from coevolve.shared.runtime.bus import Bus
from coevolve.shared.runtime.subjects import ROLLOUT_GROUPS
from coevolve.shared.runtime.telemetry import read_spans
from tests.dataloop.dataloop_harness import (
    POOL_WITH_ENTRIES,
    filesystem_seed_tasks,
    mixed_group,
)
from tests.support.actors import running
from tests.support.cache import CACHE_DIR
from tests.support.pool_store import pool_answering
from tests.support.wait import wait_until

pytestmark = [pytest.mark.anyio, pytest.mark.slow, pytest.mark.timeout(4 * 3600)]

SIGNALS = 8
DEADLINE_S = 3 * 3600.0


async def test_local_model_turns_a_boundary_signal_into_an_accepted_task(
    settings: Settings,
) -> None:
    import torch

    torch.manual_seed(0)
    # One model instance for every role (one load, one generation at a time); the judge
    # decodes greedily.
    llm = RoleClients(
        role_settings({"roles": {"judge": {"temperature": 0.0}}}),
        run_dir=CACHE_DIR,
    )
    settings.services.update(
        pool_store=POOL_WITH_ENTRIES,
        explorer={"summarize_aimed": True, "substitution_rounds": 0},  # the LLM chain
        abstractor={
            "max_tasks": 1,
            "similarity_cache_dir": str(CACHE_DIR / "similarity"),
        },
    )
    explorer = ExplorerActor(settings, llm=llm)
    abstractor, judge = AbstractorActor(settings, llm=llm), JudgeActor(settings, llm=llm)
    actors = [PoolStoreActor(settings), SignalMonitorActor(settings), explorer, abstractor, judge]
    bus = await Bus.connect(settings.bus, "test")
    tasks = filesystem_seed_tasks(SIGNALS)
    try:
        async with running(actors):
            pool = await pool_answering(bus, seeded=True)
            started = time.monotonic()
            for task in tasks:
                await bus.publish(ROLLOUT_GROUPS, mixed_group(task))

            def all_processed() -> bool:
                explored = explorer.outcomes["published"]
                abstracted = abstractor.outputs.accepted + abstractor.outputs.total_rejected
                return (
                    sum(explorer.outcomes.values()) == SIGNALS
                    and abstracted == explored
                    and sum(judge.outcomes.values()) == abstractor.candidates
                )

            async def accepted_or_exhausted() -> bool:
                if (await pool.stats()).accepted_candidates >= 1:
                    return True
                return all_processed()

            try:
                await wait_until(accepted_or_exhausted, DEADLINE_S, "the chains", poll_s=2.0)
            finally:
                print(
                    f"after {time.monotonic() - started:.0f} s: explorations "
                    f"{dict(explorer.outcomes)}, summaries {explorer.summaries.snapshot()}, "
                    f"actions {explorer.actions.snapshot()}, abstractions "
                    f"{abstractor.outputs.snapshot()}, dropped {dict(abstractor.dropped)}, "
                    f"candidates {abstractor.candidates}, verdicts {dict(judge.outcomes)}, "
                    f"judgments {judge.judgments.snapshot()}"
                )
    finally:
        await bus.close()
        await llm.aclose()

    with PoolStore.open_readonly(settings.run_dir / "pool.duckdb") as store:
        accepted = store.list_tasks(origin="synthesized")
        chain = store.lineage(accepted[0].id) if accepted else {}
    assert accepted, f"no task accepted from {SIGNALS} signals"
    task = accepted[0]
    assert explorer.summaries.accepted >= 1  # a context was written
    lineage = task.lineage
    assert lineage.signal_kind == "boundary" and lineage.parent_task_id in {t.id for t in tasks}
    assert lineage.exploration_id and lineage.candidate_id and lineage.verdict_id
    assert chain["verdict"]["accepted"] is True
    assert lineage.trace_id is not None
    spans = read_spans(settings.run_dir / "traces")
    services = {s["service"] for s in spans if s["trace_id"] == lineage.trace_id}
    assert {"signal_monitor", "explorer", "abstractor", "judge", "pool_store"} <= services
