"""Benchmark of llama.cpp's KV layout and flash attention on the two kinds of call.

``run(quick)`` loads the default policy with a fixed random adapter (as ``bench engine``)
and builds four llama.cpp engines on it: KV layout ``unified`` or ``per_sequence``, flash
attention off or on. In one process, alternating engines per task, each plays:

- groups: ``run_group`` of K per-turn BFCL train tasks (temperature 1, 128 new tokens a
  message), what rollout sends: K episodes of one prompt;
- eval: batches of 8 held-out turns played greedily, what ``coevolve eval`` sends: 8
  unrelated prompts.

The measure is the process's CPU time per generated token (``time.process_time``, every
thread of the process): one engine runs at a time, and CPU time stays comparable when
other work shares the cores, where wall time would not. ``best_over_default`` divides
each workload's default's CPU per token (rollout: unified, flash attention off; eval:
per_sequence, off) by its fastest setting's.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from coevolve.bench import tables
from coevolve.bench.engine import pick, random_adapter
from coevolve.cli.eval_cmd import EVAL_BATCH_SIZE, EVAL_KV_LAYOUT
from coevolve.shared.envs import make_environment
from coevolve.shared.envs.bfcl.tasks import suite_tasks
from coevolve.shared.episodes import run_group
from coevolve.shared.evaluation import policy_player, run_suite
from coevolve.shared.policy import SamplingParams, load_policy
from coevolve.shared.policy.factory import engine_for_policy
from coevolve.shared.policy.llama_engine import KvLayout
from coevolve.shared.toolcalls import CLOSE_TAG

SUITE = "bfcl-turns-base"
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


def progress(line: str) -> None:
    print(f"[kv_layout] {line}", file=sys.stderr, flush=True)


def run(quick: bool, run_dir: Path | None = None) -> dict[str, Any]:
    groups, group_size, max_steps, eval_batches = (1, 4, 1, 1) if quick else (2, 8, 2, 2)
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
    batch = EVAL_BATCH_SIZE["llama_cpp"]
    sampling = SamplingParams(max_new_tokens=128, temperature=1.0, stop=(CLOSE_TAG,))
    greedy = SamplingParams(max_new_tokens=128, temperature=0.0, seed=0, stop=(CLOSE_TAG,))
    group_tasks = pick(suite_tasks(SUITE, "train"), groups, seed=1)
    eval_tasks = pick(suite_tasks(SUITE, "eval"), batch * eval_batches, seed=0)
    cpu: dict[str, dict[str, float]] = {w: dict.fromkeys(engines, 0.0) for w in ("group", "eval")}
    tokens: dict[str, dict[str, int]] = {w: dict.fromkeys(engines, 0) for w in ("group", "eval")}

    def timed(workload: str, name: str, play: Any) -> None:
        engine = engines[name]
        engine.clear_cache()
        before, started = engine.stats.generated_tokens, time.process_time()
        play(engine)
        cpu[workload][name] += time.process_time() - started
        tokens[workload][name] += engine.stats.generated_tokens - before

    for index, task in enumerate(group_tasks):
        params = SamplingParams(**{**sampling.__dict__, "seed": 100 + index})
        for name in engines:
            timed(
                "group",
                name,
                lambda engine, task=task, params=params: run_group(
                    engine, lambda: make_environment("bfcl"), task, group_size, params, max_steps
                ),
            )
            progress(f"group {index + 1}/{groups} {task.id}: {name} {cpu['group'][name]:.1f} s")
    for index in range(eval_batches):
        chunk = eval_tasks[index * batch : (index + 1) * batch]
        for name in engines:
            timed(
                "eval",
                name,
                lambda engine, chunk=chunk: run_suite(
                    chunk,
                    policy_player(engine, lambda: make_environment("bfcl"), greedy, max_steps),
                    suite=SUITE,
                    split="eval",
                    policy="llama_cpp",
                    batch_size=batch,
                    progress=False,
                ),
            )
            progress(f"eval batch {index + 1}/{eval_batches}: {name} {cpu['eval'][name]:.1f} s")
    for engine in engines.values():
        engine.close()

    ms_per_token = {
        workload: {
            name: round(1000 * cpu[workload][name] / max(tokens[workload][name], 1), 1)
            for name in engines
        }
        for workload in cpu
    }

    def speedup(workload: str, default: str) -> float:
        return round(ms_per_token[workload][default] / min(ms_per_token[workload].values()), 2)

    result: dict[str, Any] = {
        "benchmark": "kv_layout",
        "quick": quick,
        "model": policy.name,
        "threads": threads,
        "cpu_count": os.cpu_count(),
        "groups": groups,
        "group_size": group_size,
        "max_steps": max_steps,
        "eval_tasks": len(eval_tasks),
        "eval_batch": batch,
        "cpu_s": {w: {k: round(v, 2) for k, v in by.items()} for w, by in cpu.items()},
        "tokens": tokens,
        "ms_per_token": ms_per_token,
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
