"""The evaluator: a real policy scored on real held-out BFCL turns as `coevolve eval`
scores it, one fixed sample per run, the newest version first, and the service on a real
NATS server."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import anyio
import msgspec
import pytest

from coevolve.cli.eval_cmd import pick_tasks
from coevolve.report.run_data import read_scalars
from coevolve.services.evaluator.actor import EvaluatorActor
from coevolve.services.evaluator.config import EvaluatorConfig, evaluator_enabled
from coevolve.services.evaluator.handler import (
    D0_SLICE,
    VersionSchedule,
    evaluate_version,
    evaluation_job,
    held_out_sample,
    own_held_out,
)
from coevolve.services.evaluator.scores import (
    REPORTS_DIR,
    SAMPLE_FILE,
    TENSORBOARD_DIR,
    WORK_DIR,
    HeldOutScore,
    held_out_line,
    read_latest,
    write_latest,
)
from coevolve.shared.config import Settings, load_settings
from coevolve.shared.envs.bfcl.tasks import suite_tasks
from coevolve.shared.runtime.bus import Bus
from coevolve.shared.task_sets import load_d0, load_heldout_file, write_d0
from tests.nolabels.conftest import COMMITTED_D0
from tests.support.actors import running
from tests.support.cache import CACHE_DIR
from tests.support.messages import policy_version
from tests.support.wait import wait_until

WORLD = ["MessageAPI", "TradingBot", "VehicleControlAPI"]
SHOP = Path(__file__).resolve().parents[2] / "examples" / "shop"


def test_the_sample_is_drawn_once_as_coevolve_eval_draws_it_and_kept(tmp_path: Path) -> None:
    config = EvaluatorConfig(tasks=5, seed=3)
    sample = held_out_sample(config, WORLD, tmp_path)
    # what `coevolve eval --suite bfcl-turns-base --split eval --sample 5 --seed 3` plays
    turns = suite_tasks("bfcl-turns-base", "eval", WORLD)
    assert sample.task_ids == [t.id for t in pick_tasks(turns, None, 5, 3)]
    assert [t.id for t in sample.tasks()] == sample.task_ids
    assert (tmp_path / SAMPLE_FILE).is_file() and sample.drawn_as(config, WORLD)

    # every later version (and a restarted evaluator) reads the kept turns back, even
    # under a changed configuration
    changed = EvaluatorConfig(tasks=7, seed=4)
    assert held_out_sample(changed, None, tmp_path) == sample
    assert not sample.drawn_as(changed, None)
    elsewhere = held_out_sample(changed, WORLD, tmp_path / "other")
    assert elsewhere.task_ids != sample.task_ids and len(elsewhere.task_ids) == 7


def shop_settings(tmp_path: Path, **evaluator: object) -> Settings:
    """A run on the example shop with no labels, as `examples/shop/coevolve.yaml` sets it."""
    return load_settings(
        run_dir=str(tmp_path / "run"),
        labels="none",
        environments={"shop": {"class": f"{SHOP / 'shop.py'}:Shop", "initial_states": [{}]}},
        d0={"environment": "shop"},
        services={"evaluator": evaluator},
    )


def test_a_users_environment_is_scored_on_its_own_held_out_tasks(tmp_path: Path) -> None:
    """The user's file, else the D0 file's held-out slice, else a clear error; BFCL's
    world keeps its eval split. The sample keeps the tasks themselves."""
    hand_written = load_heldout_file(SHOP / "heldout.json")
    ids = [task.id for task in hand_written]
    settings = shop_settings(tmp_path, heldout_file=str(SHOP / "heldout.json"))
    config = settings.section("evaluator", EvaluatorConfig)
    own = own_held_out(config, settings)
    assert own is not None and [t.id for t in own.tasks] == ids and own.source.startswith("file ")

    settings, config = shop_settings(tmp_path), EvaluatorConfig()
    settings.run_dir.mkdir(parents=True)
    d0 = load_d0(COMMITTED_D0)
    write_d0(settings.d0.path(settings.run_dir), d0)  # a D0 with no held-out slice
    with pytest.raises(ValueError, match="no held-out tasks for environment 'shop'"):
        own_held_out(config, settings)
    d0.heldout = hand_written[:4]
    write_d0(settings.d0.path(settings.run_dir), d0)
    own = own_held_out(config, settings)
    assert own is not None and own.source == D0_SLICE and own.tasks == hand_written[:4]
    assert own_held_out(config, load_settings(run_dir=str(tmp_path / "bfcl"))) is None

    sample = held_out_sample(EvaluatorConfig(tasks=3), None, settings.run_dir, own)
    assert len(sample.tasks()) == 3 and set(sample.task_ids) <= {t.id for t in own.tasks}
    assert sample.environment == "shop"
    assert sample.drawn_as(EvaluatorConfig(tasks=3), None, D0_SLICE)
    assert held_out_sample(EvaluatorConfig(), None, settings.run_dir).tasks() == sample.tasks()


def test_the_newest_version_is_scored_and_older_pending_ones_are_skipped() -> None:
    schedule = VersionSchedule(every_versions=2)
    assert schedule.due() is None
    assert schedule.offer(policy_version(1))
    due = schedule.due()
    assert due is not None and due.version == 1  # the first policy: nothing scored yet
    schedule.tried(1, scored=True)
    schedule.offer(policy_version(2))
    assert schedule.due() is None  # one version after the last scored
    schedule.offer(policy_version(3))
    due = schedule.due()
    assert due is not None and due.version == 3
    # v4..v6 come while v3 is scored: only the newest is kept
    for version in (4, 5, 6):
        schedule.offer(policy_version(version))
    assert not schedule.offer(policy_version(5))  # a late, older announcement changes nothing
    schedule.tried(3, scored=True)
    due = schedule.due()
    assert due is not None and due.version == 6
    # a failed evaluation is not retried; the next version due is scored
    schedule.tried(6, scored=False)
    assert schedule.due() is None
    schedule.offer(policy_version(7))
    due = schedule.due()
    assert due is not None and due.version == 7
    # a restarted evaluator goes on from the last score it recorded
    restarted = VersionSchedule(every_versions=2, last_scored=7)
    restarted.offer(policy_version(8))
    assert restarted.due() is None
    restarted.offer(policy_version(9))
    due = restarted.due()
    assert due is not None and due.version == 9


def test_the_config_is_off_by_default_and_checked(tmp_path: Path) -> None:
    assert not evaluator_enabled(load_settings(run_dir=str(tmp_path)))
    config = tmp_path / "coevolve.yaml"
    config.write_text("services:\n  evaluator: {enabled: true, every_versions: 3}\n")
    assert evaluator_enabled(load_settings(config))
    with pytest.raises(ValueError, match="every_versions"):
        EvaluatorConfig(every_versions=0)
    with pytest.raises(ValueError, match="suite"):
        EvaluatorConfig(suite="bfcl-multi-turn-base")


def test_a_real_policy_is_scored_on_held_out_turns_and_recorded(tmp_path: Path) -> None:
    """SmolLM2-135M with a LoRA adapter, two held-out turns, the eval's llama.cpp engine
    and its likelihood; scalars at step = version, the report and eval/latest.json."""
    import torch

    from coevolve.shared.policy import export_weights, load_policy

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "models").symlink_to(CACHE_DIR / "models", target_is_directory=True)
    torch.set_num_threads(1)
    trained = load_policy(run_dir=CACHE_DIR, device="cpu", finetune="lora")
    with torch.no_grad():
        for name, parameter in trained.model.named_parameters():
            if "lora_B" in name:
                parameter.fill_(0.001)
    weights = tmp_path / "v3.safetensors"
    weights.write_bytes(export_weights(trained.model))
    del trained

    config = EvaluatorConfig(tasks=2, seed=0, max_new_tokens=24, max_steps_per_turn=1)
    sample = held_out_sample(config, WORLD, run_dir)
    job = evaluation_job(
        config, sample, version=3, weights=weights, run_dir=run_dir, tool_rendering="compact"
    )
    score = evaluate_version(job)

    assert score.version == 3 and score.n == 2 and score.errors == 0
    assert 0.0 <= score.accuracy <= 1.0 and score.ci95_low <= score.accuracy <= score.ci95_high
    assert score.partial_credit_mean is not None and 0.0 <= score.partial_credit_mean <= 1.0
    assert score.gt_logprob_per_token is not None and score.gt_logprob_per_token < 0.0
    assert read_latest(run_dir) == score
    report = (run_dir / REPORTS_DIR / "v3.json").read_text()
    assert '"decoding": "greedy"' in report and '"engine": "llama_cpp"' in report
    assert all(task_id in report for task_id in sample.task_ids)
    scalars = read_scalars(run_dir / TENSORBOARD_DIR)
    assert [(s.step, s.value) for s in scalars["eval/accuracy"]] == [(3, score.accuracy)]
    assert {"eval/partial_credit_mean", "eval/gt_logprob_per_token"} <= set(scalars)


def test_a_real_policy_is_scored_in_a_users_environment(tmp_path: Path) -> None:
    """The evaluation's child registers the user's environment from the job and plays
    the example shop's hand-written held-out tasks there."""
    from coevolve.shared.policy import export_weights, load_policy

    settings = shop_settings(tmp_path, heldout_file=str(SHOP / "heldout.json"), tasks=2)
    run_dir = settings.run_dir
    run_dir.mkdir(parents=True)
    (run_dir / "models").symlink_to(CACHE_DIR / "models", target_is_directory=True)
    weights = tmp_path / "v1.safetensors"
    weights.write_bytes(export_weights(load_policy(run_dir=CACHE_DIR, device="cpu").model))
    config = EvaluatorConfig(
        tasks=2, max_new_tokens=24, max_steps_per_turn=1, heldout_file=str(SHOP / "heldout.json")
    )
    sample = held_out_sample(config, None, run_dir, own_held_out(config, settings))
    job = evaluation_job(
        config,
        sample,
        version=1,
        weights=weights,
        run_dir=run_dir,
        tool_rendering="compact",
        environments=settings.environments,
    )
    job_file = tmp_path / "job.json"
    job_file.write_bytes(msgspec.json.encode(job))
    # a fresh interpreter, as the service runs it: nothing registered the shop there
    done = subprocess.run(
        [sys.executable, "-m", "coevolve.services.evaluator.handler", str(job_file)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    score = read_latest(run_dir)
    assert score is not None and score.version == 1 and score.n == 2 and score.errors == 0
    assert score.source == f"file {SHOP / 'heldout.json'}"
    assert f"of the file {SHOP / 'heldout.json'}" in held_out_line(score)
    report = (run_dir / REPORTS_DIR / "v1.json").read_text()
    assert all(task_id in report for task_id in sample.task_ids)


def test_the_latest_score_reads_back_as_one_status_line(tmp_path: Path) -> None:
    assert read_latest(tmp_path) is None
    score = HeldOutScore(version=12, accuracy=0.25, n=16, time=1.0, ci95_low=0.1, ci95_high=0.5)
    write_latest(tmp_path, score)
    assert read_latest(tmp_path) == score
    assert held_out_line(score) == "held-out accuracy: 0.25 at v12 (16 turns)"


def test_status_expects_the_evaluator_only_when_it_is_enabled(tmp_path: Path) -> None:
    from coevolve.cli.status import expected_services

    settings = load_settings(run_dir=str(tmp_path))
    assert "evaluator" not in expected_services(settings) and "learner" in expected_services(
        settings
    )
    settings.services["evaluator"] = {"enabled": True}
    assert "evaluator" in expected_services(settings)


class ScriptedEvaluator(EvaluatorActor):
    """The service with its child process replaced: each job records what it was given
    and waits until the test lets it finish (v6 fails)."""

    def __init__(self, settings: Settings) -> None:
        super().__init__(settings)
        self.jobs: list[tuple[int, bytes]] = []
        self.release = anyio.Event()

    async def run_job(self, job_file: Path) -> None:
        from coevolve.services.evaluator.handler import EvaluationJob

        job = msgspec.json.decode(await anyio.Path(job_file).read_bytes(), type=EvaluationJob)
        self.jobs.append((job.version, await anyio.Path(job.weights).read_bytes()))
        await self.release.wait()
        self.release = anyio.Event()
        if job.version == 6:
            raise RuntimeError("out of memory")
        score = HeldOutScore(
            version=job.version, accuracy=0.5, n=len(job.sample.task_ids), time=0.0,
            ci95_low=0.1, ci95_high=0.9,
        )  # fmt: skip
        write_latest(Path(job.run_dir), score)


@pytest.mark.anyio
async def test_the_service_scores_the_newest_announced_version(settings: Settings) -> None:
    from coevolve.shared.policy_sync import publish_policy

    settings.services["evaluator"] = {"enabled": True, "tasks": 3, "every_versions": 2}
    bus = await Bus.connect(settings.bus, "test")
    try:
        await bus.ensure_streams()

        async def announce(version: int) -> None:
            blob = f"weights of v{version}".encode()
            await publish_policy(
                bus, blob, version=version, step=version, base_model="m", kind="lora"
            )

        await announce(1)  # before the service starts: it reads the last announcement
        evaluator = ScriptedEvaluator(settings)
        async with running([evaluator]):
            await wait_until(lambda: evaluator.jobs, 60, "the evaluation of v1")
            for version in (2, 3, 4):  # while v1 is scored
                await announce(version)
            await anyio.sleep(0.5)
            evaluator.release.set()
            await wait_until(lambda: len(evaluator.jobs) == 2, 30, "the next evaluation")
            evaluator.release.set()
            await wait_until(lambda: len(evaluator.scores) == 2, 30, "two scores")
            await announce(5)  # one version after v4: not due
            await announce(6)  # fails: the service goes on
            await wait_until(lambda: len(evaluator.jobs) == 3, 30, "v6")
            evaluator.release.set()
            await wait_until(lambda: evaluator.failures == 1, 30, "the failure")
            await announce(7)  # two versions after the last score (v4): due
            await wait_until(lambda: len(evaluator.jobs) == 4, 30, "v7")
            evaluator.release.set()
            await wait_until(lambda: len(evaluator.scores) == 3, 30, "v7 scored")
        assert [version for version, _ in evaluator.jobs] == [1, 4, 6, 7]
        assert all(blob == f"weights of v{v}".encode() for v, blob in evaluator.jobs)
        assert [s.version for s in evaluator.scores] == [1, 4, 7]
        assert not any((settings.run_dir / WORK_DIR).iterdir())  # weights and jobs removed
        assert len(evaluator.sample.task_ids if evaluator.sample else []) == 3
    finally:
        await bus.close()
