"""The services benchmark's parts, without `coevolve up` or a model: counting learner steps
from real TensorBoard event files, accepted tasks from a real pool file, the rates, and the
process-tree clean-up."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest
from torch.utils.tensorboard import SummaryWriter

from coevolve.bench.services import (
    TENSORBOARD_DIRS,
    TRAINED_TAG,
    LearnerCount,
    VerdictCount,
    clean_environment,
    count_learner_steps,
    count_verdicts,
    lockstep_argv,
    phase_figures,
    ratios,
    warm_start_done_s,
)
from coevolve.processes import descendants, kill_survivors
from coevolve.schedules.lockstep import WARM_START_CHECKPOINT
from coevolve.services.pool_store.store import PoolStore
from coevolve.shared.messages import Lineage, Task, ToolCall, Verdict

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
    tensorboard = tmp_path / TENSORBOARD_DIRS["lockstep"]
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


def test_rates_per_hour_per_core_and_ratios() -> None:
    fast = phase_figures(
        LearnerCount(steps=6, calls=7, first_step_s=150.0),
        VerdictCount(verdicts=5, accepted=2, accepted_and_new=2, first_accepted_s=400.0),
        wall_s=900.0,
        cores=2,
    )
    slow = phase_figures(LearnerCount(3, 3, 300.0), VerdictCount(1, 0, 0, None), 900.0, 2)

    assert fast["steps_per_hour"] == 24.0
    assert fast["steps_per_hour_per_core"] == 12.0
    assert fast["accepted_per_hour"] == 8.0
    assert fast["accepted_per_hour_per_core"] == 4.0
    assert fast["first_step_s"] == 150.0
    assert slow["steps_per_hour"] == 12.0
    assert ratios({"async": fast, "lockstep": slow}) == {
        "steps_per_hour": 2.0,
        "accepted_per_hour": None,  # lockstep accepted none
    }


def test_warm_start_end_from_each_schedules_file(tmp_path: Path) -> None:
    policy = tmp_path / "async" / "policies" / "v1.safetensors"
    checkpoint = tmp_path / "lockstep" / WARM_START_CHECKPOINT
    for path, at in ((policy, 95.0), (checkpoint, 130.0)):
        path.parent.mkdir(parents=True)
        path.write_bytes(b"")
        os.utime(path, (T0 + at, T0 + at))

    assert warm_start_done_s("async", tmp_path / "async", T0) == 95.0
    assert warm_start_done_s("lockstep", tmp_path / "lockstep", T0) == 130.0
    assert warm_start_done_s("lockstep", tmp_path / "async", T0) is None


def test_lockstep_runs_until_stopped_without_inherited_settings() -> None:
    argv = lockstep_argv(Path("/runs/x"))
    assert argv[argv.index("--schedule") + 1] == "lockstep"
    assert int(argv[argv.index("--iterations") + 1]) >= 100_000
    env = clean_environment(
        {"NATS_URL": "nats://elsewhere", "PATH": "/bin", "OMP_NUM_THREADS": "4"}
    )
    assert env == {"PATH": "/bin"}


def gone_or_zombie(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state == "Z"


@pytest.mark.skipif(not Path("/proc/self/stat").is_file(), reason="needs /proc")
def test_survivors_of_the_process_tree_are_killed() -> None:
    # a child that starts a grandchild in a session of its own (as the LLM server is)
    code = (
        "import subprocess, time; "
        "p = subprocess.Popen(['sleep', '60'], start_new_session=True); "
        "print(p.pid, flush=True); time.sleep(60)"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, start_new_session=True
    )
    try:
        assert child.stdout is not None
        grandchild = int(child.stdout.readline())
        tree = descendants(child.pid)
        assert grandchild in tree
        # a pid whose start time differs is another process now: left alone
        assert kill_survivors({grandchild: tree[grandchild] + 1}) == []
        child.kill()
        child.wait(10)
        assert kill_survivors(tree) == [grandchild]
        deadline = time.monotonic() + 10
        while not gone_or_zombie(grandchild) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert gone_or_zombie(grandchild)
    finally:
        child.kill()
        child.wait(10)
