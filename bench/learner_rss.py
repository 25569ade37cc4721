"""Benchmark of the learner's resident memory: what one training pass peaks at and holds.

Each setting runs in a fresh subprocess (peak RSS is per process): the default policy
(LoRA on the 7 projections, the learner's dtype, 1 thread) does one forward and backward
pass over N tokens, scoring the last 128, in training mode (the warm start: LoRA dropout
active) or eval mode (GRPO). Reported: the resident size after loading, the peak, the peak
over the loaded model per token, and the resident size once the step's tensors are freed
and after ``release_freed_memory`` (glibc ``malloc_trim``). Modes besides ``train`` and
``eval``: ``train-checkpointed`` (with activation checkpointing, as a sequence over the
activation budget runs); ``pair`` / ``pair-stored`` (a warm-start micro-batch of N and N/2
tokens under the learner's activation budget, or with none); ``warm_start`` (the default
warm start itself on N seed tasks). ``heap``: ``mapped`` is the learner's allocator setting
(``memory.map_large_blocks``), ``glibc`` glibc's default. Results: docs/engine.md.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from coevolve.bench import tables

# a setting: mode, tokens, LoRA dropout, attention, heap
Setting = tuple[str, int, float, str, str]


def both_heaps(mode: str, tokens: int) -> list[Setting]:
    """``mode`` over ``tokens`` (dropout 0.05, sdpa) under glibc's heap, then the learner's."""
    return [(mode, tokens, 0.05, "sdpa", heap) for heap in ("glibc", "mapped")]


QUICK: list[Setting] = [
    *both_heaps("train", 512),
    ("train-checkpointed", 512, 0.05, "sdpa", "mapped"),
    ("pair", 256, 0.05, "sdpa", "mapped"),
]
FULL: list[Setting] = [
    ("train", 1024, 0.05, "sdpa", "mapped"),
    *both_heaps("train", 2048),
    *both_heaps("eval", 2048),
    ("train", 1024, 0.0, "sdpa", "mapped"),
    ("train", 2048, 0.05, "eager", "mapped"),
    *both_heaps("train-checkpointed", 2048),
    ("pair", 1300, 0.05, "sdpa", "mapped"),
    ("pair-stored", 1300, 0.05, "sdpa", "mapped"),
    *both_heaps("warm_start", 12),
]


def memory_mb() -> dict[str, float]:
    """This process's resident set and its peak (VmHWM), from /proc/self/status."""
    sizes = {"VmRSS": 0.0, "VmHWM": 0.0}
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/status").read_text().splitlines():
            name, _, value = line.partition(":")
            if name in sizes:
                sizes[name] = round(int(value.split()[0]) / 1024, 1)
    return {"rss_mb": sizes["VmRSS"], "peak_mb": sizes["VmHWM"]}


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0); False where not allowed."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def measure(
    mode: str, tokens: int, dropout: float, attention: str, heap: str = "mapped"
) -> dict[str, Any]:
    """One setting, in this process (the child side)."""
    import time

    import torch

    from coevolve.services.learner.memory import (
        activation_checkpointing,
        map_large_blocks,
        release_freed_memory,
    )
    from coevolve.shared.policy import LoraSettings, load_policy
    from coevolve.shared.policy.logprobs import sequence_logprobs

    if heap not in ("glibc", "mapped"):
        raise ValueError(f"heap must be glibc or mapped, not {heap!r}")
    if heap == "mapped":  # as the learner does
        map_large_blocks()
    torch.set_num_threads(1)
    policy = load_policy(lora=LoraSettings(dropout=dropout))
    policy.model.get_base_model().config._attn_implementation = attention
    policy.model.train(mode != "eval")
    loaded = memory_mb()["rss_mb"]
    reset_peak_rss()  # peak from here
    started = time.perf_counter()
    if mode == "warm_start":
        default_warm_start(policy, tasks=tokens)
    elif mode.startswith("pair"):
        sft_pair(policy.model, tokens, stored=mode == "pair-stored")
    else:
        ids = torch.randint(100, 40000, (1, tokens), generator=torch.Generator().manual_seed(0))
        scored = torch.zeros_like(ids)
        scored[:, -128:] = 1
        checkpointed = mode == "train-checkpointed"
        with activation_checkpointing(policy.model) if checkpointed else contextlib.nullcontext():
            logprobs, _ = sequence_logprobs(
                policy.model, ids, torch.ones_like(ids), 1.0, positions=scored, with_entropy=False
            )
            (-logprobs.sum()).backward()
        del logprobs
    step_s = time.perf_counter() - started
    peak = memory_mb()["peak_mb"]
    policy.model.zero_grad(set_to_none=True)
    import gc

    gc.collect()
    held = memory_mb()["rss_mb"]
    release_freed_memory()
    return {
        "mode": mode,
        "tokens": tokens,
        "lora_dropout": dropout,
        "attention": attention,
        "heap": heap,
        "dtype": policy.extra.get("dtype"),
        "loaded_mb": round(loaded),
        "peak_mb": round(peak),
        "mb_per_token": None if mode == "warm_start" else round((peak - loaded) / tokens, 3),
        "held_after_step_mb": round(held),
        "held_after_release_mb": round(memory_mb()["rss_mb"]),
        "step_s": round(step_s, 1),
    }


def sft_pair(model: Any, tokens: int, *, stored: bool) -> None:
    """The warm start's gradient pass over two examples of ``tokens`` and ``tokens // 2``
    tokens (no shared prompt), under the learner's activation budget or none."""
    import random

    import torch

    from coevolve.services.learner.config import DEFAULT_ACTIVATION_TOKENS
    from coevolve.services.learner.sft import accumulate_sft_gradients
    from coevolve.shared.demonstrations import IGNORE_INDEX, SftExample

    rng = random.Random(0)
    examples = []
    for length in (tokens, tokens // 2):
        ids = [rng.randrange(100, 40000) for _ in range(length)]
        examples.append(SftExample("t", ids, [IGNORE_INDEX] * (length - 128) + ids[-128:]))
    budget = None if stored else DEFAULT_ACTIVATION_TOKENS
    accumulate_sft_gradients(
        model, examples, 0, torch.device("cpu"), 256.0, activation_tokens=budget
    )


def default_warm_start(policy: Any, tasks: int) -> None:
    """The warm start's SFT with its default settings on ``tasks`` seed tasks of the
    default world (the per-turn grain), drawn with seed 0."""
    import random

    from coevolve.services.learner.config import WarmStartConfig
    from coevolve.services.learner.warm_start import OVERSAMPLE, run_warm_start, warm_start_tasks
    from coevolve.services.pool_store.config import default_seed_classes
    from coevolve.shared.envs.bfcl.tasks import seed_pool

    config = WarmStartConfig(tasks=tasks, threads=1)
    pool = seed_pool(classes=default_seed_classes())
    chosen = warm_start_tasks(random.Random(0).sample(pool, OVERSAMPLE * tasks), config)
    run_warm_start(policy, chosen, config)


def run(quick: bool) -> dict[str, Any]:
    rows = []
    for setting in QUICK if quick else FULL:
        child = subprocess.run(
            [sys.executable, "-m", "coevolve.bench.learner_rss", *map(str, setting)],
            capture_output=True,
            text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
            check=False,
        )
        if child.returncode != 0:
            raise RuntimeError(f"setting {setting} failed: {child.stderr[-2000:]}")
        rows.append(json.loads(child.stdout.strip().splitlines()[-1]))
        print(f"[learner_rss] {setting} measured", file=sys.stderr, flush=True)
    print_rows(rows)
    return {"benchmark": "learner_rss", "quick": quick, "cpu_count": os.cpu_count(), "rows": rows}


# the table's columns: heading, row key
COLUMNS = (
    ("mode", "mode"),
    ("tokens", "tokens"),
    ("dropout", "lora_dropout"),
    ("attention", "attention"),
    ("heap", "heap"),
    ("loaded MB", "loaded_mb"),
    ("peak MB", "peak_mb"),
    ("MB/token", "mb_per_token"),
    ("held MB", "held_after_step_mb"),
    ("after release MB", "held_after_release_mb"),
    ("s", "step_s"),
)


def print_rows(rows: list[dict[str, Any]]) -> None:
    tables.print_table(
        None,
        [heading for heading, _ in COLUMNS],
        [[row[key] for _, key in COLUMNS] for row in rows],
        left=(0, 3, 4),
    )


if __name__ == "__main__":
    mode, tokens, dropout, attention, *heap = sys.argv[1:6]
    print(json.dumps(measure(mode, int(tokens), float(dropout), attention, *heap)))
