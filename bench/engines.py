"""Benchmarks of the policy engines: the same rollout groups and held-out eval batches
through several engines built on one policy (the default, with a fixed random adapter so
the adapter path is exercised), taking turns per task in one process (:func:`play`).

- ``engine`` (:func:`run_engine`): llama.cpp (the CPU default) against transformers, same
  weights and threads: wall seconds a group (``speedup_group`` = transformers / llama.cpp,
  target >= 4), sampled tokens/s, eval seconds a turn at each engine's eval batch size and
  llama.cpp's eval KV layout, and the llama.cpp groups' behaviour log-probs against the
  torch policy's recomputation (what the learner does): ``logprob_abs_diff_mean`` and the
  share of tokens over the learner's behaviour-weight cap;
- ``kv_layout`` (:func:`run_kv_layout`): four llama.cpp engines, KV layout ``unified`` or
  ``per_sequence`` x flash attention off or on; ``best_over_default`` divides each
  workload's default's CPU per token by its fastest setting's;
- ``llama_base`` (:func:`run_llama_base`): llama.cpp on bases re-encoded from the shipped
  GGUF as f16, bf16, f32 and q8_0: CPU per token over the default base's, and each base's
  log-prob gap to the learner.

Groups are per-turn BFCL train tasks (temperature 1, the rollout's 128 tokens a message
and call stop), eval batches held-out turns played greedily as ``coevolve eval`` plays
them. The llama.cpp comparisons measure the process's CPU time per generated token, which
stays comparable when other work shares the cores; ``engine`` gives wall time.
"""

from __future__ import annotations

import dataclasses
import math
import os
import random
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch

from coevolve.bench import tables
from coevolve.cli.eval_cmd import EVAL_BATCH_SIZE, EVAL_KV_LAYOUT
from coevolve.harness import base_run_dir
from coevolve.services.learner.config import LearnerConfig
from coevolve.shared.config import EngineKind
from coevolve.shared.envs import Environment, make_environment
from coevolve.shared.envs.bfcl.tasks import suite_tasks
from coevolve.shared.episodes import run_group
from coevolve.shared.evaluation import policy_player, run_suite
from coevolve.shared.messages import Task, Trajectory
from coevolve.shared.policy import LoadedPolicy, SamplingParams, load_policy
from coevolve.shared.policy.factory import engine_for_policy, learner_base_type
from coevolve.shared.policy.gguf_files import BASE_TYPES
from coevolve.shared.policy.llama_engine import KvLayout
from coevolve.shared.policy.logprobs import sequence_logprobs
from coevolve.shared.toolcalls import CLOSE_TAG

SUITE = "bfcl-turns-base"
EVAL_BATCH = EVAL_BATCH_SIZE["llama_cpp"]
ENGINES: tuple[EngineKind, ...] = ("llama_cpp", "transformers")
KV_SETTINGS: tuple[tuple[KvLayout, bool], ...] = (
    ("unified", False),
    ("unified", True),
    ("per_sequence", False),
    ("per_sequence", True),
)
ROLLOUT_DEFAULT = "unified/flash-off"
EVAL_DEFAULT = f"{EVAL_KV_LAYOUT}/flash-off"


@dataclass(frozen=True)
class Sizes:
    groups: int
    group_size: int
    max_steps: int  # messages an episode, groups and eval alike
    eval_tasks: int  # played in batches of EVAL_BATCH


QUICK = Sizes(groups=1, group_size=4, max_steps=1, eval_tasks=EVAL_BATCH)
FULL = Sizes(groups=2, group_size=8, max_steps=2, eval_tasks=2 * EVAL_BATCH)
ENGINE_QUICK = Sizes(groups=1, group_size=4, max_steps=1, eval_tasks=2)
ENGINE_FULL = Sizes(groups=3, group_size=8, max_steps=4, eval_tasks=16)


@dataclass
class CpuPerToken:
    """CPU and wall seconds and generated tokens by workload ("group", "eval") and engine
    name; the groups' trajectories and the eval's success by engine name."""

    cpu_s: dict[str, dict[str, float]]
    tokens: dict[str, dict[str, int]]
    group_trajectories: dict[str, list[Trajectory]] = field(default_factory=dict)
    wall_s: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    eval_solved: dict[str, float] = field(default_factory=dict)

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
            "eval_tasks": sizes.eval_tasks,
            "eval_batch": EVAL_BATCH,
            "cpu_s": {w: {k: round(v, 2) for k, v in by.items()} for w, by in self.cpu_s.items()},
            "tokens": self.tokens,
            "ms_per_token": self.ms_per_token(),
        }


def pick(tasks: list[Task], count: int, seed: int) -> list[Task]:
    chosen = sorted(random.Random(seed).sample(range(len(tasks)), min(count, len(tasks))))
    return [tasks[i] for i in chosen]


def _bfcl() -> Environment:
    return make_environment("bfcl")


def play(
    group_engines: Mapping[str, Any],
    eval_engines: Mapping[str, Any],
    sizes: Sizes,
    progress: Callable[[str], None],
    eval_batch: Mapping[str, int] | None = None,
) -> CpuPerToken:
    """Groups through ``group_engines``, then held-out batches through ``eval_engines``
    (same names; each at its ``eval_batch`` size, default llama.cpp's), engines
    alternating per task."""
    if set(eval_engines) != set(group_engines):
        raise ValueError("group and eval engines must have the same names")
    names = list(group_engines)
    workloads = ("group", "eval")
    measured = CpuPerToken(
        cpu_s={w: dict.fromkeys(names, 0.0) for w in workloads},
        tokens={w: dict.fromkeys(names, 0) for w in workloads},
        group_trajectories={name: [] for name in names},
        wall_s={w: {name: [] for name in names} for w in workloads},
        eval_solved=dict.fromkeys(names, 0.0),
    )

    def timed(workload: str, label: str, name: str, engine: Any, work: Callable[[], Any]) -> Any:
        engine.clear_cache()
        before, started, begun = engine.stats.generated_tokens, time.process_time(), time.time()
        out = work()
        measured.cpu_s[workload][name] += time.process_time() - started
        measured.wall_s[workload][name].append(time.time() - begun)
        measured.tokens[workload][name] += engine.stats.generated_tokens - before
        progress(f"{workload} {label}: {name} {measured.cpu_s[workload][name]:.1f} CPU s")
        return out

    sampling = SamplingParams(max_new_tokens=128, temperature=1.0, stop=(CLOSE_TAG,))
    greedy = SamplingParams(max_new_tokens=128, temperature=0.0, seed=0, stop=(CLOSE_TAG,))
    for index, task in enumerate(pick(suite_tasks(SUITE, "train"), sizes.groups, seed=1)):
        params = dataclasses.replace(sampling, seed=100 + index)
        label = f"{index + 1}/{sizes.groups} {task.id}"
        for name, engine in group_engines.items():
            work = partial(
                run_group, engine, _bfcl, task, sizes.group_size, params, sizes.max_steps
            )
            measured.group_trajectories[name].extend(timed("group", label, name, engine, work))
    eval_tasks = pick(suite_tasks(SUITE, "eval"), sizes.eval_tasks, seed=0)
    for start in range(0, len(eval_tasks), EVAL_BATCH):
        chunk = eval_tasks[start : start + EVAL_BATCH]
        label = f"batch {start // EVAL_BATCH + 1}"
        for name, engine in eval_engines.items():
            suite_work = partial(
                run_suite,
                chunk,
                policy_player(engine, _bfcl, greedy, sizes.max_steps),
                suite=SUITE,
                split="eval",
                policy=name,
                batch_size=(eval_batch or {}).get(name, EVAL_BATCH),
                progress=False,
            )
            report = timed("eval", label, name, engine, suite_work)
            measured.eval_solved[name] += report.accuracy * len(chunk)
    return measured


def random_adapter(policy: LoadedPolicy, seed: int = 0, scale: float = 0.01) -> None:
    """Non-zero LoRA B matrices: the adapter changes the logits on every engine."""
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


@dataclass
class Loaded:
    """The default policy with a fixed random adapter, where its models are cached, and
    the threads every engine gets."""

    policy: LoadedPolicy
    run_dir: Path
    threads: int

    @classmethod
    def load(cls, run_dir: Path | None) -> Loaded:
        run_dir = run_dir or base_run_dir()
        policy = load_policy(run_dir=run_dir)
        random_adapter(policy)
        policy.model.eval()
        return cls(policy, run_dir, torch.get_num_threads())

    def engine(self, kind: EngineKind = "llama_cpp", **options: Any) -> Any:
        """An engine of ``kind`` on the policy; ``options``: llama.cpp's layout and base."""
        return engine_for_policy(
            kind, self.policy, run_dir=self.run_dir, threads=self.threads, **options
        )


def gaps_to_learner(policy: LoadedPolicy, measured: CpuPerToken) -> dict[str, Any]:
    """Each engine's behaviour log-prob gap to the learner, and its cap hits."""
    cap = LearnerConfig().behaviour_weight_cap or math.inf
    gap: dict[str, float] = {}
    hits: dict[str, float] = {}
    for name, trajectories in measured.group_trajectories.items():
        mean_gap, capped, _ = behaviour_agreement(policy, trajectories, cap)
        gap[name], hits[name] = round(mean_gap, 5), round(capped, 5)
    return {
        "logprob_abs_diff_mean": gap,
        "behaviour_weight_cap": cap,
        "behaviour_weight_cap_hit_rate": hits,
    }


def closed(engines: Mapping[str, Any]) -> None:
    for engine in engines.values():
        if hasattr(engine, "close"):
            engine.close()


# --------------------------------------------------------------------------- engine


def run_engine(quick: bool, run_dir: Path | None = None) -> dict[str, Any]:
    sizes = ENGINE_QUICK if quick else ENGINE_FULL
    loaded = Loaded.load(run_dir)
    policy, threads = loaded.policy, loaded.threads
    engines: dict[str, Any] = {kind: loaded.engine(kind) for kind in ENGINES}
    # eval's llama.cpp engine has its own KV layout, as in `coevolve eval`
    eval_engines = {**engines, "llama_cpp": loaded.engine(kv_layout=EVAL_KV_LAYOUT)}
    measured = play(engines, eval_engines, sizes, tables.progress("engine"), EVAL_BATCH_SIZE)
    closed({"group": engines["llama_cpp"], "eval": eval_engines["llama_cpp"]})
    wall = {kind: sum(measured.wall_s["group"][kind]) for kind in ENGINES}
    tokens = measured.tokens["group"]
    per_s = {kind: tokens[kind] / wall[kind] for kind in ENGINES}
    group_s = {kind: statistics.fmean(measured.wall_s["group"][kind]) for kind in ENGINES}
    eval_s = {kind: sum(measured.wall_s["eval"][kind]) / sizes.eval_tasks for kind in ENGINES}
    cap = LearnerConfig().behaviour_weight_cap or math.inf
    llama = measured.group_trajectories["llama_cpp"]
    gap, capped, scored = behaviour_agreement(policy, llama, cap)
    result: dict[str, Any] = {
        "benchmark": "engine",
        "quick": quick,
        "model": policy.name,
        "dtype": policy.extra.get("dtype"),
        "threads": threads,
        "cpu_count": os.cpu_count(),
        "groups": sizes.groups,
        "group_size": sizes.group_size,
        "max_steps": sizes.max_steps,
        "eval_tasks": sizes.eval_tasks,
        "eval_max_steps_per_turn": sizes.max_steps,
        "tokens_per_s": {k: round(v, 2) for k, v in per_s.items()},
        "group_s": {k: round(v, 2) for k, v in group_s.items()},
        "group_tokens": tokens,
        "eval_s_per_task": {k: round(v, 2) for k, v in eval_s.items()},
        "eval_success": {k: v / sizes.eval_tasks for k, v in measured.eval_solved.items()},
        "speedup_group": round(group_s["transformers"] / group_s["llama_cpp"], 2),
        "speedup_tokens_per_s": round(per_s["llama_cpp"] / per_s["transformers"], 2),
        "logprob_abs_diff_mean": round(gap, 5),
        "logprob_tokens": scored,
        "behaviour_weight_cap": cap,
        "behaviour_weight_cap_hit_rate": round(capped, 5),
        "targets": {"speedup_group": 4.0, "eval_s_per_task": 8.0},
    }
    tables.print_table(
        f"{result['groups']} groups of {result['group_size']} and {result['eval_tasks']} "
        f"eval turns, {result['model']} ({result['dtype']}), {result['threads']} threads",
        ("engine", "group s", "tokens/s", "eval s/task"),
        [
            (kind, f"{group_s[kind]:.1f}", f"{per_s[kind]:.1f}", f"{eval_s[kind]:.1f}")
            for kind in ENGINES
        ],
        note=f"speedup_group {result['speedup_group']:.2f}x (target 4), tokens/s "
        f"{result['speedup_tokens_per_s']:.2f}x; behaviour log-probs vs learner: mean |diff| "
        f"{result['logprob_abs_diff_mean']:.4f} over {result['logprob_tokens']} tokens, "
        f"cap {result['behaviour_weight_cap']} hit {result['behaviour_weight_cap_hit_rate']:.2%}",
    )
    return result


# --------------------------------------------------------------------------- llama.cpp


def setting_name(layout: str, flash: bool) -> str:
    return f"{layout}/flash-{'on' if flash else 'off'}"


def run_kv_layout(quick: bool, run_dir: Path | None = None) -> dict[str, Any]:
    sizes = QUICK if quick else FULL
    loaded = Loaded.load(run_dir)
    engines = {
        setting_name(layout, flash): loaded.engine(kv_layout=layout, flash_attention=flash)
        for layout, flash in KV_SETTINGS
    }
    measured = play(engines, engines, sizes, tables.progress("kv_layout"))
    closed(engines)
    ms_per_token = measured.ms_per_token()

    def speedup(workload: str, default: str) -> float:
        return round(ms_per_token[workload][default] / min(ms_per_token[workload].values()), 2)

    best = {"group": speedup("group", ROLLOUT_DEFAULT), "eval": speedup("eval", EVAL_DEFAULT)}
    result: dict[str, Any] = {
        "benchmark": "kv_layout",
        "quick": quick,
        "model": loaded.policy.name,
        "threads": loaded.threads,
        **measured.facts(sizes),
        "defaults": {"group": ROLLOUT_DEFAULT, "eval": EVAL_DEFAULT},
        "best_over_default": best,
    }
    tables.print_table(
        f"llama.cpp KV layout x flash attention: {sizes.groups} groups of {sizes.group_size}, "
        f"{sizes.eval_tasks} eval turns in batches of {EVAL_BATCH}, {loaded.policy.name}, "
        f"{loaded.threads} threads",
        ("setting", "group CPU ms/token", "eval CPU ms/token"),
        [
            (name, f"{ms_per_token['group'][name]:.1f}", f"{ms_per_token['eval'][name]:.1f}")
            for name in ms_per_token["group"]
        ],
        note=f"defaults: rollout {ROLLOUT_DEFAULT}, eval {EVAL_DEFAULT}; the fastest setting "
        f"over the default: groups {best['group']:.2f}x, eval {best['eval']:.2f}x",
    )
    return result


def run_llama_base(quick: bool, run_dir: Path | None = None) -> dict[str, Any]:
    sizes = QUICK if quick else FULL
    loaded = Loaded.load(run_dir)
    policy, threads = loaded.policy, loaded.threads
    default = learner_base_type()
    group_engines: dict[str, Any] = {b: loaded.engine(base_type=b) for b in BASE_TYPES}
    eval_engines: dict[str, Any] = {
        b: loaded.engine(base_type=b, kv_layout=EVAL_KV_LAYOUT) for b in BASE_TYPES
    }
    measured = play(group_engines, eval_engines, sizes, tables.progress("llama_base"))
    closed(group_engines)
    closed(eval_engines)
    ms_per_token = measured.ms_per_token()
    over = {
        workload: {base: round(by_base[default] / max(ms, 1e-9), 2) for base, ms in by_base.items()}
        for workload, by_base in ms_per_token.items()
    }
    gaps = gaps_to_learner(policy, measured)
    result: dict[str, Any] = {
        "benchmark": "llama_base",
        "quick": quick,
        "model": policy.name,
        "learner_dtype": policy.extra.get("dtype"),
        "default_base": default,
        "threads": threads,
        **measured.facts(sizes),
        "over_default": over,
        **gaps,
    }
    tables.print_table(
        f"llama.cpp base precision: {sizes.groups} groups of {sizes.group_size}, "
        f"{sizes.eval_tasks} eval turns in batches of {EVAL_BATCH}, {policy.name}, "
        f"{threads} threads, learner in {result['learner_dtype']}",
        ("base", "group CPU ms/token", "eval CPU ms/token", "log-prob gap", "cap hits"),
        [
            (
                base,
                f"{ms_per_token['group'][base]:.1f} ({over['group'][base]:.2f}x)",
                f"{ms_per_token['eval'][base]:.1f} ({over['eval'][base]:.2f}x)",
                f"{gaps['logprob_abs_diff_mean'][base]:.4f}",
                f"{100 * gaps['behaviour_weight_cap_hit_rate'][base]:.2f}%",
            )
            for base in ms_per_token["group"]
        ],
        note=f"default base: {default} (x: its CPU per token over each base's); log-prob gap: "
        "mean |behaviour - learner's recomputation| over the groups' tokens",
    )
    return result
