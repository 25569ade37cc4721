"""What a stopped run leaves to count (``coevolve.run_figures``), from real files: TensorBoard
event files, a real pool file, step records, policy files, the supervisor's state, logs."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import duckdb
import msgspec
from torch.utils.tensorboard import SummaryWriter

from coevolve.report.run_data import LEARNER_STEPS, LEARNER_TENSORBOARD, POOL_FILE
from coevolve.run_figures import (
    TRAINED_TAG,
    LearnerCount,
    VerdictCount,
    count_groups_trained_on,
    count_learner_steps,
    count_rollout_groups,
    count_verdicts,
    logs_mentioning,
    policy_versions,
    pool_duplicates,
    run_figures,
)
from coevolve.services.pool_store.store import PoolStore
from coevolve.shared.messages import (
    Lineage,
    RolloutResults,
    ScoreSample,
    Task,
    ToolCall,
    Verdict,
)
from tests.support.learner_steps import record_step
from tests.support.messages import rewarded_group

T0 = 1_700_000_000.0


def write_trained(directory: Path, events: list[tuple[float, float]]) -> None:
    """``learner/trained`` scalars as GrpoLearner.log_metrics writes them: (seconds after
    T0, value); an untrained step keeps the step number."""
    writer = SummaryWriter(str(directory))
    step = 0
    for at, value in events:
        step += int(value > 0)
        writer.add_scalar(TRAINED_TAG, value, step, walltime=T0 + at)
        writer.add_scalar("learner/kl", 0.0, step, walltime=T0 + at)
    writer.close()


def test_learner_steps_count_trained_events_within_the_phase(tmp_path: Path) -> None:
    tensorboard = tmp_path / "tensorboard" / "lockstep"
    # 3 trained and 1 untrained within 600 s; one more trained after the stop
    write_trained(tensorboard, [(120.0, 1.0), (200.0, 0.0), (260.0, 1.0), (400.0, 1.0)])
    write_trained(tensorboard, [(700.0, 1.0)])  # a second event file (a restart)

    count = count_learner_steps(tensorboard, T0, T0 + 600.0)

    assert count == LearnerCount(steps=3, calls=4, first_step_s=120.0)
    assert count_learner_steps(tensorboard, T0, T0 + 800.0).steps == 4
    assert count_learner_steps(tmp_path / "none", T0, T0 + 600.0) == LearnerCount(0, 0, None)


def make_verdict(number: int, accepted: bool, created_at: float) -> Verdict:
    return Verdict(
        id=f"verdict-{number}",
        candidate_id=f"candidate-{number}",
        accepted=accepted,
        reasons=[] if accepted else ["final result differs"],
        task=Task(
            id=f"task-{number}",
            environment="bfcl",
            user_turns=[f"What is {number} plus 2?"],
            ground_truth=[[ToolCall(name="add", arguments={"a": number, "b": 2})]],
            env_config={"involved_classes": ["MathAPI"]},
            origin="synthesized",
            lineage=Lineage(signal_kind="boundary", signal_id=f"signal-{number}"),
        ),
        created_at=created_at,
    )


def test_verdicts_count_accepted_within_the_phase(tmp_path: Path) -> None:
    db_path = tmp_path / "pool.duckdb"
    with PoolStore(db_path) as store:
        store.record_verdict(make_verdict(1, True, T0 + 300.0))
        store.record_verdict(make_verdict(2, False, T0 + 320.0))
        duplicate = make_verdict(3, True, T0 + 400.0)
        store.record_verdict(duplicate)
        # the same task accepted again: a verdict, accepted, but nothing new in the pool
        again = msgspec.structs.replace(make_verdict(4, True, T0 + 450.0), task=duplicate.task)
        store.record_verdict(again)
        store.record_verdict(make_verdict(5, True, T0 + 900.0))  # after the stop

    count = count_verdicts(db_path, T0, T0 + 600.0)

    assert count == VerdictCount(verdicts=4, accepted=3, accepted_and_new=2, first_accepted_s=300.0)
    assert count_verdicts(tmp_path / "missing.duckdb", T0, T0 + 600.0) == VerdictCount(
        0, 0, 0, None
    )


def test_rollout_groups_are_the_pools_recorded_groups(tmp_path: Path) -> None:
    db_path = tmp_path / "pool.duckdb"
    before = time.time()
    with PoolStore(db_path) as store:
        for group in ("g1", "g2", "g3"):
            samples = [
                ScoreSample(task_id="t", policy_version=1, score=s, length=9) for s in (0, 1)
            ]
            store.record_results(RolloutResults(group_id=group, samples=samples))
    after = time.time()

    assert count_rollout_groups(db_path, before, after) == 3
    assert count_rollout_groups(db_path, before - 100, before - 1) == 0
    assert count_rollout_groups(tmp_path / "missing.duckdb", before, after) == 0


def test_groups_trained_on_within_the_phase(tmp_path: Path) -> None:
    for step, at in ((1, 100.0), (2, 200.0), (3, 900.0)):  # the last after the stop
        groups = [rewarded_group(f"g{step}-{i}", "t", "seed", 1, 0.0, 1.0) for i in range(2)]
        record_step(
            tmp_path / LEARNER_STEPS, groups, step=step, versions=(step, step + 1), at=T0 + at
        )

    assert count_groups_trained_on(tmp_path, T0, T0 + 600.0) == 4
    assert count_groups_trained_on(tmp_path / "none", T0, T0 + 600.0) == 0


def test_policy_versions_come_from_the_weight_files(tmp_path: Path) -> None:
    policies = tmp_path / "policies"
    policies.mkdir()
    for name in ("v2.safetensors", "v10.safetensors", "v3.tmp", "notes.txt"):
        (policies / name).write_bytes(b"x")
    assert policy_versions(tmp_path) == [2, 10]
    assert policy_versions(tmp_path / "missing") == []


def test_the_pool_audit_counts_duplicate_rows(tmp_path: Path) -> None:
    path = tmp_path / "pool.duckdb"
    task = Task(id="t1", environment="bfcl", user_turns=["list the files"])
    with PoolStore(path) as store:
        store.add_tasks([task])
        samples = [ScoreSample(task_id="t1", policy_version=1, score=1.0, length=3)] * 2
        store.record_results(RolloutResults(group_id="g1", samples=samples))
        # the same group under another message id is refused: no duplicate
        store.record_results(RolloutResults(group_id="g1", samples=samples))
    assert pool_duplicates(path) == {
        "duplicate_tasks": 0,
        "duplicate_verdicts": 0,
        "duplicate_results": 0,
    }
    with contextlib.closing(duckdb.connect(str(path))) as db:
        db.execute("INSERT INTO rollout_results SELECT * FROM rollout_results LIMIT 1")
    assert pool_duplicates(path)["duplicate_results"] == 1


def test_logs_mentioning_a_text_name_their_services(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "rollout.log").write_text("INFO the cluster has lost quorum\n")
    (logs / "judge.log").write_text("INFO fine\n")
    assert logs_mentioning(tmp_path, "lost quorum") == ["rollout"]
    assert logs_mentioning(tmp_path / "missing", "lost quorum") == []


def test_run_figures_read_the_learner_where_its_schedule_writes(tmp_path: Path) -> None:
    write_trained(tmp_path / LEARNER_TENSORBOARD, [(100.0, 1.0)])
    lockstep_dir = "tensorboard/lockstep"
    write_trained(tmp_path / lockstep_dir, [(100.0, 1.0), (200.0, 1.0)])
    with PoolStore(tmp_path / POOL_FILE) as store:
        store.record_verdict(make_verdict(1, True, T0 + 300.0))

    figures = run_figures(tmp_path, T0, T0 + 600.0)
    lockstep = run_figures(tmp_path, T0, T0 + 600.0, lockstep_dir)

    assert figures["learner"].steps == 1 and lockstep["learner"].steps == 2
    assert figures["verdicts"] == lockstep["verdicts"] == VerdictCount(1, 1, 1, 300.0)
    assert figures["pool"]["verdicts"]["accepted"] == 1
    assert run_figures(tmp_path / "empty", T0, T0 + 600.0)["pool"] is None
