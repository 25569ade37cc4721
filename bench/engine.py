"""Benchmark of the policy engines: the same rollout groups and eval turns through each.

``run(quick)`` loads the default policy (SmolLM2-135M-Instruct, LoRA as the learner loads
it) with a fixed random adapter (so the adapter path is exercised), builds the llama.cpp
engine (the CPU default) and the transformers engine on the same weights and threads,
then in one process, alternating engines per task:

- groups: ``run_group`` of K per-turn BFCL train tasks in the real BFCL environment
  (sampling at temperature 1, the rollout's 128-token budget and call stop);
  ``group_s`` is the mean wall time of a group, ``tokens_per_s`` sampled tokens / time;
- eval: the same held-out (eval split) turns played greedily as ``coevolve eval`` plays
  them, at each engine's eval batch size and llama.cpp's eval KV layout;
  ``eval_s_per_task``;
- agreement: the llama.cpp groups' behaviour log-probs against the torch policy's
  recomputation of the same tokens (what the learner does), ``logprob_abs_diff_mean``,
  and the share of tokens whose ratio ``pi_learner / pi_behaviour`` exceeds the learner's
  behaviour-weight cap (``behaviour_weight_cap_hit_rate``).

``speedup_group`` = transformers ``group_s`` / llama.cpp ``group_s`` (target >= 4).
"""

from __future__ import annotations

import math
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from coevolve.bench import tables
from coevolve.cli.eval_cmd import EVAL_BATCH_SIZE, EVAL_KV_LAYOUT
from coevolve.services.learner.config import LearnerConfig
from coevolve.shared.config import EngineKind
from coevolve.shared.envs import make_environment
from coevolve.shared.envs.bfcl.tasks import suite_tasks
from coevolve.shared.episodes import run_group
from coevolve.shared.evaluation import policy_player, run_suite
from coevolve.shared.messages import Task, Trajectory
from coevolve.shared.policy import LoadedPolicy, SamplingParams, load_policy
from coevolve.shared.policy.factory import engine_for_policy
from coevolve.shared.policy.logprobs import sequence_logprobs
from coevolve.shared.toolcalls import CLOSE_TAG

SUITE = "bfcl-turns-base"
ENGINES: tuple[EngineKind, ...] = ("llama_cpp", "transformers")


def pick(tasks: list[Task], count: int, seed: int) -> list[Task]:
    chosen = sorted(random.Random(seed).sample(range(len(tasks)), count))
    return [tasks[i] for i in chosen]


def progress(line: str) -> None:
    print(f"[engine] {line}", file=sys.stderr, flush=True)


def random_adapter(policy: LoadedPolicy, seed: int = 0, scale: float = 0.01) -> None:
    """Non-zero LoRA B matrices: the adapter changes the logits on both engines."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in policy.model.named_parameters():
            if "lora_B" in name and param.requires_grad:
                param.copy_(torch.randn(param.shape, generator=generator) * scale)


def behaviour_agreement(
    policy: LoadedPolicy, trajectories: list[Trajectory], cap: float
) -> tuple[float, float, int]:
    """(mean |recomputed - behaviour| log-prob, share of ratios over ``cap``, tokens)."""
    gaps: list[float] = []
    over = 0
    for trajectory in trajectories:
        ids = torch.tensor([trajectory.token_ids])
        mask = torch.tensor([trajectory.loss_mask])
        with torch.inference_mode():
            recomputed, _ = sequence_logprobs(
                policy.model,
                ids,
                torch.ones_like(ids),
                trajectory.temperature,
                positions=mask,
                with_entropy=False,
            )
        for position, generated in enumerate(trajectory.loss_mask):
            if generated:
                delta = float(recomputed[0, position]) - trajectory.logprobs[position]
                gaps.append(abs(delta))
                over += delta > math.log(cap)
    return statistics.fmean(gaps), over / len(gaps), len(gaps)


def run(quick: bool, run_dir: Path | None = None) -> dict[str, Any]:
    groups, group_size, max_steps, eval_turns, eval_steps = (
        (1, 4, 1, 2, 1) if quick else (3, 8, 4, 16, 4)
    )
    run_dir = run_dir or Path(os.environ.get("COEVOLVE_RUN_DIR") or "runs/default")
    threads = torch.get_num_threads()
    policy = load_policy(run_dir=run_dir)
    random_adapter(policy)
    policy.model.eval()
    engines = {
        kind: engine_for_policy(kind, policy, run_dir=run_dir, threads=threads) for kind in ENGINES
    }
    # eval's llama.cpp engine has its own KV layout, as in `coevolve eval`
    eval_engines = {
        **engines,
        "llama_cpp": engine_for_policy(
            "llama_cpp", policy, run_dir=run_dir, threads=threads, kv_layout=EVAL_KV_LAYOUT
        ),
    }
    sampling = SamplingParams(max_new_tokens=128, temperature=1.0, stop=(CLOSE_TAG,))
    greedy = SamplingParams(max_new_tokens=128, temperature=0.0, seed=0, stop=(CLOSE_TAG,))
    group_tasks = pick(suite_tasks(SUITE, "train"), groups, seed=1)
    eval_tasks = pick(suite_tasks(SUITE, "eval"), eval_turns, seed=0)

    seconds: dict[str, list[float]] = {kind: [] for kind in ENGINES}
    tokens: dict[str, int] = dict.fromkeys(ENGINES, 0)
    llama_trajectories: list[Trajectory] = []
    for index, task in enumerate(group_tasks):
        for kind in ENGINES:
            params = SamplingParams(**{**sampling.__dict__, "seed": 100 + index})
            started = time.perf_counter()
            trajectories = run_group(
                engines[kind],
                lambda: make_environment("bfcl"),
                task,
                group_size,
                params,
                max_steps=max_steps,
            )
            seconds[kind].append(time.perf_counter() - started)
            tokens[kind] += sum(sum(t.loss_mask) for t in trajectories)
            progress(
                f"group {index + 1}/{len(group_tasks)} {task.id}: {kind} {seconds[kind][-1]:.1f} s"
            )
            if kind == "llama_cpp":
                llama_trajectories.extend(trajectories)

    eval_s: dict[str, float] = {}
    eval_success: dict[str, float] = {}
    for kind in ENGINES:
        player = policy_player(
            eval_engines[kind], lambda: make_environment("bfcl"), greedy, eval_steps
        )
        report = run_suite(
            eval_tasks,
            player,
            suite=SUITE,
            split="eval",
            policy=kind,
            batch_size=EVAL_BATCH_SIZE[kind],
            progress=False,
        )
        eval_s[kind] = report.total_seconds / len(eval_tasks)
        eval_success[kind] = report.accuracy
        progress(f"eval, {len(eval_tasks)} turns: {kind} {eval_s[kind]:.1f} s a turn")

    cap = LearnerConfig().behaviour_weight_cap or math.inf
    gap, capped, scored = behaviour_agreement(policy, llama_trajectories, cap)
    group_s = {kind: statistics.fmean(values) for kind, values in seconds.items()}
    result: dict[str, Any] = {
        "benchmark": "engine",
        "quick": quick,
        "model": policy.name,
        "dtype": policy.extra.get("dtype"),
        "threads": threads,
        "cpu_count": os.cpu_count(),
        "groups": groups,
        "group_size": group_size,
        "max_steps": max_steps,
        "group_tasks": [t.id for t in group_tasks],
        "eval_tasks": len(eval_tasks),
        "eval_max_steps_per_turn": eval_steps,
        "tokens_per_s": {k: round(tokens[k] / sum(seconds[k]), 2) for k in ENGINES},
        "group_s": {k: round(v, 2) for k, v in group_s.items()},
        "group_tokens": tokens,
        "eval_s_per_task": {k: round(v, 2) for k, v in eval_s.items()},
        "eval_success": eval_success,
        "speedup_group": round(group_s["transformers"] / group_s["llama_cpp"], 2),
        "speedup_tokens_per_s": round(
            (tokens["llama_cpp"] / sum(seconds["llama_cpp"]))
            / (tokens["transformers"] / sum(seconds["transformers"])),
            2,
        ),
        "logprob_abs_diff_mean": round(gap, 5),
        "logprob_tokens": scored,
        "behaviour_weight_cap": cap,
        "behaviour_weight_cap_hit_rate": round(capped, 5),
        "targets": {"speedup_group": 4.0, "eval_s_per_task": 8.0},
    }
    print_table(result)
    return result


def print_table(result: dict[str, Any]) -> None:
    tables.print_table(
        f"{result['groups']} groups of {result['group_size']} and {result['eval_tasks']} "
        f"eval turns, {result['model']} ({result['dtype']}), {result['threads']} threads",
        ("engine", "group s", "tokens/s", "eval s/task"),
        [
            (
                kind,
                f"{result['group_s'][kind]:.1f}",
                f"{result['tokens_per_s'][kind]:.1f}",
                f"{result['eval_s_per_task'][kind]:.1f}",
            )
            for kind in ENGINES
        ],
        note=f"speedup_group {result['speedup_group']:.2f}x (target 4), tokens/s "
        f"{result['speedup_tokens_per_s']:.2f}x; behaviour log-probs vs learner: mean |diff| "
        f"{result['logprob_abs_diff_mean']:.4f} over {result['logprob_tokens']} tokens, "
        f"cap {result['behaviour_weight_cap']} hit {result['behaviour_weight_cap_hit_rate']:.2%}",
    )
