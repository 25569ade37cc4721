"""``coevolve bench memory`` on a short cut of a real BFCL example (two real processes)."""

from __future__ import annotations

from coevolve.bench.memory import run


def test_checkpointed_step_saves_far_fewer_bytes_for_backward() -> None:
    result = run(quick=True, tokens=256)
    assert result["tokens"] == 256
    assert result["stored"]["saved_for_backward_gb"] > 0
    assert result["saved_bytes_ratio"] < 0.5
    assert result["checkpointed"]["peak_rss_gb"] > 0 and result["stored"]["seconds"] > 0
