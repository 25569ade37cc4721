"""Prompt-size benchmark: the first prompt's tokens under each tool rendering, side by side.

Over BFCL's multi_turn_base, every entry's first prompt (system prompt with the tools, the
first user message, the assistant prompt) is rendered exactly as a rollout renders it, with
the default policy's tokenizer (SmolLM2-135M-Instruct; only the tokenizer is loaded), once
with the ``full`` rendering (BFCL's JSON docs) and once with ``compact`` (one line per
function). The same is measured over the per-turn tasks (``bfcl-turns-base``), whose first
prompt also holds the conversation so far. ``--quick``: the first 40 entries and their turns.
"""

from __future__ import annotations

import statistics
from typing import Any

from coevolve.bench import tables

QUICK_ENTRIES = 40


def _tokenizer() -> Any:
    from transformers import AutoTokenizer

    from coevolve.shared.policy.loading import default_gguf_path

    gguf = default_gguf_path()
    return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)


def prompt_lengths(tokenizer: Any, tasks: list[Any], rendering: str) -> list[int]:
    """Tokens of each task's first prompt under ``rendering``."""
    from coevolve.shared.envs.bfcl import BfclEnvironment
    from coevolve.shared.envs.rendering import check_tool_rendering
    from coevolve.shared.policy.chat import render_prompt_ids

    lengths = []
    for task in tasks:
        env = BfclEnvironment()
        try:
            messages = env.reset(task)
            ids = render_prompt_ids(
                tokenizer, messages, env.tools(), tool_rendering=check_tool_rendering(rendering)
            )
        finally:
            env.close()
        lengths.append(len(ids))
    return lengths


def _stats(lengths: list[int]) -> dict[str, float]:
    return {
        "median": float(statistics.median(lengths)),
        "max": float(max(lengths)),
        "min": float(min(lengths)),
    }


def run(quick: bool) -> dict[str, Any]:
    from coevolve.shared.envs.bfcl import load_tasks, turn_tasks

    entries = load_tasks("multi_turn_base")
    if quick:
        entries = entries[:QUICK_ENTRIES]
    turns = [turn for entry in entries for turn in turn_tasks(entry)]
    tokenizer = _tokenizer()
    result: dict[str, Any] = {
        "benchmark": "prompts",
        "quick": quick,
        "entries": len(entries),
        "turn_tasks": len(turns),
    }
    rows = []
    for prefix, tasks in (("", entries), ("turns_", turns)):
        for rendering in ("full", "compact"):
            stats = _stats(prompt_lengths(tokenizer, tasks, rendering))
            for key, value in stats.items():
                result[f"{prefix}{key}_{rendering}"] = value
            rows.append((prefix or "entries_", rendering, stats))
    result["median_ratio"] = round(result["median_compact"] / result["median_full"], 3)
    result["turns_median_ratio"] = round(
        result["turns_median_compact"] / result["turns_median_full"], 3
    )
    tables.print_table(
        f"first-prompt tokens, SmolLM2 tokenizer, multi_turn_base: {len(entries)} entries, "
        f"{len(turns)} per-turn tasks",
        ("tasks", "rendering", "median", "min", "max"),
        [
            (
                prefix.rstrip("_"),
                rendering,
                *(f"{stats[key]:.0f}" for key in ("median", "min", "max")),
            )
            for prefix, rendering, stats in rows
        ],
        note=f"compact / full median: entries {result['median_ratio']}, "
        f"turns {result['turns_median_ratio']}",
        left=(0, 1),
    )
    return result
