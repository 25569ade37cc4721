"""Paired comparison of two held-out reports (``coevolve eval --compare``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from coevolve.report.compare import UnpairedReportsError, compare_reports
from coevolve.report.stats import paired_delta


def report(policy: str, scores: list[float], partial: list[float], gt: list[float]) -> dict:
    entries = [
        {"entry_id": f"t{i}", "score": s, "partial_credit": p, "gt_logprob": g}
        for i, (s, p, g) in enumerate(zip(scores, partial, gt, strict=True))
    ]
    return {"policy": policy, "n": len(entries), "entries": entries}


def constructed_pair(gain: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """B solves tasks 0-9; A solves those and ``gain`` more, with a little more credit
    and likelihood on every task."""
    n = 100
    b_scores = [1.0 if i < 10 else 0.0 for i in range(n)]
    a_scores = [1.0 if i < 10 + gain else 0.0 for i in range(n)]
    b_partial = [1.0 if s else 0.25 for s in b_scores]
    a_partial = [1.0 if s else 0.35 for s in a_scores]
    b_gt = [-1.5 + 0.01 * (i % 7) for i in range(n)]
    a_gt = [g + 0.05 + 0.01 * (i % 3) for i, g in enumerate(b_gt)]
    return report("A", a_scores, a_partial, a_gt), report("B", b_scores, b_partial, b_gt)


def test_a_real_gain_is_significant_in_every_measure() -> None:
    a, b = constructed_pair(gain=12)
    result = compare_reports(a, b)
    assert result["n"] == 100
    assert result["delta_success"] == pytest.approx(0.12)
    assert result["delta_success_wins"] == 12 and result["delta_success_losses"] == 0
    # 12 discordant pairs all one way: exact two-sided sign test p = 2 / 2**12
    assert result["delta_success_p"] == pytest.approx(2 / 2**12)
    low, high = result["delta_success_ci"]
    assert 0 < low < 0.12 < high
    for key in ("delta_partial_credit", "delta_gt_logprob"):
        assert result[key] > 0 and result[f"{key}_ci"][0] > 0 and result[f"{key}_p"] < 0.01


def test_identical_policies_differ_by_nothing() -> None:
    a, _ = constructed_pair(gain=0)
    result = compare_reports(a, a)
    for key in ("delta_success", "delta_partial_credit", "delta_gt_logprob"):
        assert result[key] == 0 and result[f"{key}_ci"] == [0, 0] and result[f"{key}_p"] == 1


def test_two_wins_in_a_hundred_is_not_significant() -> None:
    a, b = constructed_pair(gain=2)
    result = compare_reports(a, b)
    assert result["delta_success"] == pytest.approx(0.02)
    assert result["delta_success_p"] == pytest.approx(0.5)
    assert result["delta_success_ci"][0] <= 0


def test_the_permutation_test_sees_a_shift_the_sign_of_which_is_mixed() -> None:
    before = [float(i % 5) for i in range(60)]
    after = [v + (0.3 if i % 4 else -0.1) for i, v in enumerate(before)]
    delta = paired_delta(after, before)
    assert delta.mean == pytest.approx(sum(a - b for a, b in zip(after, before, strict=True)) / 60)
    assert delta.p < 0.001 and delta.low > 0


def test_one_paired_task_has_a_permutation_p_value_of_one() -> None:
    delta = paired_delta([0.9], [0.2])
    assert (delta.mean, delta.p, delta.n) == (pytest.approx(0.7), 1.0, 1)


def test_reports_of_different_tasks_are_refused() -> None:
    a, b = constructed_pair(gain=1)
    b["entries"] = b["entries"][:-1]
    with pytest.raises(UnpairedReportsError, match="different tasks"):
        compare_reports(a, b)


def test_a_measure_one_report_lacks_is_reported_as_missing() -> None:
    a, b = constructed_pair(gain=3)
    for entry in b["entries"]:
        entry["gt_logprob"] = None
    result = compare_reports(a, b)
    assert result["delta_gt_logprob"] is None and result["delta_gt_logprob_n"] == 0
    assert result["delta_success"] == pytest.approx(0.03)


def test_the_command_compares_two_saved_reports(tmp_path: Path) -> None:
    a, b = constructed_pair(gain=12)
    (tmp_path / "a.json").write_text(json.dumps(a, indent=1))  # as --out writes it
    (tmp_path / "b.json").write_text("progress line\n" + json.dumps(b))  # a --json capture
    argv = [sys.executable, "-m", "coevolve", "eval", "--suite", "bfcl-turns-base"]
    argv += ["--compare", str(tmp_path / "a.json"), str(tmp_path / "b.json"), "--json"]
    argv += ["--out", str(tmp_path / "cmp.json")]
    done = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=120)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["delta_success"] == pytest.approx(0.12)
    assert result["delta_success_p"] < 0.001
    assert json.loads((tmp_path / "cmp.json").read_text())["n"] == 100
    assert "success" in done.stderr and "95% CI" in done.stderr  # for people; JSON on stdout


def test_the_command_names_a_report_that_does_not_exist(tmp_path: Path) -> None:
    a, _ = constructed_pair(gain=1)
    (tmp_path / "a.json").write_text(json.dumps(a))
    argv = [sys.executable, "-m", "coevolve", "eval", "--suite", "bfcl-turns-base"]
    argv += ["--compare", str(tmp_path / "a.json"), str(tmp_path / "missing.json")]
    done = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=120)
    assert done.returncode == 2
    said = " ".join(done.stderr.replace("│", " ").split())  # the error box wraps lines
    assert "no such report file" in said and "--compare" in said
