"""``coevolve bench ddp --quick``: two gloo ranks train the weights one rank does."""

from __future__ import annotations

from coevolve.bench import ddp


def test_two_ranks_end_where_one_rank_does() -> None:
    result = ddp.run(quick=True)
    assert result["max_param_diff"] <= ddp.TARGET_MAX_PARAM_DIFF
    assert result["within_target"] is True
    assert result["losses"]["1"][0] == result["losses"]["2"][0]
    assert result["trained_tokens"] > 0  # the groups had mixed rewards: the steps trained
    assert set(result["step_s"]) == {"1", "2"} and all(s > 0 for s in result["step_s"].values())
