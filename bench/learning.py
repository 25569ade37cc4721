"""Learning benchmark: held-out success before warm start, after it, and along GRPO steps.

Everything is real: the default policy (SmolLM2-135M-Instruct, LoRA), BFCL's environment
and checker, ``warm_start`` (SFT on the train tasks' ground truth) and ``GrpoLearner.step``
on groups of K episodes, driven in lockstep (``bench/lockstep_runs.py``). The tasks are
short single-turn MathAPI tasks (``short_tasks``: train and held-out sets with different
numbers), so a step costs seconds on a CPU. Held-out success is one greedy episode per
task. The warm start runs epoch by epoch until train success stops rising for
``sft_patience`` epochs (``FULL``: two, which leaves GRPO mixed-reward groups); that
policy is the KL reference and GRPO trains a fresh adapter on top. Each training seed
writes ``seed-<n>.json`` (a finished seed is read back: an interrupted run resumes); the
paired per-task differences GRPO - warm start get the ablation's two-level bootstrap
(seeds, then tasks), a t-interval over the seeds' means (``seed_t_ci95``) and a pooled
sign test. Writes ``result.json`` and ``learning.png`` under ``RUN_DIR/bench/learning-*``.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from coevolve.bench import tables
from coevolve.bench.lockstep_runs import drive, open_loop
from coevolve.bench.short_tasks import OFFERED, train_and_heldout
from coevolve.harness import output_dir
from coevolve.schedules.lockstep import LockstepConfig, LockstepLoop, success_rate
from coevolve.services.learner.config import LearnerConfig
from coevolve.services.learner.sft import warm_start
from coevolve.shared.messages import Task, Trajectory
from coevolve.shared.toolcalls import CLOSE_TAG


@dataclass(frozen=True)
class Setup:
    """The defaults are the full run: a short warm start (two epochs: mixed-reward groups,
    room to rise on held-out), then 12 GRPO steps of 2 tasks x K=8 (tasks whose group ties
    are replaced, up to twice) at the rollout's 128-token budget."""

    train_tasks: int = 24
    # about 2 s each (greedy); with 24, three seeds' intervals spanned +-0.36
    heldout_tasks: int = 72
    sft_epochs: int = 2
    sft_batch_size: int = 4
    sft_lr: float = 2e-4
    grpo_steps: int = 12
    eval_every: int = 12
    tasks_per_step: int = 2
    group_size: int = 8
    grpo_lr: float = 3e-4
    # the rollout's budget: 40 cut the max/min calls, so no policy could solve them
    max_new_tokens: int = 128
    seed: int = 0
    # the warm start runs until train success stops rising for this many epochs
    sft_patience: int = 1
    seeds: int = 3
    # groups with equal rewards teach nothing: up to two rounds of fresh tasks replace them
    # (see LockstepConfig.refill_rounds)
    refill_rounds: int = 2


FULL = Setup()
QUICK = Setup(
    train_tasks=2,
    heldout_tasks=3,
    sft_epochs=1,
    sft_batch_size=2,
    grpo_steps=1,
    eval_every=1,
    tasks_per_step=1,
    group_size=2,
    grpo_lr=1e-4,
    max_new_tokens=32,
    sft_patience=0,
    seeds=2,
    refill_rounds=1,
)
MAX_STEPS = 2  # the call, then the closing reply that ends the turn
STOP = (CLOSE_TAG,)  # rollout.stop: one call a message


def run(
    quick: bool,
    run_dir: Path | None = None,
    setup: Setup | None = None,
    seeds: int | None = None,
) -> dict[str, Any]:
    """Every training seed (resuming: finished seeds are read back), then the paired summary.

    ``run_dir`` may be an earlier run's directory to resume it.
    """
    setup = setup or (QUICK if quick else FULL)
    count = seeds if seeds is not None else setup.seeds
    out = run_dir or output_dir("learning")
    results = []
    for seed in range(setup.seed, setup.seed + count):
        file = out / f"seed-{seed}.json"
        if file.exists():
            print(f"seed {seed}: done before, read from {file}", flush=True)
            results.append(json.loads(file.read_text()))
            continue
        print(f"seed {seed}:", flush=True)
        result = run_seed(quick, out / f"seed-{seed}", setup, seed)
        file.write_text(json.dumps(result, indent=2))
        results.append(result)
    summary = paired_summary(results)
    summary.update(
        {
            "benchmark": "learning",
            "quick": quick,
            "setup": asdict(setup),
            "run_dir": str(out),
            "seed_files": [str(out / f"seed-{r['seed']}.json") for r in results],
        }
    )
    summary["plot"] = str(plot_seeds(results, out / "learning.png"))
    (out / "result.json").write_text(json.dumps(summary, indent=2))
    print_summary(summary)
    return summary


def paired_summary(results: list[dict[str, Any]]) -> dict[str, Any]:
    """GRPO - warm start: per task and seed (two-level bootstrap), per seed (t-interval
    over the seeds' means) and pooled (exact sign test)."""
    from coevolve.report.stats import mean_interval, paired_bootstrap_interval, sign_test

    differences = [
        r["heldout_success_grpo_final"] - r["heldout_success_warm_start"] for r in results
    ]
    mean = sum(differences) / len(differences) if differences else 0.0
    seed_interval: list[float] | None = None
    if len(differences) >= 2:
        t_interval = mean_interval(differences)
        seed_interval = [round(t_interval.low, 4), round(t_interval.high, 4)]
    gained = lost = 0
    per_task: dict[int, list[float]] = {}
    for r in results:
        warm = {e["task_id"]: success(e) for e in r["heldout_episodes"]["warm_start"]}
        final = {e["task_id"]: success(e) for e in r["heldout_episodes"][r["final_label"]]}
        per_task[r["seed"]] = [final[t] - warm[t] for t in sorted(final.keys() & warm.keys())]
        gained += sum(1 for t, v in final.items() if v > warm.get(t, 0.0))
        lost += sum(1 for t, v in final.items() if v < warm.get(t, 0.0))
    p_value = sign_test(gained, lost)
    interval: list[float] | None = None
    if any(per_task.values()):
        boot = paired_bootstrap_interval(per_task)
        interval = [round(boot.low, 4), round(boot.high, 4)]
    return {
        "seeds": [r["seed"] for r in results],
        "heldout_success_warm_start": [r["heldout_success_warm_start"] for r in results],
        "heldout_success_grpo_final": [r["heldout_success_grpo_final"] for r in results],
        "warm_start_epochs": [r["warm_start"]["epochs"] for r in results],
        "difference_mean": round(mean, 4),
        "difference_ci95": interval,
        "grpo_minus_warm_start": round(mean, 4),
        "grpo_minus_warm_start_ci": interval,
        "interval_method": "two-level bootstrap: seeds, then held-out tasks within them",
        "seed_t_ci95": seed_interval,
        "tasks_gained": gained,
        "tasks_lost": lost,
        "sign_test_p": round(p_value, 4),
        "wall_s": round(sum(r["wall_s"] for r in results), 1),
    }


def success(episode: dict[str, Any]) -> float:
    """1.0 where BFCL's checker accepted the held-out episode, else 0.0."""
    return 1.0 if episode["reward"] >= 1.0 else 0.0


def run_seed(quick: bool, out: Path, setup: Setup, seed: int) -> dict[str, Any]:
    """One training seed: base, warm start to its plateau, then GRPO on a fresh adapter."""
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    # the tasks stay the same for every seed: the comparison is paired
    train, heldout = train_and_heldout(setup.train_tasks, setup.heldout_tasks, setup.seed)
    config = LockstepConfig(
        tasks_per_step=setup.tasks_per_step,
        group_size=setup.group_size,
        max_new_tokens=setup.max_new_tokens,
        max_steps=MAX_STEPS,
        seed=seed,
        stop=STOP,
        refill_rounds=setup.refill_rounds,
    )
    # one thread: on shared cores more were several times slower
    loop = open_loop(train, config, LearnerConfig(lr=setup.grpo_lr), out, threads=1)
    policy = loop.policy
    phases: dict[str, float] = {"load_s": time.perf_counter() - started}
    episodes_by_label: dict[str, list[dict[str, Any]]] = {}

    def evaluate(label: str) -> float:
        begun = time.perf_counter()
        rate, episodes = success_rate(loop.engine, heldout, setup.max_new_tokens, MAX_STEPS, STOP)
        phases[f"eval_{label}_s"] = time.perf_counter() - begun
        episodes_by_label[label] = [episode_summary(e) for e in episodes]
        print(f"  held-out success {label}: {rate:.3f}", flush=True)
        return rate

    base = evaluate("base")
    begun = time.perf_counter()
    sft = warm_start_to_plateau(loop, train, setup, seed)
    loop.learner.freeze_reference()  # GRPO trains a fresh adapter; KL pulls to this policy
    phases["warm_start_s"] = time.perf_counter() - begun
    warm = evaluate("warm_start")
    curve: list[tuple[int, float]] = [(0, warm)]
    grpo_s: list[float] = []

    def grpo_step(step: int) -> dict[str, Any]:
        report = loop.iteration()
        grpo_s.append(report.wall_s)
        m = report.metrics
        return {
            "step": step,
            "reward_mean": round(report.reward_mean, 3),
            "trained": m.trained,
            "uniform_groups": m.uniform_groups,
            "groups_sampled": report.groups_sampled,
            "kl": round(m.kl, 5),
            "clip_fraction": round(m.clip_fraction, 4),
            "rollout_s": round(report.rollout_s, 1),
            "learn_s": round(report.learn_s, 1),
        }

    def describe(r: dict[str, Any]) -> str:
        return (
            f"  grpo step {r['step']}: train reward {r['reward_mean']:.2f} "
            f"trained={r['trained']} rollout {r['rollout_s']:.1f} s learn {r['learn_s']:.1f} s"
        )

    def evaluate_when_due(steps: list[dict[str, Any]]) -> None:
        step = steps[-1]["step"]
        if step % setup.eval_every == 0 or step == setup.grpo_steps:
            curve.append((step, evaluate(f"grpo_{step}")))

    try:
        steps = drive(setup.grpo_steps, grpo_step, describe, after=evaluate_when_due)
    finally:
        loop.close()
    phases["grpo_s"] = sum(grpo_s)

    final = curve[-1][1]
    best_grpo = max(rate for _, rate in curve[1:]) if len(curve) > 1 else warm
    result: dict[str, Any] = {
        "benchmark": "learning",
        "seed": seed,
        "quick": quick,
        "model": policy.name,
        "device": str(policy.device),
        "torch_threads": torch.get_num_threads(),
        "setup": asdict(setup),
        "functions": list(OFFERED),
        "heldout_success_base": base,
        "heldout_success_warm_start": warm,
        "heldout_success_grpo_final": final,
        "heldout_success_grpo_best": best_grpo,
        "grpo_raised_above_warm_start": final > warm,
        "curve": curve,
        "final_label": f"grpo_{setup.grpo_steps}" if setup.grpo_steps else "warm_start",
        "warm_start": sft,
        "grpo_steps": steps,
        "heldout_episodes": episodes_by_label,
        "phases_s": {k: round(v, 1) for k, v in phases.items()},
        "wall_s": round(time.perf_counter() - started, 1),
        "run_dir": str(out),
    }
    print_table(result)
    return result


def warm_start_to_plateau(
    loop: LockstepLoop, train: list[Task], setup: Setup, seed: int
) -> dict[str, Any]:
    """The warm start epoch by epoch, until train success stops rising for
    ``sft_patience`` epochs (at most ``sft_epochs``); what it did."""
    losses: list[float] = []
    curve: list[float] = []
    best, since_best = -1.0, 0
    for epoch in range(setup.sft_epochs):
        sft = warm_start(
            loop.policy,
            train,
            epochs=1,
            batch_size=setup.sft_batch_size,
            lr=setup.sft_lr,
            seed=seed * 1000 + epoch,
        )
        losses.extend(sft.losses)
        rate, _ = success_rate(loop.engine, train, setup.max_new_tokens, MAX_STEPS, STOP)
        curve.append(rate)
        print(f"  warm start epoch {epoch + 1}: train success {rate:.3f}", flush=True)
        best, since_best = (rate, 0) if rate > best else (best, since_best + 1)
        if since_best > setup.sft_patience:
            break
    return {
        "epochs": len(curve),
        "train_success_by_epoch": curve,
        "examples": sft.examples,
        "steps": len(losses),
        "first_loss": round(losses[0], 4) if losses else 0.0,
        "final_loss": round(sft.final_loss, 4),
    }


def episode_summary(trajectory: Trajectory) -> dict[str, Any]:
    """What a held-out episode did: enough to tell a format failure from a wrong value."""
    replies = [m.content for m in trajectory.messages if m.role == "assistant"]
    return {
        "task_id": trajectory.task_id,
        "reward": trajectory.reward,
        "actions": trajectory.actions,
        "first_reply": (replies[0] if replies else "")[:200],
    }


def plot_seeds(results: list[dict[str, Any]], path: Path) -> Path:
    from coevolve.report import plots

    figure, (axis,) = plots.panels(1)
    curves = {
        f"seed {r['seed']}": ([s for s, _ in r["curve"]], [rate for _, rate in r["curve"]])
        for r in results
    }
    plots.lines(
        axis,
        curves,
        title="SmolLM2-135M: short BFCL MathAPI tasks",
        xlabel="GRPO steps after the warm start's plateau (step 0)",
        ylabel="held-out success (greedy)",
        marker="o",
    )
    base = results[0]["heldout_success_base"] if results else 0.0
    axis.axhline(base, color="grey", ls="--", label="base model")
    axis.set_ylim(-0.02, 1.02)
    axis.legend(loc="lower right", fontsize=8)
    return plots.save(figure, path)


def print_table(result: dict[str, Any]) -> None:
    setup = result["setup"]
    verdict = "raised" if result["grpo_raised_above_warm_start"] else "did NOT raise"
    phases = [
        ("base model", result["heldout_success_base"]),
        ("after warm start", result["heldout_success_warm_start"]),
        *((f"after {step} GRPO steps", rate) for step, rate in result["curve"][1:]),
    ]
    tables.print_table(
        f"held-out tasks: {setup['heldout_tasks']}, train tasks: {setup['train_tasks']}",
        ("phase", "held-out success"),
        [(phase, f"{rate:.3f}") for phase, rate in phases],
        note="wall time per phase (s): " + json.dumps(result["phases_s"]) + "\n"
        f"GRPO {verdict} held-out success above the warm start",
    )


def print_summary(summary: dict[str, Any]) -> None:
    interval = summary["difference_ci95"]
    shown = "n/a" if interval is None else f"[{interval[0]:+.3f}, {interval[1]:+.3f}]"
    tables.print_table(
        None,
        ("seed", "warm start", "+ GRPO", "epochs"),
        [
            (seed, f"{warm:.3f}", f"{final:.3f}", epochs)
            for seed, warm, final, epochs in zip(
                summary["seeds"],
                summary["heldout_success_warm_start"],
                summary["heldout_success_grpo_final"],
                summary["warm_start_epochs"],
                strict=True,
            )
        ],
        note=f"GRPO - warm start: mean {summary['difference_mean']:+.3f}, 95% CI {shown} "
        "(bootstrap over seeds and held-out tasks)\n"
        f"tasks gained {summary['tasks_gained']}, lost {summary['tasks_lost']} "
        f"(exact sign test p = {summary['sign_test_p']}); plot: {summary['plot']}",
    )
