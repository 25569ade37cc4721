"""The CPU-per-token bookkeeping shared by the engine benchmarks."""

from __future__ import annotations

import pytest

from coevolve.bench.engines import EVAL_BATCH, QUICK, CpuPerToken, play


def test_cpu_per_token_is_reported_per_workload_and_engine() -> None:
    measured = CpuPerToken(
        cpu_s={"group": {"a": 1.5, "b": 3.0}, "eval": {"a": 2.0, "b": 0.0}},
        tokens={"group": {"a": 100, "b": 150}, "eval": {"a": 40, "b": 0}},
    )
    assert measured.ms_per_token() == {
        "group": {"a": 15.0, "b": 20.0},
        "eval": {"a": 50.0, "b": 0.0},
    }
    facts = measured.facts(QUICK)
    assert facts["eval_tasks"] == QUICK.eval_tasks == EVAL_BATCH == 8
    assert facts["ms_per_token"] == measured.ms_per_token()
    assert facts["cpu_s"]["group"] == {"a": 1.5, "b": 3.0}


def test_group_and_eval_engines_must_have_the_same_names() -> None:
    with pytest.raises(ValueError, match="same names"):
        play({"a": object()}, {"b": object()}, QUICK, print)
