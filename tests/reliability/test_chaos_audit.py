"""The chaos bench's schedule and its audit (the run itself is `coevolve bench chaos`)."""

from __future__ import annotations

import json
from pathlib import Path

from coevolve.bench.faults import (
    fault_schedule,
    is_busy,
    learner_resumes,
    run_audit,
)
from coevolve.bus_tally import BusTally
from coevolve.shared.messages import GRPO_STEP_PHASE
from coevolve.shared.runtime.subjects import DEFAULT_SERVICES
from tests.support.messages import heartbeat


def test_every_fault_happens_once_in_the_middle_of_the_run() -> None:
    faults = fault_schedule(10.0, seed=3)
    assert sorted(f.target for f in faults if f.kind == "kill") == sorted(DEFAULT_SERVICES)
    assert [f.kind for f in faults].count("nats_restart") == 1
    assert [f.kind for f in faults].count("llm_restart") == 1
    assert all(0.2 * 600 <= f.at_s <= 0.8 * 600 for f in faults)
    assert [f.at_s for f in faults] == sorted(f.at_s for f in faults)
    assert fault_schedule(10.0, seed=3) == faults
    assert fault_schedule(10.0, seed=4) != faults


def test_the_learner_is_busy_only_in_a_grpo_step() -> None:
    # holding groups while it waits for more is not a step
    assert not is_busy(heartbeat("learner", in_flight=2))
    assert not is_busy(heartbeat("learner", phase="warm start", in_flight=1))
    assert is_busy(heartbeat("learner", phase=GRPO_STEP_PHASE, in_flight=2))
    assert is_busy(heartbeat("rollout", in_flight=1))
    assert not is_busy(heartbeat("rollout")) and not is_busy(None)


def test_a_learner_resume_is_found_in_either_phase(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    assert learner_resumes(tmp_path) == []
    (logs / "learner.log").write_text("INFO warm start: SFT on 12 tasks for 2 epochs\n")
    assert learner_resumes(tmp_path) == []
    with (logs / "learner.log").open("a") as log:
        log.write("INFO warm start resumes at epoch 2, batch 1\n")
    assert learner_resumes(tmp_path) == ["warm_start"]
    with (logs / "learner.log").open("a") as log:
        log.write("INFO resumed at step 3, version 4\n")
    assert learner_resumes(tmp_path) == ["grpo", "warm_start"]


def test_a_group_its_queued_job_will_make_again_is_not_lost(tmp_path: Path) -> None:
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "learner.groups.json").write_text(json.dumps(["trained"]))
    view = BusTally(groups={"trained", "waiting", "refused-then-requeued", "gone"})
    bus_audit = {
        "waiting_groups": {"waiting"},
        "requeued_groups": {"refused-then-requeued", "not-published-yet"},
        "versions_non_monotonic": 0,
        "policy_versions": [1],
        "dead_letters_by_reason": {},
        "dead_letters_by_service": {},
    }
    audit = run_audit(tmp_path, view, bus_audit)
    assert audit["groups_published"] == 4 and audit["groups_trained"] == 1
    assert audit["groups_requeued"] == 1
    assert audit["groups_lost"] == 1  # "gone": stored nowhere and no job to make it again
