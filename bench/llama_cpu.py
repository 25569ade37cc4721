"""The same rollout groups and eval batches through several llama.cpp engines, by CPU time.

Engines take turns per task in one process, so each sees the same work; the measure is
the process's CPU time per generated token (``time.process_time``, every thread of the
process), which stays comparable when other work shares the cores, where wall time would
not. Used by ``bench kv_layout`` and ``bench llama_base``.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from coevolve.bench.engine import pick
from coevolve.cli.eval_cmd import EVAL_BATCH_SIZE
from coevolve.shared.envs import Environment, make_environment
from coevolve.shared.envs.bfcl.tasks import suite_tasks
from coevolve.shared.episodes import run_group
from coevolve.shared.evaluation import policy_player, run_suite
from coevolve.shared.messages import Trajectory
from coevolve.shared.policy import SamplingParams
from coevolve.shared.toolcalls import CLOSE_TAG

SUITE = "bfcl-turns-base"
EVAL_BATCH = EVAL_BATCH_SIZE["llama_cpp"]


@dataclass(frozen=True)
class Sizes:
    groups: int
    group_size: int
    max_steps: int
    eval_batches: int


QUICK = Sizes(groups=1, group_size=4, max_steps=1, eval_batches=1)
FULL = Sizes(groups=2, group_size=8, max_steps=2, eval_batches=2)


@dataclass
class CpuPerToken:
    """CPU seconds and generated tokens by workload ("group", "eval") and engine name."""

    cpu_s: dict[str, dict[str, float]]
    tokens: dict[str, dict[str, int]]
    group_trajectories: dict[str, list[Trajectory]] = field(default_factory=dict)

    def ms_per_token(self) -> dict[str, dict[str, float]]:
        return {
            workload: {
                name: round(1000 * seconds / max(self.tokens[workload][name], 1), 1)
                for name, seconds in by_name.items()
            }
            for workload, by_name in self.cpu_s.items()
        }

    def facts(self, sizes: Sizes) -> dict[str, Any]:
        """The sizes played and what they cost, as a benchmark's JSON reports them."""
        return {
            "cpu_count": os.cpu_count(),
            "groups": sizes.groups,
            "group_size": sizes.group_size,
            "max_steps": sizes.max_steps,
            "eval_tasks": EVAL_BATCH * sizes.eval_batches,
            "eval_batch": EVAL_BATCH,
            "cpu_s": {w: {k: round(v, 2) for k, v in by.items()} for w, by in self.cpu_s.items()},
            "tokens": self.tokens,
            "ms_per_token": self.ms_per_token(),
        }


def play(
    group_engines: dict[str, Any],
    eval_engines: dict[str, Any],
    sizes: Sizes,
    progress: Callable[[str], None],
) -> CpuPerToken:
    """Groups of per-turn train tasks (temperature 1, 128 tokens a message, the call stop)
    through ``group_engines``, then greedy batches of held-out turns through
    ``eval_engines`` (same names), engines alternating per task."""
    if set(eval_engines) != set(group_engines):
        raise ValueError("group and eval engines must have the same names")
    names = list(group_engines)
    measured = CpuPerToken(
        cpu_s={w: dict.fromkeys(names, 0.0) for w in ("group", "eval")},
        tokens={w: dict.fromkeys(names, 0) for w in ("group", "eval")},
        group_trajectories={name: [] for name in names},
    )

    def timed(workload: str, name: str, engine: Any, work: Callable[[], Any]) -> Any:
        engine.clear_cache()
        before, started = engine.stats.generated_tokens, time.process_time()
        out = work()
        measured.cpu_s[workload][name] += time.process_time() - started
        measured.tokens[workload][name] += engine.stats.generated_tokens - before
        return out

    sampling = SamplingParams(max_new_tokens=128, temperature=1.0, stop=(CLOSE_TAG,))
    greedy = SamplingParams(max_new_tokens=128, temperature=0.0, seed=0, stop=(CLOSE_TAG,))
    for index, task in enumerate(pick(suite_tasks(SUITE, "train"), sizes.groups, seed=1)):
        params = dataclasses.replace(sampling, seed=100 + index)
        for name, engine in group_engines.items():
            work = partial(
                run_group, engine, _bfcl, task, sizes.group_size, params, sizes.max_steps
            )
            measured.group_trajectories[name].extend(timed("group", name, engine, work))
            spent = measured.cpu_s["group"][name]
            progress(f"group {index + 1}/{sizes.groups} {task.id}: {name} {spent:.1f} s")
    eval_tasks = pick(suite_tasks(SUITE, "eval"), EVAL_BATCH * sizes.eval_batches, seed=0)
    for index in range(sizes.eval_batches):
        chunk = eval_tasks[index * EVAL_BATCH : (index + 1) * EVAL_BATCH]
        for name, engine in eval_engines.items():
            suite_work = partial(
                run_suite,
                chunk,
                policy_player(engine, _bfcl, greedy, sizes.max_steps),
                suite=SUITE,
                split="eval",
                policy="llama_cpp",
                batch_size=EVAL_BATCH,
                progress=False,
            )
            timed("eval", name, engine, suite_work)
            spent = measured.cpu_s["eval"][name]
            progress(f"eval batch {index + 1}/{sizes.eval_batches}: {name} {spent:.1f} s")
    return measured


def _bfcl() -> Environment:
    return make_environment("bfcl")


def progress_to_stderr(prefix: str) -> Callable[[str], None]:
    def write(line: str) -> None:
        print(f"[{prefix}] {line}", file=sys.stderr, flush=True)

    return write
