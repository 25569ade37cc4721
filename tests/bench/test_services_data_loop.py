"""The services benchmark's data-loop comparison, without `coevolve up` or a model: the
phases' options, rollout groups and trained-on groups from real run files, the CPU figures
and the learner-step ratios."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from coevolve.bench.services import (
    COMPARISONS,
    cpu_figures,
    learner_step_ratios,
    phase_figures,
    phase_scale,
    print_table,
    ratios,
    run,
)
from coevolve.cli import app
from coevolve.cli.up import parse_scale
from coevolve.harness import up_argv
from coevolve.run_figures import LearnerCount, VerdictCount

T0 = 1_700_000_000.0


def scale_of(options: list[str]) -> dict[str, int]:
    """The replicas ``up`` starts with these options."""
    return parse_scale([options[i + 1] for i, word in enumerate(options) if word == "--scale"])


def test_no_data_loop_is_up_without_explorers() -> None:
    assert COMPARISONS["data-loop"] == ("full", "no_data_loop")
    full = up_argv(Path("/runs/full"), nats_port=4300, scale=phase_scale("full"))
    bare = up_argv(Path("/runs/bare"), nats_port=4301, scale=phase_scale("no_data_loop"))

    assert "--scale" not in full
    assert bare[bare.index("--scale") + 1] == "explorer=0"
    assert bare[bare.index("--run-dir") + 1] == "/runs/bare"
    everything, without = scale_of(full), scale_of(bare)
    assert everything["explorer"] == 1
    assert without["explorer"] == 0
    assert without == {**everything, "explorer": 0}  # every other service as in full


def test_learner_step_ratio_full_over_no_data_loop_from_spawn_and_first_step() -> None:
    accepted = VerdictCount(verdicts=4, accepted=2, accepted_and_new=2, first_accepted_s=900.0)
    full = phase_figures(LearnerCount(6, 6, 600.0), accepted, wall_s=3600.0, cores=2)
    bare = phase_figures(LearnerCount(12, 12, 1200.0), VerdictCount(0, 0, 0, None), 3600.0, 2)

    assert full["steps_per_hour"] == 6.0
    assert full["steps_per_hour_from_first_step"] == 7.2  # 6 steps in 3000 s
    assert bare["steps_per_hour_from_first_step"] == 18.0  # 12 steps in 2400 s
    assert learner_step_ratios(full, bare) == {
        "learner_steps_per_hour_ratio": 0.5,
        "learner_steps_per_hour_ratio_from_first_step": 0.4,
    }
    names = COMPARISONS["data-loop"]
    assert ratios({"full": full, "no_data_loop": bare}, names) == {
        "steps_per_hour": 0.5,
        "accepted_per_hour": None,  # no_data_loop accepts nothing
    }


def test_ratios_are_none_without_a_step_or_a_second_phase() -> None:
    none = VerdictCount(0, 0, 0, None)
    stepped = phase_figures(LearnerCount(3, 3, 100.0), none, 600.0, 2)
    idle = phase_figures(LearnerCount(0, 0, None), none, 600.0, 2)

    assert idle["steps_per_hour_from_first_step"] is None
    assert learner_step_ratios(stepped, idle) == {
        "learner_steps_per_hour_ratio": None,
        "learner_steps_per_hour_ratio_from_first_step": None,
    }
    assert learner_step_ratios(stepped, {}) == {
        "learner_steps_per_hour_ratio": None,
        "learner_steps_per_hour_ratio_from_first_step": None,
    }


def test_llm_cpu_share_and_seconds_per_accepted_task() -> None:
    seconds = {"learner": 500.0, "llm": 300.0, "rollout": 200.0}

    figures = cpu_figures(seconds, wall_s=1000.0, cores=2, accepted=3)

    assert figures["cpu_seconds_total"] == 1000.0
    assert figures["llm_cpu_s"] == 300.0
    assert figures["llm_cpu_share_of_parts"] == 0.3
    assert figures["llm_cpu_share_of_machine"] == 0.15
    assert figures["llm_cpu_s_per_accepted"] == 100.0
    assert cpu_figures(seconds, 1000.0, 2, accepted=0)["llm_cpu_s_per_accepted"] is None
    assert cpu_figures({}, 1000.0, 2, 0)["llm_cpu_share_of_parts"] is None


def test_unknown_comparison_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="data-loop"):
        run(quick=True, base_run_dir=tmp_path, compare="explorers")
    result = CliRunner().invoke(app, ["bench", "services", "--compare", "explorers"])
    assert result.exit_code != 0
    assert "data-loop" in result.output


def test_the_table_shows_both_phases_and_the_ratio(capsys: pytest.CaptureFixture[str]) -> None:
    def phase(steps: int, accepted: int) -> dict[str, object]:
        verdicts = VerdictCount(accepted, accepted, accepted, None)
        return {
            **phase_figures(LearnerCount(steps, steps, 400.0), verdicts, 1800.0, 2),
            **cpu_figures({"llm": 900.0, "learner": 1500.0}, 1800.0, 2, accepted),
            "wall_s": 1800.0,
            "load_average_at_start": [1.5, 1.0, 0.5],
            "log": "phase.log",
            "stop": {"graceful": True, "stop_s": 3.0, "returncode": 0, "exited_early": False},
        }

    phases = {"full": phase(5, 2), "no_data_loop": phase(10, 0)}
    print_table(
        {
            "compare": "data-loop",
            "cores": 2,
            "minutes_per_phase": 30.0,
            "cpu": {"model": "Some CPU", "avx512_bf16": False},
            "phases": phases,
            "full_over_no_data_loop": ratios(phases, COMPARISONS["data-loop"]),
            **learner_step_ratios(phases["full"], phases["no_data_loop"]),
            "bench_dir": "/runs/bench",
        }
    )

    out = capsys.readouterr().out
    assert "full vs no_data_loop: 30 min each" in out
    assert "full / no_data_loop: steps per hour 0.5 from spawn" in out
    assert "450.0 s" in out  # the LLM server's CPU seconds per accepted task in full
