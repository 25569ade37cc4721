"""Memory benchmark: one SFT forward/backward on a BFCL example, activations kept vs checkpointed.

The learner keeps every layer's activations for backward unless a micro-batch is over its
token budget, when it runs sequences one at a time with activation checkpointing
(``services/learner/memory.py``). This runs one BFCL seed-task example (its first
``tokens`` tokens) through ``accumulate_sft_gradients`` both ways, each in a fresh process
so peak resident memory is that path's own, and prints the bytes autograd saved for
backward, the peak resident set and the wall time, side by side with their ratios.

Full: 4,096 tokens (a typical BFCL multi-turn conversation; measured: 9.8 GB saved for
backward stored, 0.47 GB checkpointed). ``--quick``: 1,024 tokens.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

from coevolve.bench import tables

FULL_TOKENS = 4096
QUICK_TOKENS = 1024
_PROBE_TIMEOUT_S = 1800.0


def probe(tokens: int, checkpointed: bool) -> dict[str, Any]:
    """In this process: one forward/backward of the example; what it cost."""
    import resource
    import time
    from pathlib import Path

    import torch

    from coevolve.services.learner.memory import saved_for_backward
    from coevolve.services.learner.sft import accumulate_sft_gradients, build_examples, truncate
    from coevolve.shared.config import DEFAULT_RUN_DIR
    from coevolve.shared.envs.bfcl.tasks import seed_tasks
    from coevolve.shared.policy import load_policy

    torch.set_num_threads(1)
    run_dir = Path(os.environ.get("COEVOLVE_RUN_DIR") or DEFAULT_RUN_DIR)
    policy = load_policy(run_dir=run_dir, device="cpu")
    examples, _, _ = build_examples(policy, seed_tasks()[:1])
    example = truncate(examples[0], tokens)
    policy.model.train()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    started = time.perf_counter()
    with saved_for_backward() as saved:
        accumulate_sft_gradients(
            policy.model,
            [example],
            0,
            torch.device("cpu"),
            max(1, example.supervised_tokens),
            activation_tokens=0 if checkpointed else None,
        )
    return {
        "tokens": len(example.input_ids),
        "saved_for_backward_gb": round(saved[0] / 1e9, 3),
        "peak_rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6, 2),
        "rss_before_gb": round(before / 1e6, 2),
        "seconds": round(time.perf_counter() - started, 1),
    }


def _run_probe(tokens: int, checkpointed: bool) -> dict[str, Any]:
    code = (
        "import json, sys; from coevolve.bench.memory import probe; "
        f"print(json.dumps(probe({tokens}, {checkpointed})))"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=env,
        timeout=_PROBE_TIMEOUT_S,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"memory probe failed ({done.returncode}): {done.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def run(quick: bool, tokens: int | None = None) -> dict[str, Any]:
    tokens = tokens or (QUICK_TOKENS if quick else FULL_TOKENS)
    stored = _run_probe(tokens, checkpointed=False)
    checkpointed = _run_probe(tokens, checkpointed=True)
    result = {
        "benchmark": "memory",
        "quick": quick,
        "tokens": stored["tokens"],
        "stored": stored,
        "checkpointed": checkpointed,
        "saved_bytes_ratio": round(
            checkpointed["saved_for_backward_gb"] / max(stored["saved_for_backward_gb"], 1e-9), 3
        ),
        "peak_rss_ratio": round(checkpointed["peak_rss_gb"] / stored["peak_rss_gb"], 3),
        "time_ratio": round(checkpointed["seconds"] / max(stored["seconds"], 1e-9), 3),
    }
    tables.print_table(
        f"one SFT forward/backward, {result['tokens']} tokens of a BFCL example, 1 thread",
        ("path", "saved for backward GB", "peak RSS GB", "seconds"),
        [
            (
                name,
                f"{result[name]['saved_for_backward_gb']:.3f}",
                f"{result[name]['peak_rss_gb']:.2f}",
                f"{result[name]['seconds']:.1f}",
            )
            for name in ("stored", "checkpointed")
        ],
        note=f"checkpointed / stored: saved bytes {result['saved_bytes_ratio']}, "
        f"peak RSS {result['peak_rss_ratio']}, time {result['time_ratio']}",
    )
    return result
