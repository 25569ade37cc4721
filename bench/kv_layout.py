"""Benchmark of llama.cpp's KV layout and flash attention on the two kinds of call.

``run(quick)`` loads the default policy with a fixed random adapter (as ``bench engine``)
and builds four llama.cpp engines on it: KV layout ``unified`` or ``per_sequence``, flash
attention off or on. In one process, alternating engines per task, each plays:

- groups: ``run_group`` of K per-turn BFCL train tasks (temperature 1, 128 new tokens a
  message), what rollout sends: K episodes of one prompt;
- eval: batches of 8 held-out turns played greedily, what ``coevolve eval`` sends: 8
  unrelated prompts.

The measure is the process's CPU time per generated token (``bench/llama_cpu.py``).
``best_over_default`` divides each workload's default's CPU per token (rollout: unified,
flash attention off; eval: per_sequence, off) by its fastest setting's.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from coevolve.bench import tables
from coevolve.bench.engine import random_adapter
from coevolve.bench.llama_cpu import FULL, QUICK, play, progress_to_stderr
from coevolve.cli.eval_cmd import EVAL_KV_LAYOUT
from coevolve.shared.policy import load_policy
from coevolve.shared.policy.factory import engine_for_policy
from coevolve.shared.policy.llama_engine import KvLayout

SETTINGS: tuple[tuple[KvLayout, bool], ...] = (
    ("unified", False),
    ("unified", True),
    ("per_sequence", False),
    ("per_sequence", True),
)
ROLLOUT_DEFAULT = "unified/flash-off"
EVAL_DEFAULT = f"{EVAL_KV_LAYOUT}/flash-off"


def setting_name(layout: str, flash: bool) -> str:
    return f"{layout}/flash-{'on' if flash else 'off'}"


def run(quick: bool, run_dir: Path | None = None) -> dict[str, Any]:
    sizes = QUICK if quick else FULL
    run_dir = run_dir or Path(os.environ.get("COEVOLVE_RUN_DIR") or "runs/default")
    threads = torch.get_num_threads()
    policy = load_policy(run_dir=run_dir)
    random_adapter(policy)
    engines = {
        setting_name(layout, flash): engine_for_policy(
            "llama_cpp",
            policy,
            run_dir=run_dir,
            threads=threads,
            kv_layout=layout,
            flash_attention=flash,
        )
        for layout, flash in SETTINGS
    }
    measured = play(engines, engines, sizes, progress_to_stderr("kv_layout"))
    for engine in engines.values():
        engine.close()
    ms_per_token = measured.ms_per_token()

    def speedup(workload: str, default: str) -> float:
        return round(ms_per_token[workload][default] / min(ms_per_token[workload].values()), 2)

    result: dict[str, Any] = {
        "benchmark": "kv_layout",
        "quick": quick,
        "model": policy.name,
        "threads": threads,
        **measured.facts(sizes),
        "defaults": {"group": ROLLOUT_DEFAULT, "eval": EVAL_DEFAULT},
        "best_over_default": {
            "group": speedup("group", ROLLOUT_DEFAULT),
            "eval": speedup("eval", EVAL_DEFAULT),
        },
    }
    print_table(result)
    return result


def print_table(result: dict[str, Any]) -> None:
    per_token = result["ms_per_token"]
    tables.print_table(
        f"llama.cpp KV layout x flash attention: {result['groups']} groups of "
        f"{result['group_size']}, {result['eval_tasks']} eval turns in batches of "
        f"{result['eval_batch']}, {result['model']}, {result['threads']} threads",
        ("setting", "group CPU ms/token", "eval CPU ms/token"),
        [
            (name, f"{per_token['group'][name]:.1f}", f"{per_token['eval'][name]:.1f}")
            for name in per_token["group"]
        ],
        note=f"defaults: rollout {ROLLOUT_DEFAULT}, eval {EVAL_DEFAULT}; the fastest setting "
        f"over the default: groups {result['best_over_default']['group']:.2f}x, eval "
        f"{result['best_over_default']['eval']:.2f}x",
    )
