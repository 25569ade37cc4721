"""How the benchmarks drive the lockstep loop: numbered rounds, one line each, the records
seen after each round, and an early end once the benchmark has what it needs."""

from __future__ import annotations

from typing import Any

import pytest

from coevolve.bench.lockstep_runs import drive


def test_rounds_run_in_order_until_the_benchmark_has_enough(
    capsys: pytest.CaptureFixture[str],
) -> None:
    seen: list[int] = []

    def play(index: int) -> dict[str, Any]:
        return {"round": index, "pairs": 2 * index}

    records = drive(
        10,
        play,
        lambda r: f"round {r['round']}: {r['pairs']} pairs",
        after=lambda so_far: seen.append(len(so_far)),
        until=lambda so_far: sum(r["pairs"] for r in so_far) >= 6,
    )

    assert [r["round"] for r in records] == [1, 2]  # 2 + 4 pairs: enough after round 2
    assert seen == [1, 2]
    assert capsys.readouterr().out.splitlines() == ["round 1: 2 pairs", "round 2: 4 pairs"]
    assert len(drive(3, play, str)) == 3  # without an end condition: every round
