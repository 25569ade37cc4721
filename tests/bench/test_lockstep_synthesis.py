"""The data loop in the lockstep schedule: signals, exploration, abstraction and judging in
one process, verdicts recorded in a real DuckDB pool.

The LLM is the data-loop tests' stand-in remote endpoint (real HTTP on loopback,
``tests.support.fake_llm``); environments, pool and, for the loop, the policy are real.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch

from coevolve.bench.short_tasks import build_tasks
from coevolve.cli.lockstep_cmd import run_lockstep
from coevolve.schedules.lockstep import (
    WARM_START_CHECKPOINT,
    LockstepConfig,
    LockstepLoop,
    warm_start_once,
)
from coevolve.schedules.synthesis import LockstepSynthesis
from coevolve.services.learner.config import LearnerConfig, WarmStartConfig
from coevolve.services.learner.trainer import GrpoLearner
from coevolve.services.pool_store.store import PoolStore
from coevolve.services.signal_monitor.handler import SignalMonitor
from coevolve.services.signal_monitor.state import MonitorState
from coevolve.shared.config import Settings, load_settings
from coevolve.shared.envs.bfcl.tasks import seed_tasks
from coevolve.shared.messages import RolloutGroup, Task, derived_id
from coevolve.shared.policy import LoadedPolicy, load_policy
from tests.dataloop.dataloop_harness import WellFormedBrain, filesystem_seed_tasks, mixed_group
from tests.support.cache import CACHE_DIR
from tests.support.fake_llm import RoleFakeLLM, offered_functions

# rollouts as small as the loop allows: one task, two episodes of a few tokens
TINY_LOOP = LockstepConfig(tasks_per_step=1, group_size=2, max_new_tokens=6, max_steps=1)


def data_loop_settings(tmp_path: Path, fake: RoleFakeLLM, **services: Any) -> Settings:
    settings = load_settings(run_dir=str(tmp_path / "run"))
    settings.services.update(
        llm=fake.llm_section(),
        explorer={"rounds": 1, "max_steps": 2, "summarize_aimed": True, "substitution_rounds": 0},
        abstractor={"leak_backend": "ngram"},
        judge={"llm_judge": True},  # these tests cover the judge role's path too
        **services,
    )
    return settings


@pytest.fixture
def seeded_pool(tmp_path: Path) -> Iterator[PoolStore]:
    with PoolStore(tmp_path / "pool.duckdb") as store:
        store.add_tasks(seed_tasks())
        yield store


def test_a_boundary_group_becomes_an_accepted_synthesized_task_in_the_pool(
    tmp_path: Path, seeded_pool: PoolStore
) -> None:
    task = filesystem_seed_tasks(1)[0]
    fake = RoleFakeLLM(WellFormedBrain(parent=task)).start()
    group = mixed_group(task)
    try:
        with closing(
            LockstepSynthesis(data_loop_settings(tmp_path, fake), seeded_pool)
        ) as synthesis:
            added = synthesis([group])
            # the monitor remembers the group: handing it in again synthesizes nothing
            again = synthesis([group])
    finally:
        fake.stop()

    assert fake.calls == {"summarizer": 1, "explorer": 2, "abstractor": 1, "judge": 1}
    assert synthesis.stats.signals == {"boundary": 1}
    assert not synthesis.stats.dropped
    assert synthesis.stats.verdicts == {"accepted": 1}
    assert again == []

    [new] = added
    signal_id = derived_id("signal", group.id, "boundary")
    lineage = new.lineage
    assert new.origin == "synthesized" and new.initial_state == task.initial_state
    assert lineage.signal_id == signal_id and lineage.signal_kind == "boundary"
    assert lineage.parent_task_id == task.id and lineage.signal_evidence["successes"] == 2
    assert lineage.context is not None and lineage.context.focus_pattern
    assert lineage.exploration_id == derived_id("exploration", signal_id)
    assert lineage.exploration_mode == "guided" and lineage.exploration_steps == 2
    assert lineage.candidate_id is not None
    assert lineage.verdict_id == derived_id("verdict", lineage.candidate_id)

    stats = seeded_pool.stats()
    assert stats.accepted_candidates == 1 and stats.rejected_candidates == 0
    assert stats.tasks_by_origin["synthesized"] == 1
    assert seeded_pool.get_task(new.id) == new
    chain = seeded_pool.lineage(new.id)
    assert chain["verdict"]["accepted"] and chain["signal"]["kind"] == "boundary"
    assert chain["context"]["summary"] and chain["exploration"]["steps"] == 2
    # the failed attempts missed touch (among others): the aimed exploration made a file
    [[call]] = new.ground_truth
    assert call.name == "touch" and call.arguments["file_name"] in new.user_turns[0]


def test_a_group_without_a_signal_synthesizes_nothing_and_asks_no_llm(
    tmp_path: Path, seeded_pool: PoolStore
) -> None:
    task = filesystem_seed_tasks(1)[0]
    fake = RoleFakeLLM(WellFormedBrain()).start()
    try:
        with closing(
            LockstepSynthesis(data_loop_settings(tmp_path, fake), seeded_pool)
        ) as synthesis:
            added = synthesis([mixed_group(task, (0.0, 0.0, 0.0, 0.0))])
    finally:
        fake.stop()
    assert added == [] and synthesis.verdicts == []
    assert sum(fake.calls.values()) == 0
    assert synthesis.stats.signals == {}
    assert seeded_pool.stats().tasks_by_origin["synthesized"] == 0


class MathBrain(WellFormedBrain):
    """A well-formed remote model for the short MathAPI tasks: explores with ``add`` and
    asks for that addition."""

    def explorer(self, request: dict[str, Any]) -> dict[str, Any]:
        assert "add" in offered_functions(request)
        return {"name": "add", "arguments": {"a": 12, "b": 30}}

    def abstractor(self, request: dict[str, Any]) -> dict[str, Any]:
        return {
            "description": "Add two numbers and report the total.",
            "request": "Please add the numbers 12 and 30 and tell me the total.",
        }


@pytest.fixture(scope="module")
def policy() -> LoadedPolicy:
    torch.manual_seed(0)
    return load_policy(run_dir=CACHE_DIR, device="cpu")


def test_the_loop_synthesizes_when_due_and_the_new_task_joins_the_pool(
    tmp_path: Path, policy: LoadedPolicy
) -> None:
    source = build_tasks(1, seed=0, prefix="lockstep_math")[0]
    fake = RoleFakeLLM(MathBrain()).start()
    settings = data_loop_settings(
        tmp_path, fake, signal_monitor={"detectors": {"kinds": ["uncertainty"]}}
    )
    # What the monitor remembers of earlier episodes: enough calm (zero-entropy) ones that
    # any hesitation of the policy's sampled episodes is an uncertainty signal.
    calm = MonitorState(entropy_reservoir=[0.0] * 50, entropy_seen=50)
    added: list[Task] = []
    with PoolStore(tmp_path / "pool.duckdb") as store:
        store.add_tasks([source])
        synthesis = LockstepSynthesis(settings, store, max_signals=1)
        synthesis.monitor = SignalMonitor(synthesis.monitor.config, calm)
        handed: list[list[str]] = []

        def synthesize(groups: list[RolloutGroup]) -> list[Task]:
            handed.append([group.id for group in groups])
            return synthesis(groups)

        loop = LockstepLoop(
            policy,
            lambda count: store.sample_batch(count, environment="bfcl", seed=0),
            dataclasses.replace(TINY_LOOP, synthesize_every=2),
            LearnerConfig(drop_uniform_groups=False, lr=1e-3),
            synthesize=synthesize,
            on_new_tasks=added.extend,
        )
        try:
            first = loop.iteration()
            calls_after_first = sum(fake.calls.values())
            second = loop.iteration()
        finally:
            loop.close()
            synthesis.close()
            fake.stop()
        pool = store.sample_batch(10, environment="bfcl", seed=1)

    assert first.new_tasks == 0 and calls_after_first == 0  # not due after one step
    # the one synthesis saw the groups of both steps (one task per step here)
    assert len(handed) == 1 and len(handed[0]) == 2 * TINY_LOOP.tasks_per_step
    assert len(set(handed[0])) == len(handed[0])
    assert second.new_tasks == 1 and synthesis.stats.signals == {"uncertainty": 1}
    assert fake.calls == {"summarizer": 1, "explorer": 2, "abstractor": 1, "judge": 1}
    [new] = added
    assert new.origin == "synthesized" and new.lineage.signal_kind == "uncertainty"
    assert new.lineage.parent_task_id == source.id and new.lineage.verdict_id is not None
    assert new.ground_truth[0][0].name == "add"
    assert {task.id for task in pool} == {source.id, new.id}  # sampled from the next step on


def seed_math_tasks(count: int) -> list[Task]:
    """Short MathAPI tasks as seed tasks: what the warm start trains on."""
    return [
        msgspec.structs.replace(task, origin="seed")
        for task in build_tasks(count, seed=0, prefix="lockstep_math")
    ]


def test_run_lockstep_reads_the_services_sections_and_synthesizes_after_the_step(
    tmp_path: Path, policy: LoadedPolicy
) -> None:
    pool_path = tmp_path / "pool.duckdb"
    with PoolStore(pool_path) as store:
        store.add_tasks(seed_math_tasks(1))
    fake = RoleFakeLLM(MathBrain()).start()
    settings = data_loop_settings(
        tmp_path,
        fake,
        # what the services would run with: three episodes a group, one group a step
        rollout={"max_new_tokens": 6, "max_steps": 1},
        pool_store={"group_size": 3},
        learner={
            "model": str(CACHE_DIR / "models" / policy.name),  # the fixture's weights
            "grpo": {"groups_per_step": 1, "drop_uniform_groups": False, "lr": 1e-3},
            "warm_start": {"tasks": 1, "epochs": 1, "min_steps": 0, "grain": "any", "threads": 1},
        },
    )
    try:
        reports = run_lockstep(tmp_path / "run", pool_path, 1, settings=settings)
    finally:
        fake.stop()
    [report] = reports
    assert report.metrics.trained and report.metrics.trajectories == 3
    # the warm start made version 1 (as the learner service does); the step made 2
    assert report.metrics.step == 1 and report.metrics.staleness_max == 0
    # the base model's few tokens earn nothing, and a first group of equal rewards carries
    # no signal: synthesis ran and had nothing to ask the LLM
    assert report.new_tasks == 0 and sum(fake.calls.values()) == 0
    with PoolStore.open_readonly(pool_path) as store:
        assert sum(store.stats().tasks_by_origin.values()) == 1
    assert (tmp_path / "run" / WARM_START_CHECKPOINT).is_file()  # warm-started before step 1


def test_the_warm_start_runs_once_per_run_directory(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    config = WarmStartConfig(tasks=2, epochs=1, lr=1e-3, grain="any", threads=1)
    with PoolStore(tmp_path / "pool.duckdb") as store:
        store.add_tasks(seed_math_tasks(2))
        first = GrpoLearner(load_policy(run_dir=CACHE_DIR, device="cpu"))
        assert warm_start_once(first, store, run_dir, config)
        assert first.warm_started and first.version == 1
        saved = (run_dir / WARM_START_CHECKPOINT).stat().st_mtime_ns
        second = GrpoLearner(load_policy(run_dir=CACHE_DIR, device="cpu"))
        assert warm_start_once(second, store, run_dir, config)  # restored, not trained again
        assert second.warm_started and second.version == 1
        off = WarmStartConfig(enabled=False)
        unwarmed = GrpoLearner(load_policy(run_dir=CACHE_DIR))
        assert not warm_start_once(unwarmed, store, tmp_path / "x", off)
    assert (run_dir / WARM_START_CHECKPOINT).stat().st_mtime_ns == saved
    trained = dict(first.model.named_parameters())
    compared = 0
    for name, parameter in second.model.named_parameters():
        if "lora" in name:  # the frozen warm-started adapter and the fresh one for GRPO
            assert torch.equal(parameter, trained[name]), name
            compared += 1
    assert compared > 0
