"""The ablation's bookkeeping: statistics, aggregation of result files, resume, pacing,
the committed warm start."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from nats.errors import NoRespondersError
from typer.testing import CliRunner

from coevolve.cli import app
from coevolve.code_version import code_version
from coevolve.experiment import ablation
from coevolve.experiment.ablation import (
    RUN_RECORD,
    ArmRun,
    ExperimentSpec,
    Pacer,
    ResultsMismatchError,
    WarmStart,
    arm_dir,
    arm_settings,
    committed_warm_start,
    pending,
    result_path,
    run_arm,
    run_experiment,
    send_unguided,
)
from coevolve.experiment.aggregate import (
    MEASURES,
    load_results,
    mark_scores,
    measure_intervals,
    paired_differences,
    paired_intervals,
    paired_p_values,
    render_experiment_report,
    turn_differences,
)
from coevolve.harness import UpRun
from coevolve.report.stats import mean_interval, paired_bootstrap_interval
from coevolve.shared.config import BusSettings
from coevolve.shared.runtime.bus import Bus
from coevolve.shared.runtime.nats_server import NatsServer
from tests.support.harness import IDLE_UP, standin_up

T_975_1DF = 12.706204736


def test_mean_interval_is_the_t_interval() -> None:
    interval = mean_interval([0.2, 0.4])

    assert interval.mean == pytest.approx(0.3)
    assert interval.low == pytest.approx(0.3 - T_975_1DF * 0.1, rel=1e-6)
    assert interval.high == pytest.approx(0.3 + T_975_1DF * 0.1, rel=1e-6)
    assert mean_interval([0.5]) == mean_interval([0.5, 0.5, 0.5]).__class__(0.5, 0.5, 0.5, 1)


def test_paired_bootstrap_spans_the_seeds_and_the_tasks() -> None:
    # one seed, two tasks: resampled means are 0, 0.5 or 1 (p = 1/4, 1/2, 1/4)
    over_tasks = paired_bootstrap_interval({0: [0.0, 1.0]})
    assert (over_tasks.mean, over_tasks.low, over_tasks.high) == (0.5, 0.0, 1.0)
    # constant within each seed: only the seed draw varies (0.25, 0.325 or 0.4)
    over_seeds = paired_bootstrap_interval({0: [0.25, 0.25], 1: [0.4, 0.4]})
    assert over_seeds.mean == pytest.approx(0.325)
    assert (over_seeds.low, over_seeds.high) == (0.25, 0.4)
    assert over_seeds.excludes_zero and not over_tasks.excludes_zero
    with pytest.raises(ValueError):
        paired_bootstrap_interval({})


WARM = "a" * 64


def write_result(
    results: Path,
    arm: str,
    seed: int,
    scores: dict[str, float],
    code: str = "c0ffee",
    warm: str = WARM,
    **fields: Any,
) -> None:
    """A finished arm: one end mark whose per-task success is ``scores`` (partial credit
    the same, log-likelihood its negative)."""
    summary = {
        "learner_steps": 10 + seed,
        "groups_recorded": 20,
        "policy_versions": 3,
        "signals_by_kind": {"boundary": 2} if arm == "coevolve" else {},
        "candidates": 4 if arm != "none" else 0,
        "accepted": 2 if arm != "none" else 0,
        "pool_by_origin": {"seed": 5, "synthesized": 2 if arm != "none" else 0},
        "stage_seconds": {"learner: training steps": 120.0},
    }
    tasks = {t: [s, s, -1.0 + s] for t, s in scores.items()}
    result = {
        "arm": arm,
        "seed": seed,
        "minutes": 10.0,
        "end_minute": 10.0,
        "ended_by": "minutes",
        "code_version": code,
        "warm_start_sha256": warm,
        "machine": {"cpu": "AMD EPYC", "cores": 2, "avx512_bf16": True, "dtype": "bfloat16"},
        "cpu_seconds": {"rollout": 500.0, "learner": 400.0, "llm": 300.0 if arm != "none" else 0},
        "added_minutes": [3.0, 7.5] if arm != "none" else [],
        "marks": [
            {"mark": "end", "minute": 10.0, "policy_version": 3, "eval": {"tasks": tasks}},
        ],
        "summary": summary,
        **fields,
    }
    path = result_path(results, arm, seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result))


@pytest.fixture
def results_dir(tmp_path: Path) -> Path:
    results = tmp_path / "results"
    per_seed = {
        0: {"coevolve": 0.75, "random": 0.5, "none": 0.5},
        1: {"coevolve": 0.9, "random": 0.5, "none": 0.25},
    }
    for seed, arms in per_seed.items():
        for arm, score in arms.items():
            write_result(results, arm, seed, {"t1": score, "t2": score})
    (results / "warm-start.json").write_text(json.dumps({"sha256": WARM}))
    warm_tasks = {"t1": [0.25, 0.25, -0.75], "t2": [0.25, 0.25, -0.75]}
    (results / "eval-v1.json").write_text(
        json.dumps({"tasks": warm_tasks, "warm_start_sha256": WARM})
    )
    return results


def test_aggregation_of_result_files(results_dir: Path) -> None:
    found = load_results(results_dir)
    scores = mark_scores(found.kept, found.warm_eval)
    success = measure_intervals(scores, 0)

    coevolve = success["coevolve"]["end"]
    assert coevolve.mean == pytest.approx(0.825)
    assert coevolve.high - coevolve.mean == pytest.approx(T_975_1DF * 0.075, rel=1e-6)
    assert success["none"]["0"].mean == 0.25  # the shared warm start
    # every turn's difference is averaged over the two seeds first: 0.25 and 0.4 -> 0.325
    better = paired_intervals(scores, "coevolve", "random")["end"]
    assert (better.mean, better.low, better.high, better.n) == pytest.approx((0.325,) * 3 + (2,))
    control = paired_differences(scores, "random", "none")["end"]
    assert control.turns.mean == pytest.approx(0.125)
    assert control.per_seed == {0: 0.0, 1: 0.25}
    assert control.over_seeds is None  # two seeds: no interval over seeds
    assert "0" not in paired_intervals(scores, "coevolve", "random")
    likelihood = paired_intervals(scores, "coevolve", "none", measure=2)["end"]
    assert likelihood.mean == pytest.approx(0.45)


def test_p_values_take_the_turn_as_the_unit(tmp_path: Path) -> None:
    results = tmp_path / "results"
    turns = [f"t{i}" for i in range(6)]
    # seed 0: coevolve solves five turns random does not; seed 1: four, and loses t4
    write_result(results, "coevolve", 0, dict.fromkeys(turns[:5], 1.0) | {"t5": 0.0})
    write_result(results, "random", 0, dict.fromkeys(turns, 0.0))
    write_result(results, "coevolve", 1, dict.fromkeys(turns[:4], 1.0) | {"t4": 0.0, "t5": 0.0})
    write_result(results, "random", 1, dict.fromkeys(turns, 0.0) | {"t4": 1.0})
    scores = mark_scores(load_results(results).kept, None)

    # t4 won in seed 0 and lost in seed 1: the two cancel, and the turn is a tie
    by_turn = turn_differences(scores, "coevolve", "random", "end", 0)
    assert by_turn == {"t0": 1.0, "t1": 1.0, "t2": 1.0, "t3": 1.0, "t4": 0.0, "t5": 0.0}
    # 4 turns gained, none lost: two-sided exact sign test, 2 / 2^4 (pooling the
    # (seed, turn) pairs would count 9 gained and 1 lost, p = 22 / 1024)
    assert paired_p_values(scores, "coevolve", "random") == {"end": pytest.approx(2 / 16)}
    compared = paired_differences(scores, "coevolve", "random")["end"]
    assert compared.turns.mean == pytest.approx(4 / 6) and compared.turns.n == 6
    assert compared.per_seed == {0: pytest.approx(5 / 6), 1: pytest.approx(3 / 6)}
    assert paired_p_values(scores, "coevolve", "none") == {}


def test_a_seed_repeated_under_another_number_leaves_the_statistics_unchanged(
    tmp_path: Path,
) -> None:
    """A seed's copy adds no turn: the p-values and intervals over turns stay the same,
    and only the per-seed column grows."""
    results = tmp_path / "results"
    first = {"t0": 1.0, "t1": 1.0, "t2": 1.0, "t3": 0.75, "t4": 0.0, "t5": 0.5, "t6": 1.0}
    second = {"t0": 0.0, "t1": 0.25, "t2": 0.5, "t3": 0.75, "t4": 0.25, "t5": 0.0, "t6": 0.0}
    write_result(results, "coevolve", 0, first)
    write_result(results, "random", 0, second)
    one_seed = mark_scores(load_results(results).kept, None)
    write_result(results, "coevolve", 1, first)
    write_result(results, "random", 1, second)
    two_seeds = mark_scores(load_results(results).kept, None)

    for _, measure in MEASURES:
        once = paired_differences(one_seed, "coevolve", "random", measure)["end"]
        twice = paired_differences(two_seeds, "coevolve", "random", measure)["end"]
        assert twice.p == once.p < 1.0
        assert twice.turns == once.turns
        assert twice.per_seed == {0: once.per_seed[0], 1: once.per_seed[0]}


PAIRED_INTERVAL_SCRIPT = """
import sys
from pathlib import Path
from coevolve.experiment.aggregate import load_results, mark_scores, paired_intervals
found = load_results(Path(sys.argv[1]))
print(paired_intervals(mark_scores(found.kept, found.warm_eval), "coevolve", "random"))
"""


def test_paired_intervals_do_not_depend_on_the_string_hash(tmp_path: Path) -> None:
    """Task ids are strings, whose set order changes with PYTHONHASHSEED: a report made
    twice from the same results must not."""
    results = tmp_path / "results"
    for arm, step in (("coevolve", 0.37), ("random", 0.61)):
        write_result(results, arm, 0, {f"t{i}": (i * step) % 1 for i in range(40)})
    outputs = {
        subprocess.run(
            [sys.executable, "-c", PAIRED_INTERVAL_SCRIPT, str(results)],
            env={**os.environ, "PYTHONHASHSEED": str(hash_seed)},
            capture_output=True,
            text=True,
            check=True,
            timeout=120,
        ).stdout
        for hash_seed in (1, 2, 3)
    }
    assert len(outputs) == 1, outputs
    assert "Interval(" in outputs.pop()


def test_experiment_report_renders(results_dir: Path) -> None:
    result = CliRunner().invoke(app, ["experiment", "report", str(results_dir)])

    assert result.exit_code == 0, result.output
    report_dir = results_dir / "report"
    text = (report_dir / "report.md").read_text()
    for name in ("heldout.png", "differences.png", "data_loop.png", "cpu.png"):
        assert (report_dir / name).stat().st_size > 5_000, name
    # each of the two turns: the seeds' differences averaged (two turns won: p = 2 / 4)
    assert (
        "| coevolve - random | success | end | 0.325 [0.325, 0.325] (n=2) | yes, n/a | 0.500 "
        "| s0 +0.250, s1 +0.400 | n/a (fewer than 3 seeds) |" in text
    )
    assert (
        "| random - none | success | end | 0.125 [0.125, 0.125] (n=2) | yes, n/a | 0.500 "
        "| s0 +0.000, s1 +0.250 | n/a (fewer than 3 seeds) |" in text
    )
    assert (
        "| coevolve - none | log-likelihood | end | 0.450 [0.450, 0.450] (n=2) | yes, n/a | 0.500 "
        "| s0 +0.250, s1 +0.650 | n/a (fewer than 3 seeds) |" in text
    )
    assert "| 0 | 0.250 [0.250, 0.250] (n=2)" in text
    assert (
        "| coevolve | 2 | 10.0 ± 0.0 | minutes | 10.5 ± 6.4 | 20.0 ± 0.0 | 15.0 ± 0.0 | 5.0 ± 0.0 |"
        in text
    )
    assert "| none | 2 |" in text and "none yet" in text  # no candidates in none
    # end - v1 per seed: 0.5 and 0.65; two seeds give no interval over seeds
    assert (
        "| coevolve | success | 0.575 | s0 +0.500, s1 +0.650 | n/a (fewer than 3 seeds) | " in text
    )
    assert "Code: c0ffee." in text
    assert f"sha256 `{WARM}`" in text and "Not pooled" not in text


def test_the_report_says_when_arms_ran_on_different_code(tmp_path: Path) -> None:
    write_result(tmp_path, "coevolve", 0, {"t1": 1.0}, code="c0ffee")
    write_result(tmp_path, "random", 0, {"t1": 0.0}, code="decade+dirty")
    text = render_experiment_report(tmp_path).read_text()
    assert "Code: c0ffee, decade+dirty (**arms ran on different code**)" in text


def test_results_from_another_warm_start_are_not_pooled(results_dir: Path) -> None:
    write_result(results_dir, "coevolve", 2, {"t1": 0.0, "t2": 0.0}, warm="b" * 64)

    found = load_results(results_dir)
    text = render_experiment_report(results_dir).read_text()

    assert [(r["arm"], r["seed"]) for r in found.excluded] == [("coevolve", 2)]
    assert len(found.kept) == 6
    assert "**Not pooled: coevolve s2**" in text
    assert (
        "| coevolve - random | success | end | 0.325 [0.325, 0.325] (n=2) | yes, n/a | 0.500 "
        in text
    )


def test_three_seeds_give_an_interval_over_the_seeds_own_differences(tmp_path: Path) -> None:
    results = tmp_path / "results"
    for seed, gain in enumerate((0.25, 0.5, 0.75)):
        write_result(results, "coevolve", seed, {"t1": gain, "t2": gain})
        write_result(results, "none", seed, {"t1": 0.0, "t2": 0.0})
    text = render_experiment_report(results).read_text()

    over_seeds = mean_interval([0.25, 0.5, 0.75])
    assert (
        "| coevolve - none | success | end | 0.500 [0.500, 0.500] (n=2) | yes, no | 0.500 "
        "| s0 +0.250, s1 +0.500, s2 +0.750 "
        f"| 0.500 [{over_seeds.low:.3f}, {over_seeds.high:.3f}] (n=3) |" in text
    )
    assert "n/a (fewer than 3 seeds)" not in text


def test_report_of_an_empty_experiment(tmp_path: Path) -> None:
    text = render_experiment_report(tmp_path).read_text()

    assert "Held-out measures: none yet." in text
    assert "Finished arm x seed: none yet." in text


def test_finished_arms_are_skipped(tmp_path: Path) -> None:
    spec = ExperimentSpec(("none", "random", "coevolve"), (0, 1), minutes=10.0)
    assert spec.plan()[:3] == [("coevolve", 0), ("random", 0), ("none", 0)]
    write_result(tmp_path, "coevolve", 0, {"t1": 1.0})
    write_result(tmp_path, "none", 1, {"t1": 1.0})

    assert pending(spec, tmp_path) == [("random", 0), ("none", 0), ("coevolve", 1), ("random", 1)]
    # a job that takes one run at a time (--max-runs 1) takes the next in the plan
    assert pending(spec, tmp_path, max_runs=1) == [("random", 0)]
    assert pending(spec, tmp_path, max_runs=9) == pending(spec, tmp_path)


def test_a_finished_experiment_starts_nothing(tmp_path: Path) -> None:
    results = tmp_path / "results"
    spec = ExperimentSpec(("none", "coevolve"), (0,), minutes=10.0)
    for arm in spec.arms:
        write_result(results, arm, 0, {"t1": 1.0})

    assert run_experiment(spec, tmp_path, results, tmp_path / "base", log=lambda _: None) == []
    assert not (tmp_path / "warm").exists()
    with pytest.raises(ResultsMismatchError, match=r"minutes = 10\.0"):
        run_experiment(ExperimentSpec(("none",), (0,), minutes=5.0), tmp_path, results, tmp_path)


def test_a_resume_without_the_no_label_config_is_refused(tmp_path: Path) -> None:
    results = tmp_path / "results"
    config = tmp_path / "config.yaml"
    config.write_text("labels: none\n")
    no_labels = ExperimentSpec(("none",), (0,), minutes=10.0, base_config=str(config))
    write_result(results, "none", 0, {"t1": 1.0})
    assert run_experiment(no_labels, tmp_path, results, tmp_path, log=lambda _: None) == []

    labelled = ExperimentSpec(("none",), (0,), minutes=10.0)
    with pytest.raises(ResultsMismatchError, match="setting = no_labels, not labelled"):
        run_experiment(labelled, tmp_path, results, tmp_path, log=lambda _: None)


def test_an_arm_whose_run_is_over_resumes_at_its_evaluation(
    tmp_path: Path, pool_only_run: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Stopped after its run but before its result file, an arm is evaluated from its run
    record, not run again."""
    out, results = tmp_path / "out", tmp_path / "results"
    directory = arm_dir(out, "none", 0)
    directory.mkdir(parents=True)
    pool_only_run.rename(directory / "run")
    record = {
        "arm": "none",
        "seed": 0,
        "ended_by": "minutes",
        "end_minute": 140.0,
        "cpu_seconds": {"learner": 1.0},
        "mark_versions": [["end", 140.0, 1]],  # no step taken: the end policy is v1
    }
    (directory / RUN_RECORD).write_text(json.dumps(record))
    warm_tasks = {"t1": [0.0, 0.25, -0.75]}
    results.mkdir()
    (results / "eval-v1.json").write_text(
        json.dumps({"tasks": warm_tasks, "warm_start_sha256": WARM})
    )

    def no_second_run(*args: object) -> None:
        raise AssertionError("the arm's run started again")

    monkeypatch.setattr(ablation, "start_up", no_second_run)
    spec = ExperimentSpec(("none",), (0,), minutes=140.0)
    warm = WarmStart(results / "warm-start.safetensors", WARM)
    result = run_arm(ArmRun(spec, out, results, "none", 0, warm, tmp_path / "base", lambda _: None))

    assert json.loads(result_path(results, "none", 0).read_text()) == result
    assert result["cpu_seconds"] == {"learner": 1.0} and "mark_versions" not in result
    assert result["marks"] == [
        {"mark": "end", "minute": 140.0, "policy_version": 1, "eval": {"tasks": warm_tasks}}
    ]
    assert result["summary"]["pool_by_origin"] == {"seed": 4}


# a stand-in for up that has written policy v1 and its checkpoint
WRITES_V1 = """
import json, pathlib, signal, sys, time
signal.signal(signal.SIGINT, signal.default_int_handler)
run = pathlib.Path(sys.argv[1])
for name in ("checkpoints/learner.pt", "policies/v1.safetensors"):
    (run / name).parent.mkdir(parents=True, exist_ok=True)
    (run / name).write_bytes(b"v1")
(run / "up.json").write_text(json.dumps({"nats_url": "nats://127.0.0.1:4999"}))
time.sleep(120)
"""


def test_the_warm_start_runs_up_until_v1_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ablation, "WARM_POLL_S", 0.05)
    monkeypatch.setattr(ablation, "GROUPS_AFTER_CHECKPOINT_S", 0.0)
    started: list[UpRun] = []

    def writes_v1(run: Path, log_path: Path, *args: object) -> UpRun:
        started.append(standin_up(run, log_path, WRITES_V1))
        return started[-1]

    monkeypatch.setattr(ablation, "start_up", writes_v1)
    lines: list[str] = []
    run = ablation.run_until_v1(tmp_path / "warm", tmp_path, lines.append)

    assert (run / "policies" / "v1.safetensors").read_bytes() == b"v1"
    assert started[0].stopped is not None and not started[0].running
    assert json.loads((tmp_path / "warm" / "done.json").read_text())["seconds"] >= 0.0
    assert lines[0] == f"[experiment] warm start in {run}"
    assert re.fullmatch(r"\[experiment\] warm start done in \d+ s", lines[1])
    assert ablation.run_until_v1(tmp_path / "warm", tmp_path, lines.append) == run
    assert len(started) == 1  # done once: not run again

    def exits(run: Path, log_path: Path, *args: object) -> UpRun:
        return standin_up(run, log_path, IDLE_UP.replace("time.sleep(120)", "sys.exit(3)"))

    monkeypatch.setattr(ablation, "start_up", exits)
    with pytest.raises(RuntimeError, match=r"exited with 3 \(see .*up\.log\)"):
        ablation.run_until_v1(tmp_path / "failed", tmp_path, lines.append)
    assert not (tmp_path / "failed" / "done.json").exists()


def test_a_committed_warm_start_is_adopted_and_checked(tmp_path: Path) -> None:
    blob = b"weights of v1"
    (tmp_path / "warm-start.safetensors").write_bytes(blob)
    digest = hashlib.sha256(blob).hexdigest()
    (tmp_path / "warm-start.json").write_text(json.dumps({"sha256": digest}))

    warm = committed_warm_start(tmp_path)
    assert warm is not None and warm.sha256 == digest
    config, _ = arm_settings("none", 0, None, warm)
    adopted = config["services"]["learner"]["warm_start"]
    assert adopted == {"from_policy": str(warm.path.resolve()), "from_policy_sha256": digest}

    (tmp_path / "warm-start.safetensors").write_bytes(b"other weights")
    with pytest.raises(ResultsMismatchError, match="does not match"):
        committed_warm_start(tmp_path)
    assert committed_warm_start(tmp_path / "empty") is None


def test_marks_come_before_the_end() -> None:
    assert ExperimentSpec(("none",), (0,), 25.0, eval_every_minutes=10.0).marks() == [10.0, 20.0]
    assert ExperimentSpec(("none",), (0,), 20.0, eval_every_minutes=10.0).marks() == [10.0]
    assert ExperimentSpec(("none",), (0,), 3.0, eval_every_minutes=10.0).marks() == []


def test_pacer_matches_the_reference_curve_with_a_lead() -> None:
    pacer = Pacer([1.0, 1.5, 6.0], lead_minutes=2.0, in_flight_minutes=5.0, max_in_flight=2)

    assert pacer.requests_due(0.0) == 2  # two tasks due by minute 2
    assert pacer.requests_due(0.5) == 0  # both still in flight
    pacer.answered()
    pacer.answered()
    pacer.added = 2
    assert pacer.requests_due(3.0) == 0  # caught up
    assert pacer.requests_due(4.5) == 1  # the third is due by 6.5
    assert pacer.requests_due(9.0) == 0  # in flight until 9.5
    assert pacer.requests_due(9.6) == 1  # expired unanswered: ask again
    assert pacer.sent == 4


def test_requests_not_sent_are_due_again() -> None:
    pacer = Pacer([1.0, 1.5], lead_minutes=2.0, max_in_flight=2)
    assert pacer.requests_due(0.0) == 2
    pacer.not_sent(2)
    assert pacer.sent == 0
    assert pacer.requests_due(0.1) == 2


@pytest.mark.anyio
async def test_the_random_arm_waits_for_a_pool_store_that_does_not_answer_yet(
    nats_server: NatsServer,
) -> None:
    """At a run's start pool-store may not answer yet: the requests stay due, the arm runs on."""
    pacer = Pacer([0.5], lead_minutes=2.0)
    due = pacer.requests_due(0.0)
    lines: list[str] = []
    settings = BusSettings(url=nats_server.url, request_timeout_s=1.0)
    bus = await Bus.connect(settings, name="test")
    try:
        sent = await send_unguided(bus, pacer, due, seed=0, labelled=False, log=lines.append)
    finally:
        await bus.close()
    assert (due, sent, pacer.sent) == (1, 0, 0)
    no_answer = repr(NoRespondersError())
    assert lines == [f"unguided requests not sent, tried again at the next tick: {no_answer}"]
    assert pacer.requests_due(0.1) == 1


def test_an_arm_that_ended_by_minutes_before_its_steps_is_not_pooled(tmp_path: Path) -> None:
    results = tmp_path / "results"
    write_result(results, "coevolve", 0, {"t1": 1.0}, steps=10, ended_by="steps")
    write_result(results, "none", 0, {"t1": 0.0}, steps=10, ended_by="steps")
    write_result(results, "coevolve", 1, {"t1": 1.0}, steps=10, ended_by="minutes")
    found = load_results(results)
    assert [(r["arm"], r["seed"]) for r in found.kept] == [("none", 0), ("coevolve", 0)]
    assert [(r["arm"], r["seed"]) for r in found.short] == [("coevolve", 1)]
    report = render_experiment_report(results, tmp_path / "report")
    assert "**Not pooled: coevolve s1** reached the minutes cap" in report.read_text()


def test_a_no_label_base_configuration_is_the_no_label_setting(tmp_path: Path) -> None:
    config = tmp_path / "base.yaml"
    config.write_text("labels: none\nd0: {file: docs/results/d0-20261129.json}\n")
    spec = ExperimentSpec(("none", "random", "coevolve"), (0,), 10.0, base_config=str(config))
    assert spec.setting() == "no_labels"
    # every arm's run directory is elsewhere: the file is named from here
    assert spec.base_settings()["d0"]["file"] == str(
        Path("docs/results/d0-20261129.json").resolve()
    )
    assert ExperimentSpec(("none",), (0,), 10.0).setting() == "labelled"
    # the warm start's up reads the same, from a file of its own
    written = ablation.base_config_file(spec, tmp_path / "out")
    assert written is not None
    assert yaml.safe_load(written.read_text())["d0"]["file"] == spec.base_settings()["d0"]["file"]
    assert ablation.base_config_file(ExperimentSpec(("none",), (0,), 10.0), tmp_path) is None


def test_arms_differ_only_in_synthesis() -> None:
    assert arm_settings("none", 1)[1] == ["explorer=0"]
    random_config, random_scale = arm_settings("random", 1)
    assert random_config["services"]["signal_monitor"]["detectors"]["kinds"] == []
    assert random_scale == []
    assert arm_settings("coevolve", 1) == (
        {"services": {"signal_monitor": {"detectors": {"reservoir_seed": 1}}}},
        [],
    )


def test_navigation_arms_have_no_explorer_and_differ_only_in_the_distiller() -> None:
    off, off_scale = arm_settings("navigate_off", 0)
    on, on_scale = arm_settings("navigate_on", 0)
    assert off_scale == on_scale == ["explorer=0"]
    assert off["services"]["distiller"] == {"enabled": False}
    assert on["services"]["distiller"] == {"enabled": True}
    del off["services"]["distiller"], on["services"]["distiller"]
    assert off == on


def test_arms_lay_their_settings_over_the_base_configuration() -> None:
    base: dict[str, Any] = {
        "services": {
            "learner": {"grpo": {"lr": 1e-5}},
            "signal_monitor": {"detectors": {"threshold": 0.3, "kinds": ["rare"]}},
        }
    }
    config, _ = arm_settings("random", 2, base)

    assert config["services"]["learner"] == {"grpo": {"lr": 1e-5}}
    assert config["services"]["signal_monitor"]["detectors"] == {
        "threshold": 0.3,
        "kinds": [],
        "reservoir_seed": 2,
    }
    assert base["services"]["signal_monitor"]["detectors"]["kinds"] == ["rare"]  # untouched


def test_code_version_names_the_package_trees() -> None:
    version = code_version()
    if version is None:
        pytest.skip("not a git checkout")
    assert re.fullmatch(r"[0-9a-f]{12}(\+dirty)?", version)
    assert code_version("no-such-commit") is None


def standin(run: Path, log_path: Path, *args: object) -> UpRun:
    """What ``ablation.start_up`` starts in these tests: a stand-in for up."""
    return standin_up(run, log_path)


def test_an_arm_records_the_code_its_services_started_from(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A commit made while an arm runs does not become the arm's code version."""
    versions = iter(["started-code", "later-code"])
    monkeypatch.setattr(ablation, "code_version", lambda: next(versions))
    monkeypatch.setattr(ablation, "start_up", standin)

    async def finished_arm(url: str, *args: object, **kwargs: object) -> ablation.ArmLive:
        assert url == "nats://127.0.0.1:4999"  # the one its up recorded
        assert ablation.code_version() == "later-code"  # the tree changed meanwhile
        return ablation.ArmLive(end_minute=3.0, end_version=2, ended_by="steps")

    monkeypatch.setattr(ablation, "control_arm", finished_arm)
    spec = ExperimentSpec(("none",), (0,), minutes=140.0, steps=1)
    warm = WarmStart(tmp_path / "warm-start.safetensors", WARM)
    record = ablation.run_arm_until_end(
        ArmRun(
            spec, tmp_path / "out", tmp_path / "results", "none", 0, warm, tmp_path, lambda _: None
        )
    )
    assert record["code_version"] == "started-code"
    assert record["cpu_seconds"]  # its stand-in for up, sampled as it stopped
    assert record["mark_versions"][-1] == ("end", 3.0, 2)


def test_a_mechanism_arm_is_the_defaults_with_its_switch_on() -> None:
    coevolve, _ = arm_settings("coevolve", 2)
    navigate, scale = arm_settings("navigate", 2)
    assert scale == []
    assert navigate["services"]["distiller"] == {"enabled": True}
    assert navigate["services"]["signal_monitor"] == coevolve["services"]["signal_monitor"]
    attribute, _ = arm_settings("attribute", 2)
    assert attribute["services"]["rollout"] == {"step_credit": {"enabled": True}}
    assert "distiller" not in attribute["services"]
    both, _ = arm_settings("both", 2)
    assert both["services"]["distiller"] == {"enabled": True}
    assert both["services"]["rollout"] == {"step_credit": {"enabled": True}}
    with pytest.raises(ValueError, match="unknown arm"):
        arm_settings("nope", 2)


def test_an_objective_arm_is_a_configuration_up_accepts_and_is_compared_with_coevolve(
    tmp_path: Path,
) -> None:
    from coevolve.cli.sections import check_sections
    from coevolve.shared.config import Settings

    for arm in ("eto", "coevolving_dpo"):
        settings, scale = arm_settings(arm, 1)
        assert scale == []
        check_sections(Settings(services=settings["services"]))  # raises if half is missing
    eto, _ = arm_settings("eto", 1)
    assert eto["services"]["learner"]["grpo"]["objective"] == "eto"
    results = tmp_path / "results"
    for seed in (0, 1):
        write_result(results, "coevolve", seed, {"t1": 0.5, "t2": 0.5})
        write_result(results, "coevolving_dpo", seed, {"t1": 0.75, "t2": 0.5})
    text = render_experiment_report(results).read_text()
    assert "| coevolving_dpo - coevolve | success | end |" in text
    assert text.startswith("# Experiment: coevolve vs coevolving_dpo\n")


def test_the_report_gives_each_arm_its_uniform_share_and_role_llm_seconds_per_step(
    tmp_path: Path,
) -> None:
    results = tmp_path / "results"
    for seed in (0, 1):
        write_result(results, "coevolve", seed, {"t1": 0.5})
    for seed, (uniform, label_s, distil_s) in enumerate([(0.25, 100.0, 20.0), (0.75, 300.0, 0.0)]):
        summary_fields: dict[str, Any] = {"uniform_share": uniform, "experiences": 2 + seed}
        summary_fields["experiences_dropped"] = {"unknown_function": 1 + seed, "incomplete": 1}
        summary_fields["role_llm_seconds"] = {"attributor": label_s, "distiller": distil_s}
        write_result(results, "both", seed, {"t1": 0.5})
        path = result_path(results, "both", seed)
        result = json.loads(path.read_text())
        result["summary"].update(summary_fields)
        path.write_text(json.dumps(result))

    text = render_experiment_report(results).read_text()

    # both: 10 and 11 learner steps; 100/10 and 300/11 attributor seconds a step
    assert "| both | 2 | 0.500 ± " in text
    row = next(line for line in text.splitlines() if line.startswith("| both | 2 | 0.500"))
    assert f"{(10.0 + 300 / 11) / 2:.1f} ± " in row and "| 2.5 ± " in row
    # what the distiller dropped, summed over the seeds, by reason
    assert row.endswith("| 5 (unknown_function 3, incomplete 2) |")
    # results written before these fields read as no mechanism cost
    assert "| coevolve | 2 | - | 0.0 ± 0.0 | 0.0 ± 0.0 | 0.0 ± 0.0 | 0 |" in text


def test_the_mechanism_columns_show_only_when_a_mechanism_spent_time(results_dir: Path) -> None:
    text = render_experiment_report(results_dir).read_text()

    assert "| arm | seeds | uniform-group share |\n" in text
    assert "LLM s per step" not in text and "experiences drawn" not in text


def test_the_report_gives_the_share_of_the_controls_gain_and_each_arms_exposure(
    tmp_path: Path,
) -> None:
    results = tmp_path / "results"
    exposed = {
        "exposure_first_half": 0.5,
        "exposure_second_half": 0.25,
        "median_versions_to_first_draw": 2,
    }
    for seed in (0, 1, 2):
        write_result(results, "none", seed, {"t1": 0.25, "t2": 0.25})
        write_result(results, "coevolve", seed, {"t1": 0.5, "t2": 0.5}, exposure=exposed)
        write_result(results, "labelled_control", seed, {"t1": 0.75, "t2": 0.75})

    text = render_experiment_report(results).read_text()

    # coevolve gains 0.25 over none where the control gains 0.5: half its gain
    assert (
        "(coevolve - none) / (labelled_control - none) at the end: 0.50 (+0.250 of +0.500; "
        "seeds s0, s1, s2)" in text
    )
    rows = {line.split(" | ")[0]: line for line in text.splitlines() if line.startswith("| ")}
    assert rows["| coevolve"].endswith("| 0.50 ± 0.00 | 0.25 ± 0.00 | 2.0 ± 0.0 |")
    assert rows["| labelled_control"].endswith("| - | - | - |")  # no exposure recorded


def test_no_share_of_the_controls_gain_where_the_control_gained_nothing(tmp_path: Path) -> None:
    results = tmp_path / "results"
    for seed in (0, 1, 2):
        write_result(results, "none", seed, {"t1": 0.5})
        write_result(results, "coevolve", seed, {"t1": 0.75})
        write_result(results, "labelled_control", seed, {"t1": 0.25})

    text = render_experiment_report(results).read_text()

    assert "or labelled_control did not gain there)" in text


def test_the_control_share_takes_only_the_seeds_where_all_three_arms_ran(
    tmp_path: Path,
) -> None:
    """coevolve and none ran seeds 0 and 1, the control seed 0 only: the share divides
    seed 0's gains, not seed 1's gain mixed in above seed 0's control."""
    results = tmp_path / "results"
    for seed, (coevolve, control) in enumerate(((0.25, 0.5), (0.75, None))):
        write_result(results, "none", seed, {"t1": 0.0, "t2": 0.0})
        write_result(results, "coevolve", seed, {"t1": coevolve, "t2": coevolve})
        if control is not None:
            write_result(results, "labelled_control", seed, {"t1": control, "t2": control})
    text = render_experiment_report(results).read_text()

    assert (
        "- Share of the control's gain in success, (coevolve - none) / "
        "(labelled_control - none) at the end: 0.50 (+0.250 of +0.500; seeds s0)." in text
    )


NO_LABELS = "labels: none\nd0: {file: docs/results/d0-20261129.json}\n"


def test_the_labelled_control_arm_is_refused_in_the_labelled_setting(tmp_path: Path) -> None:
    labelled = ExperimentSpec(("none", "labelled_control"), (0,), 10.0)
    with pytest.raises(ValueError, match="belongs to the no-label setting"):
        labelled.check()
    with pytest.raises(ValueError, match="belongs to the no-label setting"):
        arm_settings("labelled_control", 0, {"labels": "bfcl"})
    with pytest.raises(ValueError, match="belongs to the no-label setting"):
        run_experiment(labelled, tmp_path / "out", tmp_path / "results", tmp_path)
    assert not (tmp_path / "out").exists()  # refused before anything ran
    refused = CliRunner().invoke(
        app, ["experiment", "ablation", "--arms", "labelled_control", "--out", str(tmp_path)]
    )
    said = " ".join(refused.output.replace("│", " ").split())  # rich wraps it in a box
    assert refused.exit_code == 2 and "belongs to the no-label setting" in said, said

    config = tmp_path / "base.yaml"
    config.write_text(NO_LABELS)
    no_labels = ExperimentSpec(("none", "labelled_control"), (0,), 10.0, base_config=str(config))
    no_labels.check()
    settings, scale = arm_settings("labelled_control", 0, no_labels.base_settings())
    assert scale == ["explorer=0"]  # like none: its turns come from the controller
    assert settings["labels"] == "none"
    assert no_labels.plan() == [("none", 0), ("labelled_control", 0)]


# a stand-in for up whose learner publishes v2 and v3 as the run stops (after the
# controller's last look)
PUBLISHES_AS_IT_STOPS = """
import json, pathlib, signal, sys, time
run = pathlib.Path(sys.argv[1])

def stop(*_):
    (run / "policies").mkdir(exist_ok=True)
    for version in (2, 3):
        (run / "policies" / f"v{version}.safetensors").write_bytes(b"weights")
    raise SystemExit(0)

signal.signal(signal.SIGINT, stop)
(run / "up.json").write_text(json.dumps({"nats_url": "nats://127.0.0.1:4999"}))
time.sleep(120)
"""


def test_an_arm_scores_the_runs_last_policy_and_records_where_it_ran(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A policy the learner publishes between the controller's last look and the run's
    stop is the run's last: the end mark scores it (with --steps, the last within them)."""
    scored: list[Path] = []

    async def ended_at_v2(*args: object, **kwargs: object) -> ablation.ArmLive:
        return ablation.ArmLive(end_minute=3.0, end_version=2, ended_by="minutes")

    def evaluate(weights: Path, *args: object) -> dict[str, Any]:
        scored.append(weights)
        return {"n": 1, "tasks": {"t1": [1.0, 1.0, -0.5]}}

    def publishes_as_it_stops(run: Path, log_path: Path, *args: object) -> UpRun:
        return standin_up(run, log_path, PUBLISHES_AS_IT_STOPS)

    monkeypatch.setattr(ablation, "start_up", publishes_as_it_stops)
    monkeypatch.setattr(ablation, "control_arm", ended_at_v2)
    monkeypatch.setattr(ablation, "evaluate", evaluate)
    warm = WarmStart(tmp_path / "warm-start.safetensors", WARM)
    results = tmp_path / "results"

    spec = ExperimentSpec(("none",), (0,), minutes=3.0)
    result = run_arm(
        ArmRun(spec, tmp_path / "out", results, "none", 0, warm, tmp_path, lambda _: None)
    )
    assert result["marks"][-1]["policy_version"] == result["scored_version"] == 3
    assert scored == [arm_dir(tmp_path / "out", "none", 0) / "marks" / "v3.safetensors"]
    assert result["ended_by"] == "minutes"
    assert json.loads(result_path(results, "none", 0).read_text()) == result
    commit = result["commit"]
    assert commit is None or re.fullmatch(r"[0-9a-f]{7,40}(\+dirty)?", commit)
    assert set(result["cpu"]) == {"model", "cores", "avx512_bf16", "amx_bf16"}
    assert result["dtype"] in ("float32", "bfloat16")
    expected = {"setting": "labelled", "arm": "none", "seed": 0, "steps": None}
    assert expected.items() <= result.items() and result["warm_start_sha256"] == WARM
    # the stand-in run trained nothing: its exposure is recorded as none
    assert result["exposure"]["learner_steps"] == 0
    assert result["exposure"]["exposure_second_half"] is None

    scored.clear()
    steps = ExperimentSpec(("none",), (0,), minutes=3.0, steps=1)  # v2: after its one step
    result = run_arm(
        ArmRun(steps, tmp_path / "out", results, "none", 1, warm, tmp_path, lambda _: None)
    )
    assert (result["scored_version"], result["ended_by"], result["steps"]) == (2, "steps", 1)
    assert scored == [arm_dir(tmp_path / "out", "none", 1) / "marks" / "v2.safetensors"]


def test_the_warm_start_evaluation_records_where_and_what_it_scored(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    results = tmp_path / "results"
    results.mkdir()
    blob = b"weights of v1"
    (results / "warm-start.safetensors").write_bytes(blob)
    digest = hashlib.sha256(blob).hexdigest()
    (results / "warm-start.json").write_text(json.dumps({"sha256": digest}))
    monkeypatch.setattr(ablation, "evaluate", lambda *args: {"n": 1, "tasks": {"t1": [0, 0, -1]}})
    monkeypatch.setattr(ablation, "run_arm", lambda *args: None)

    spec = ExperimentSpec(("none",), (0,), minutes=10.0)
    run_experiment(spec, tmp_path / "out", results, tmp_path, log=lambda _: None)

    record = json.loads((results / "eval-v1.json").read_text())
    assert record["tasks"] == {"t1": [0, 0, -1]} and record["warm_start_sha256"] == digest
    assert (record["scored_version"], record["setting"], record["arm"]) == (
        1,
        "labelled",
        "warm_start",
    )
    assert (record["ended_by"], record["steps"], record["seed"]) == ("v1", 0, None)
    assert {"commit", "cpu", "dtype"} <= record.keys()
    # the report still finds the warm start's scores with its provenance beside them
    assert load_results(results).warm_eval == record


def test_the_report_sets_the_labelled_control_against_none_and_coevolve(tmp_path: Path) -> None:
    results = tmp_path / "results"
    for seed in (0, 1):
        write_result(results, "none", seed, {"t1": 0.25, "t2": 0.25})
        write_result(results, "coevolve", seed, {"t1": 0.5, "t2": 0.25})
        write_result(results, "labelled_control", seed, {"t1": 0.75, "t2": 0.5})
    text = render_experiment_report(results).read_text()
    assert "| labelled_control - none | success | end |" in text
    assert "| coevolve - labelled_control | success | end |" in text
    assert text.startswith("# Experiment: none vs coevolve vs labelled_control\n")
