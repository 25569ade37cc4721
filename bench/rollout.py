"""Benchmark of the rollout path: generated tokens/s against raw batched ``generate``.

``run(quick)`` loads the default policy (SmolLM2-135M-Instruct, LoRA, cached safetensors),
then, in the same process and alternating, measures:

- rollout: ``run_group`` over a real BFCL task in the real BFCL environment with the
  ``TransformersEngine`` (K episodes, batched, with rendering, environment steps, token
  bookkeeping and behaviour log-probs); tokens/s = sampled tokens / wall time of the group;
- raw: ``model.generate`` (transformers, sampling, same temperature, no top-k/top-p) on
  exactly the batches of prompts the rollout generated from (same model, batch sizes,
  contexts and ``max_new_tokens``); tokens/s = generated tokens up to each row's stop token
  / wall time of the ``generate`` calls.

The ratio rollout / raw is the headline (target >= 0.9). The engine shares the prompts'
common prefix (tool schemas + task) across the batch and across turns; raw ``generate``
cannot, which is most of the difference on long tool prompts. The full run adds the
rollout path with prefix sharing off (``ratio_unshared``): the loop's own overhead.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from coevolve.shared.envs import make_environment
from coevolve.shared.envs.bfcl.tasks import seed_tasks
from coevolve.shared.episodes import run_group
from coevolve.shared.messages import Task
from coevolve.shared.policy import (
    Generation,
    SamplingParams,
    TransformersEngine,
    load_policy,
)
from coevolve.shared.policy.engine import left_pad

TASK_ID = "multi_turn_base_100"  # TradingBot, two turns, the shortest seed prompt


@dataclass(frozen=True)
class Setup:
    group_size: int
    max_steps: int
    max_new_tokens: int
    repeats: int
    temperature: float = 1.0


# quick: raw generate re-prefills every ~2,100-token prompt, which dominates its minute.
QUICK = Setup(group_size=2, max_steps=2, max_new_tokens=16, repeats=1)
FULL = Setup(group_size=8, max_steps=4, max_new_tokens=64, repeats=2)


@dataclass
class RecordingEngine:
    """Passes calls to the engine and keeps each batch of prompts for the raw replay."""

    engine: TransformersEngine
    batches: list[list[list[int]]] = field(default_factory=list)

    @property
    def policy_version(self) -> int:
        return self.engine.policy_version

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def max_context(self) -> int:
        return self.engine.max_context

    def load_weights(self, blob: bytes, version: int) -> None:
        self.engine.load_weights(blob, version)

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        self.batches.append([list(p) for p in prompts])
        return self.engine.generate(prompts, params)


def bench_task() -> Task:
    tasks = seed_tasks()
    return next((t for t in tasks if t.id == TASK_ID), tasks[0])


def rollout_once(engine: TransformersEngine, task: Task, setup: Setup, seed: int) -> dict[str, Any]:
    recorder = RecordingEngine(engine)
    params = SamplingParams(
        max_new_tokens=setup.max_new_tokens, temperature=setup.temperature, seed=seed
    )
    started = time.perf_counter()
    trajectories = run_group(
        recorder,
        lambda: make_environment("bfcl"),
        task,
        setup.group_size,
        params,
        setup.max_steps,
    )
    wall = time.perf_counter() - started
    tokens = sum(sum(t.loss_mask) for t in trajectories)
    return {
        "tokens": tokens,
        "seconds": wall,
        "tokens_per_s": tokens / wall,
        "batches": recorder.batches,
        "environment_s": max(t.timings.environment_s for t in trajectories),
        "rewards": [t.reward for t in trajectories],
        "prompt_tokens": [len(p) for batch in recorder.batches for p in batch],
    }


def raw_once(
    engine: TransformersEngine, batches: list[list[list[int]]], setup: Setup, seed: int
) -> dict[str, Any]:
    model = engine.policy.model
    stop = sorted(engine.stop_ids)
    pad = engine.tokenizer.pad_token_id
    tokens = 0
    seconds = 0.0
    torch.manual_seed(seed)
    for prompts in batches:
        input_ids, attention = left_pad(prompts, pad)
        started = time.perf_counter()
        with torch.inference_mode():
            output = model.generate(
                input_ids=input_ids.to(engine.policy.device),
                attention_mask=attention.to(engine.policy.device),
                do_sample=True,
                temperature=setup.temperature,
                top_k=0,
                top_p=1.0,
                max_new_tokens=setup.max_new_tokens,
                eos_token_id=stop,
                pad_token_id=pad,
            )
        seconds += time.perf_counter() - started
        for row in output[:, input_ids.shape[1] :].tolist():
            ends = [i for i, t in enumerate(row) if t in stop]
            tokens += ends[0] + 1 if ends else len(row)
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds}


def run(quick: bool, run_dir: Path | None = None, setup: Setup | None = None) -> dict[str, Any]:
    """Measure both paths side by side; ``setup`` overrides the quick/full settings."""
    setup = setup or (QUICK if quick else FULL)
    started = time.perf_counter()
    policy = load_policy(run_dir=run_dir)
    engine = TransformersEngine(policy)
    task = bench_task()
    engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=2, seed=0))  # warm-up

    unshared_engine = TransformersEngine(policy, share_prefix=False)
    rollouts: list[dict[str, Any]] = []
    raws: list[dict[str, Any]] = []
    unshared: list[dict[str, Any]] = []
    for repeat in range(setup.repeats):
        engine.clear_cache()  # every repeat starts cold, like a new group of a new task
        rollout = rollout_once(engine, task, setup, seed=1000 + repeat)
        raws.append(raw_once(engine, rollout.pop("batches"), setup, seed=2000 + repeat))
        rollouts.append(rollout)
        if setup is not QUICK:
            # the same rollout path without prefix sharing: the loop's own overhead
            plain = rollout_once(unshared_engine, task, setup, seed=3000 + repeat)
            plain.pop("batches")
            unshared.append(plain)

    rollout_rate = _rate(rollouts)
    raw_rate = _rate(raws)
    result = {
        "benchmark": "rollout",
        "quick": quick,
        "model": policy.name,
        "device": str(policy.device),
        "torch_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "task": task.id,
        "group_size": setup.group_size,
        "max_steps": setup.max_steps,
        "max_new_tokens": setup.max_new_tokens,
        "repeats": setup.repeats,
        "policy_load_s": round(policy.load_seconds, 2),
        "policy_from_cache": policy.from_cache,
        "rollout_tokens": sum(r["tokens"] for r in rollouts),
        "rollout_seconds": round(sum(r["seconds"] for r in rollouts), 2),
        "rollout_tokens_per_s": round(rollout_rate, 2),
        "raw_tokens": sum(r["tokens"] for r in raws),
        "raw_seconds": round(sum(r["seconds"] for r in raws), 2),
        "raw_tokens_per_s": round(raw_rate, 2),
        "ratio": round(rollout_rate / raw_rate, 3),
        "target_ratio": 0.9,
        "rollout_unshared_tokens_per_s": round(_rate(unshared), 2) if unshared else None,
        "ratio_unshared": round(_rate(unshared) / raw_rate, 3) if unshared else None,
        "prompt_tokens_median": statistics.median(n for r in rollouts for n in r["prompt_tokens"]),
        "environment_s": round(sum(r["environment_s"] for r in rollouts), 3),
        "prefix_prefilled_tokens": engine.stats.prefix_prefilled_tokens,
        "prefix_reused_tokens": engine.stats.prefix_reused_tokens,
        "suffix_prefilled_tokens": engine.stats.suffix_prefilled_tokens,
        "rewards": [x for r in rollouts for x in r["rewards"]],
        "wall_s": round(time.perf_counter() - started, 1),
    }
    print(
        f"rollout {result['rollout_tokens_per_s']} tok/s "
        f"({result['rollout_tokens']} tokens in {result['rollout_seconds']} s) vs raw generate "
        f"{result['raw_tokens_per_s']} tok/s ({result['raw_tokens']} tokens in "
        f"{result['raw_seconds']} s): ratio {result['ratio']} (target >= 0.9)"
    )
    return result


def _rate(runs: list[dict[str, Any]]) -> float:
    return sum(r["tokens"] for r in runs) / sum(r["seconds"] for r in runs)


if __name__ == "__main__":
    import json
    import sys

    print(json.dumps(run(quick="--quick" in sys.argv), indent=2))
