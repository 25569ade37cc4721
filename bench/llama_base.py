"""Benchmark of the llama.cpp base's precision: CPU per token and distance from the learner.

``run(quick)`` loads the default policy with a fixed random adapter (as ``bench engine``)
and builds llama.cpp engines on bases re-encoded from the shipped GGUF as f16, bf16, f32
and q8_0 (rollout's unified KV layout for groups, eval's per-sequence layout for eval
batches). Each plays the same groups and held-out batches (``bench/llama_cpu.py``), and
reports:

- ``ms_per_token``: CPU ms per generated token, by workload and base;
- ``over_default``: the default base's CPU per token (bf16 where the CPU has native bf16,
  f16 elsewhere) divided by each base's (> 1: faster than the default);
- ``logprob_abs_diff_mean``: each base's behaviour log-probs in its groups against the
  torch policy's recomputation of the same tokens (what the learner does), with the share
  of tokens over the learner's behaviour-weight cap (``behaviour_weight_cap_hit_rate``).
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import torch

from coevolve.bench import tables
from coevolve.bench.engine import behaviour_agreement, random_adapter
from coevolve.bench.llama_cpu import FULL, QUICK, play, progress_to_stderr
from coevolve.cli.eval_cmd import EVAL_KV_LAYOUT
from coevolve.services.learner.config import LearnerConfig
from coevolve.shared.policy import load_policy
from coevolve.shared.policy.factory import engine_for_policy, learner_base_type
from coevolve.shared.policy.gguf_files import BASE_TYPES


def run(quick: bool, run_dir: Path | None = None) -> dict[str, Any]:
    sizes = QUICK if quick else FULL
    run_dir = run_dir or Path(os.environ.get("COEVOLVE_RUN_DIR") or "runs/default")
    threads = torch.get_num_threads()
    default = learner_base_type()
    policy = load_policy(run_dir=run_dir)
    random_adapter(policy)
    policy.model.eval()

    def engine(base: Any, **layout: Any) -> Any:
        return engine_for_policy(
            "llama_cpp", policy, run_dir=run_dir, threads=threads, base_type=base, **layout
        )

    group_engines: dict[str, Any] = {base: engine(base) for base in BASE_TYPES}
    eval_engines: dict[str, Any] = {
        base: engine(base, kv_layout=EVAL_KV_LAYOUT) for base in BASE_TYPES
    }
    measured = play(group_engines, eval_engines, sizes, progress_to_stderr("llama_base"))
    for built in (*group_engines.values(), *eval_engines.values()):
        built.close()

    cap = LearnerConfig().behaviour_weight_cap or math.inf
    gap: dict[str, float] = {}
    cap_hits: dict[str, float] = {}
    for base, trajectories in measured.group_trajectories.items():
        mean_gap, capped, _ = behaviour_agreement(policy, trajectories, cap)
        gap[base], cap_hits[base] = round(mean_gap, 5), round(capped, 5)
    ms_per_token = measured.ms_per_token()
    result: dict[str, Any] = {
        "benchmark": "llama_base",
        "quick": quick,
        "model": policy.name,
        "learner_dtype": policy.extra.get("dtype"),
        "default_base": default,
        "threads": threads,
        **measured.facts(sizes),
        "over_default": {
            workload: {
                base: round(by_base[default] / max(ms, 1e-9), 2) for base, ms in by_base.items()
            }
            for workload, by_base in ms_per_token.items()
        },
        "logprob_abs_diff_mean": gap,
        "behaviour_weight_cap": cap,
        "behaviour_weight_cap_hit_rate": cap_hits,
    }
    print_table(result)
    return result


def print_table(result: dict[str, Any]) -> None:
    per_token, over = result["ms_per_token"], result["over_default"]
    tables.print_table(
        f"llama.cpp base precision: {result['groups']} groups of {result['group_size']}, "
        f"{result['eval_tasks']} eval turns in batches of {result['eval_batch']}, "
        f"{result['model']}, {result['threads']} threads, learner in {result['learner_dtype']}",
        ("base", "group CPU ms/token", "eval CPU ms/token", "log-prob gap", "cap hits"),
        [
            (
                base,
                f"{per_token['group'][base]:.1f} ({over['group'][base]:.2f}x)",
                f"{per_token['eval'][base]:.1f} ({over['eval'][base]:.2f}x)",
                f"{result['logprob_abs_diff_mean'][base]:.4f}",
                f"{100 * result['behaviour_weight_cap_hit_rate'][base]:.2f}%",
            )
            for base in per_token["group"]
        ],
        note=f"default base: {result['default_base']} (x: its CPU per token over each base's); "
        "log-prob gap: mean |behaviour - learner's recomputation| over the groups' tokens",
    )
