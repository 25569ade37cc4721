"""The services benchmark's parts, without `coevolve up` or a model: the rates and ratios of
a phase, and the end of each schedule's warm start from its files."""

from __future__ import annotations

import os
from pathlib import Path

from coevolve.bench.services import phase_figures, ratios, warm_start_done_s
from coevolve.run_figures import LearnerCount, VerdictCount
from coevolve.schedules.lockstep import WARM_START_CHECKPOINT

T0 = 1_700_000_000.0


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
