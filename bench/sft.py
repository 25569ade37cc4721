"""SFT warm start: our loop (``services/learner/sft.py``) against TRL's ``SFTTrainer``.

Both train the default policy (SmolLM2-135M-Instruct, loaded offline by ``load_policy``
as the learner loads it: ``dtype auto``, LoRA from ``LoraSettings()``) on the same N
per-turn BFCL warm-start examples for K optimizer steps, each in a subprocess of its own
(so peak memory is its own), with one torch thread, the learner's warm-start settings
(``WarmStartConfig``: lr, batch size, max length), AdamW with torch's defaults, gradient
clipping at 1.0 and a constant learning rate.

The examples: seed tasks of the BFCL pool (``seed_tasks_for("bfcl")``, shuffled with seed
0), per-turn with ground truth as the warm start picks them (``warm_start_tasks``), the
first N that make one training sequence each; each is the conversation the warm start
builds (``build_examples``: the ground truth replayed in the environment, prompts by
``render_prompt_ids`` with the compact tool list, labels on the assistant tokens only).
A per-turn example supervises two assistant messages (the calls, then the closing reply)
with the tool observations between them.

- ours: ``warm_start`` itself, stopped after K steps (micro-batches of 2, a shared prompt
  run once, activation checkpointing above 2048 tokens a micro-batch).
- trl: ``SFTTrainer`` on the same sequences as a tokenized prompt-completion dataset
  (``input_ids`` and ``completion_mask`` = our supervised tokens) with
  ``completion_only_loss=True``, in the order ours trains them (each epoch shuffled as
  ``warm_start`` shuffles, a batch sorted by prompt; sequential sampler), per-device
  batch 2 with 2 accumulation steps (our batch of 4 in micro-batches of 2),
  ``max_length`` = the warm start's, float32 (``bf16=False``), TRL's other defaults
  (gradient checkpointing, ``chunked_nll`` loss).

Also measured without training, through TRL's own dataset preparation: the same examples
as *text* prompt-completion rows (decoded prompt, decoded completion), one row per
example (prompt: up to the first assistant token) and one row per assistant message;
whether TRL's tokens are ours and how many tokens carry loss.

Reported for each trainer: seconds per step, wall and CPU (the mean over steps 2..K:
step 1 carries one-time costs, reported apart as ``first_step_s``; ours builds its
examples inside it, ``examples_build_s`` says how long that takes; with one torch thread
CPU seconds are what a step costs even when other work shares the cores, wall seconds
are not), peak RSS (the whole process, and
during training alone after resetting the high-water mark), loss tokens per example
(equal when both mask the prompt and the observations), first and last loss.

Needs TRL: ``pip install -e '.[sft-compare]'`` (``trl==1.13.0``). Writes ``result.json``
and each trainer's report to ``RUN_DIR/bench/sft-<stamp>``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import itertools
import json
import math
import os
import random
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from coevolve.bench import tables
from coevolve.shared.config import DEFAULT_RUN_DIR

TRL_VERSION = "1.13.0"
INSTALL_HINT = "pip install -e '.[sft-compare]'   (or: pip install trl==1.13.0)"
MICRO_BATCH = 2  # warm_start's default micro_batch_size
TRAINERS = ("ours", "trl")
WORKER_TIMEOUT_S = 3 * 3600


@dataclass(frozen=True)
class Setup:
    steps: int
    examples: int
    seed: int = 0


QUICK = Setup(steps=2, examples=4)
FULL = Setup(steps=6, examples=12)


# ---------------------------------------------------------------------- the examples


def choose_tasks(policy: Any, count: int, max_len: int, seed: int = 0) -> list[Any]:
    """The first ``count`` per-turn seed tasks (shuffled with ``seed``) whose warm-start
    conversation is one training sequence within ``max_len`` tokens."""
    from coevolve.services.learner.config import WarmStartConfig
    from coevolve.services.learner.sft import build_examples
    from coevolve.services.learner.warm_start import warm_start_tasks
    from coevolve.services.pool_store.handler import seed_tasks_for

    pool = seed_tasks_for("bfcl")
    random.Random(seed).shuffle(pool)
    candidates = warm_start_tasks(pool, WarmStartConfig(tasks=len(pool), grain="turn"))
    chosen = []
    for task in candidates:
        examples, skipped, _ = build_examples(policy, [task])
        if not skipped and len(examples) == 1 and len(examples[0].input_ids) <= max_len:
            chosen.append(task)
            if len(chosen) == count:
                return chosen
    raise RuntimeError(f"only {len(chosen)} per-turn tasks make one sequence; {count} wanted")


def batches_in_order(examples: Sequence[Any], steps: int, batch_size: int, seed: int) -> list[Any]:
    """The batches ``warm_start`` trains, step by step: every epoch shuffled by one
    ``random.Random(seed)``, cut in batches, a batch sorted by its prompt."""
    from coevolve.services.learner.sft import prompt_key

    order = random.Random(seed)
    batches: list[list[Any]] = []
    while len(batches) < steps:
        shuffled = list(examples)
        order.shuffle(shuffled)
        for start in range(0, len(shuffled), batch_size):
            batches.append(sorted(shuffled[start : start + batch_size], key=prompt_key))
    return batches[:steps]


def segments(labels: Sequence[int], ignore: int = -100) -> list[tuple[int, int]]:
    """The runs of supervised positions, as (start, end)."""
    runs: list[tuple[int, int]] = []
    start: int | None = None
    for index, label in enumerate([*labels, ignore]):
        if label != ignore and start is None:
            start = index
        elif label == ignore and start is not None:
            runs.append((start, index))
            start = None
    return runs


def text_rows(tokenizer: Any, example: Any, per_message: bool) -> list[dict[str, Any]]:
    """An example as text prompt-completion rows: one row (completion: everything from
    the first assistant token on) or one per assistant message (prompt: all before it)."""

    def decode(ids: Sequence[int]) -> str:
        return str(
            tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        )

    ids = example.input_ids
    runs = segments(example.labels)
    spans = runs if per_message else [(runs[0][0], len(ids))]
    return [
        {
            "task_id": example.task_id,
            "prompt": decode(ids[:start]),
            "completion": decode(ids[start:end]),
        }
        for start, end in spans
    ]


# ---------------------------------------------------------------------- memory


def _status_kb(name: str) -> int:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(f"{name}:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0); False where not allowed."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def memory_mb() -> dict[str, float]:
    return {
        "rss_mb": round(_status_kb("VmRSS") / 1024, 1),
        "peak_mb": round(_status_kb("VmHWM") / 1024, 1),
    }


# ---------------------------------------------------------------------- the workers


class _Enough(Exception):
    """K steps done: ends ``warm_start`` from its progress callback."""


@dataclass
class Clock:
    """Wall and CPU time at the start of training and at each step's end, and the losses."""

    started: float = 0.0
    step_ends: list[float] = field(default_factory=list)
    started_cpu: float = 0.0
    step_cpu_ends: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)

    def start(self) -> None:
        self.started, self.started_cpu = time.perf_counter(), time.process_time()

    def step_end(self) -> None:
        self.step_ends.append(time.perf_counter())
        self.step_cpu_ends.append(time.process_time())


def train_ours(policy: Any, tasks: list[Any], setup: Setup, config: Any) -> dict[str, Any]:
    from coevolve.services.learner.sft import warm_start

    per_epoch = math.ceil(setup.examples / config.batch_size)
    clock = Clock()

    def progress(step: int, _total: int, loss: float) -> None:
        clock.step_end()
        clock.losses.append(loss)
        if step >= setup.steps:
            raise _Enough

    clock.start()
    with contextlib.suppress(_Enough):
        warm_start(
            policy,
            tasks,
            epochs=math.ceil(setup.steps / per_epoch),
            lr=config.lr,
            batch_size=config.batch_size,
            max_len=config.max_len,
            progress=progress,
            micro_batch_size=MICRO_BATCH,
            seed=setup.seed,
        )
    return asdict(clock)


def train_trl(
    policy: Any, examples: list[Any], setup: Setup, config: Any, out: Path
) -> dict[str, Any]:
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import SFTConfig, SFTTrainer

    from coevolve.services.learner.sft import supervised_mask

    batches = batches_in_order(examples, setup.steps, config.batch_size, setup.seed)
    rows = [example for batch in batches for example in batch]
    dataset = Dataset.from_list(
        [{"input_ids": e.input_ids, "completion_mask": supervised_mask(e)} for e in rows]
    )
    clock = Clock()

    class Timer(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            clock.step_end()

        def on_log(
            self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any
        ) -> None:
            if logs and "loss" in logs:
                clock.losses.append(float(logs["loss"]))

    args = SFTConfig(
        output_dir=str(out / "trl-output"),
        max_steps=setup.steps,
        per_device_train_batch_size=MICRO_BATCH,
        gradient_accumulation_steps=config.batch_size // MICRO_BATCH,
        learning_rate=config.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.01,  # torch AdamW's default, which ours uses
        optim="adamw_torch",
        max_grad_norm=1.0,
        max_length=config.max_len,
        completion_only_loss=True,
        packing=False,
        bf16=False,
        fp16=False,
        use_cpu=True,
        train_sampling_strategy="sequential",
        dataloader_num_workers=0,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=setup.seed,
    )
    built = time.perf_counter()
    trainer = SFTTrainer(
        model=policy.model,
        args=args,
        train_dataset=dataset,
        processing_class=policy.tokenizer,
        callbacks=[Timer()],
    )
    prepared: Any = trainer.train_dataset
    trl_tokens = [sum(1 for label in row if label != -100) for row in prepared["labels"]]
    same_ids = [list(row) for row in prepared["input_ids"]] == [e.input_ids for e in rows]
    checks = {
        "trainer_init_s": round(time.perf_counter() - built, 2),
        "loss_tokens_by_task": {e.task_id: n for e, n in zip(rows, trl_tokens, strict=True)},
        "same_input_ids": same_ids,
        "gradient_checkpointing": bool(args.gradient_checkpointing),
        "loss_type": str(args.loss_type),
        "text_prompt_completion": {
            name: text_check(trainer, args, policy.tokenizer, examples, per_message)
            for name, per_message in (("one_row_per_example", False), ("one_row_per_message", True))
        },
    }
    memory_before = memory_mb()
    reset = reset_peak_rss()
    torch_seed(setup.seed)
    clock.start()
    trainer.train()
    return {
        **asdict(clock),
        "checks": checks,
        "memory_before_training": memory_before,
        "peak_reset": reset,
    }


def text_check(
    trainer: Any, args: Any, tokenizer: Any, examples: Sequence[Any], per_message: bool
) -> dict[str, Any]:
    """TRL's own preparation of the examples as text prompt-completion rows: its loss
    tokens per example, whether its tokens are ours, tokens to run per epoch."""
    from datasets import Dataset

    rows = [row for e in examples for row in text_rows(tokenizer, e, per_message)]
    dataset = Dataset.from_list(
        [{"prompt": r["prompt"], "completion": r["completion"]} for r in rows]
    )
    prepared = trainer._prepare_dataset(dataset, tokenizer, args, False, None, "text")
    loss_tokens: dict[str, int] = {}
    for row, labels in zip(rows, prepared["labels"], strict=True):
        loss_tokens[row["task_id"]] = loss_tokens.get(row["task_id"], 0) + sum(
            1 for label in labels if label != -100
        )
    ours = {e.task_id: e.input_ids for e in examples}
    same = all(
        list(ids) == ours[row["task_id"]][: len(ids)]
        for row, ids in zip(rows, prepared["input_ids"], strict=True)
    )
    return {
        "rows": len(rows),
        "loss_tokens_by_task": loss_tokens,
        "tokens_per_epoch": sum(len(ids) for ids in prepared["input_ids"]),
        "tokens_are_a_prefix_of_ours": same,
    }


def torch_seed(seed: int) -> None:
    import torch

    torch.manual_seed(seed)


def worker(trainer: str, setup: Setup, out: Path) -> None:
    """One trainer in this process; its report to ``out/<trainer>.json``."""
    import torch

    torch.set_num_threads(1)
    from coevolve.services.learner.config import LearnerServiceConfig
    from coevolve.services.learner.sft import build_examples, truncate
    from coevolve.shared.policy import load_policy

    learner = LearnerServiceConfig()
    config = learner.warm_start
    run_dir = Path(os.environ.get("COEVOLVE_RUN_DIR") or DEFAULT_RUN_DIR)
    loaded = time.perf_counter()
    policy = load_policy(learner.model, run_dir=run_dir, device=learner.device, finetune="lora")
    load_s = time.perf_counter() - loaded
    tasks = choose_tasks(policy, setup.examples, config.max_len, setup.seed)
    building = time.perf_counter()
    built, _, _ = build_examples(policy, tasks)
    build_s = time.perf_counter() - building  # ours repeats it inside its first step
    examples = [truncate(e, config.max_len) for e in built]
    report: dict[str, Any] = {
        "trainer": trainer,
        "model": policy.name,
        "dtype": str(next(policy.model.parameters()).dtype).removeprefix("torch."),
        "lora": asdict(policy.lora) if policy.lora else None,
        "torch_threads": torch.get_num_threads(),
        "load_s": round(load_s, 1),
        "examples_build_s": round(build_s, 1),
        "tasks": [t.id for t in tasks],
        "loss_tokens_by_task": {e.task_id: e.supervised_tokens for e in examples},
        "tokens_by_task": {e.task_id: len(e.input_ids) for e in examples},
    }
    torch_seed(setup.seed)
    if trainer == "ours":
        report["memory_before_training"] = memory_mb()
        report["peak_reset"] = reset_peak_rss()
        report.update(train_ours(policy, tasks, setup, config))
    elif trainer == "trl":
        import trl

        report["trl_version"] = trl.__version__
        report.update(train_trl(policy, examples, setup, config, out))
    else:
        raise ValueError(f"unknown trainer {trainer!r}")
    report["memory_after_training"] = memory_mb()
    (out / f"{trainer}.json").write_text(json.dumps(report, indent=2))


# ---------------------------------------------------------------------- the benchmark


def _per_step(started: float, ends: Sequence[float]) -> tuple[float | None, float | None]:
    """The mean of steps 2..K and the first step (from the call), in seconds."""
    later = [b - a for a, b in itertools.pairwise(ends)]
    return (
        round(sum(later) / len(later), 2) if later else None,
        round(ends[0] - started, 2) if ends else None,
    )


def timing(report: dict[str, Any]) -> dict[str, Any]:
    """Wall and CPU seconds per step (steps 2..K), the first step's, and the total from
    the call. CPU seconds (one thread) hold when other work shares the cores; wall
    seconds do not."""
    ends = report["step_ends"]
    s_per_step, first = _per_step(report["started"], ends)
    cpu_per_step, cpu_first = _per_step(
        report.get("started_cpu", 0.0), report.get("step_cpu_ends", [])
    )
    return {
        "steps": len(ends),
        "s_per_step": s_per_step,
        "cpu_s_per_step": cpu_per_step,
        "first_step_s": first,
        "first_step_cpu_s": cpu_first,
        "train_s": round(ends[-1] - report["started"], 2) if ends else None,
    }


def summarize(reports: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Each trainer's figures side by side, and the checks."""
    trainers: dict[str, Any] = {}
    for name, report in reports.items():
        losses = report["losses"]
        after = report["memory_after_training"]
        before = report["memory_before_training"]
        trainers[name] = {
            **timing(report),
            "examples_build_s": report.get("examples_build_s"),
            "peak_rss_mb": after["peak_mb"] if report["peak_reset"] else None,
            "rss_before_training_mb": before["rss_mb"],
            "peak_rss_mb_whole_process": max(after["peak_mb"], before["peak_mb"]),
            "first_loss": round(losses[0], 4) if losses else None,
            "last_loss": round(losses[-1], 4) if losses else None,
            "losses": [round(x, 4) for x in losses],
            "loss_tokens_by_task": report.get("checks", report)["loss_tokens_by_task"],
        }
    ours, trl = reports["ours"], reports["trl"]
    checks = trl["checks"]
    tasks = ours["tasks"]
    text = checks["text_prompt_completion"]
    result: dict[str, Any] = {
        "trainers": trainers,
        "same_tasks": ours["tasks"] == trl["tasks"],
        "loss_tokens_per_example": {
            "ours": [ours["loss_tokens_by_task"][t] for t in tasks],
            "trl": [checks["loss_tokens_by_task"].get(t) for t in tasks],
            **{
                f"trl_text_{name}": [check["loss_tokens_by_task"].get(t) for t in tasks]
                for name, check in text.items()
            },
        },
        "tokens_per_example": [ours["tokens_by_task"][t] for t in tasks],
        "trl_same_input_ids": checks["same_input_ids"],
        "trl_text_prompt_completion": {
            name: {k: v for k, v in check.items() if k != "loss_tokens_by_task"}
            for name, check in text.items()
        },
        "trl_gradient_checkpointing": checks["gradient_checkpointing"],
        "trl_loss_type": checks["loss_type"],
        "trl_version": trl.get("trl_version"),
        "dtype": ours["dtype"],
        "lora": ours["lora"],
        "torch_threads": {name: r["torch_threads"] for name, r in reports.items()},
    }
    lt = result["loss_tokens_per_example"]
    result["loss_tokens_equal"] = lt["ours"] == lt["trl"]
    speed = [trainers[n]["s_per_step"] for n in TRAINERS]
    memory = [trainers[n]["peak_rss_mb"] for n in TRAINERS]
    cpu = [trainers[n]["cpu_s_per_step"] for n in TRAINERS]
    result["trl_over_ours"] = {
        "s_per_step": round(speed[1] / speed[0], 3) if speed[0] and speed[1] else None,
        "cpu_s_per_step": round(cpu[1] / cpu[0], 3) if cpu[0] and cpu[1] else None,
        "peak_rss": round(memory[1] / memory[0], 3) if memory[0] and memory[1] else None,
    }
    return result


def run(quick: bool = False) -> dict[str, Any]:
    setup = QUICK if quick else FULL
    base = Path(os.environ.get("COEVOLVE_RUN_DIR") or DEFAULT_RUN_DIR)
    out = (base / "bench" / f"sft-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    if importlib.util.find_spec("trl") is None:
        message = f"TRL is not installed; this benchmark needs trl=={TRL_VERSION}: {INSTALL_HINT}"
        print(message)
        return {"benchmark": "sft", "quick": quick, "error": message}
    out.mkdir(parents=True, exist_ok=True)
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "COEVOLVE_RUN_DIR": str(base.resolve()),
    }
    reports: dict[str, dict[str, Any]] = {}
    errors: dict[str, str] = {}
    for trainer in TRAINERS:
        print(f"[sft] {trainer}: {setup.steps} steps on {setup.examples} examples", flush=True)
        argv = [
            sys.executable,
            "-m",
            "coevolve.bench.sft",
            "--worker",
            trainer,
            json.dumps(asdict(setup)),
            str(out),
        ]
        log_path = out / f"{trainer}.log"
        with log_path.open("wb") as log:
            done = subprocess.run(
                argv, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=WORKER_TIMEOUT_S
            )
        if done.returncode != 0 or not (out / f"{trainer}.json").is_file():
            tail = log_path.read_text(errors="replace").splitlines()[-5:]
            errors[trainer] = f"exit {done.returncode}: " + " | ".join(tail)
            continue
        reports[trainer] = json.loads((out / f"{trainer}.json").read_text())
    result: dict[str, Any] = {
        "benchmark": "sft",
        "quick": quick,
        "setup": asdict(setup),
        "bench_dir": str(out),
    }
    if errors:
        result["errors"] = errors
    if len(reports) == len(TRAINERS):
        result.update(summarize(reports))
    (out / "result.json").write_text(json.dumps(result, indent=2))
    print_table(result)
    return result


def print_table(result: dict[str, Any]) -> None:
    setup = result["setup"]
    for trainer, error in result.get("errors", {}).items():
        print(f"{trainer} failed: {error}")
    if "trainers" not in result:
        return
    trainers = result["trainers"]
    rows = (
        ("s / step (steps 2..K)", "s_per_step"),
        ("CPU s / step (steps 2..K)", "cpu_s_per_step"),
        ("first step (s, ours: + examples)", "first_step_s"),
        ("first step (CPU s)", "first_step_cpu_s"),
        ("peak RSS in training (MB)", "peak_rss_mb"),
        ("RSS before training (MB)", "rss_before_training_mb"),
        ("first loss", "first_loss"),
        ("last loss", "last_loss"),
    )
    lines = [
        f"loss tokens per example, {name}: {counts}"
        for name, counts in result["loss_tokens_per_example"].items()
    ]
    lines.append(f"tokens per example: {result['tokens_per_example']}")
    lines.append(
        f"loss tokens equal: {result['loss_tokens_equal']}; TRL kept our token ids: "
        f"{result['trl_same_input_ids']}; TRL gradient checkpointing "
        f"{result['trl_gradient_checkpointing']}, loss {result['trl_loss_type']}"
    )
    lines += [
        f"text prompt-completion, {name}: {check['rows']} rows, "
        f"{check['tokens_per_epoch']} tokens an epoch, "
        f"TRL's tokens a prefix of ours: {check['tokens_are_a_prefix_of_ours']}"
        for name, check in result["trl_text_prompt_completion"].items()
    ]
    ratio = result["trl_over_ours"]
    lines.append(
        f"TRL / ours: s per step {ratio['s_per_step']}, CPU s per step "
        f"{ratio['cpu_s_per_step']}, peak RSS {ratio['peak_rss']}"
    )
    lines.append(f"result: {result['bench_dir']}/result.json")
    tables.print_table(
        f"SFT warm start, {setup['steps']} steps on {setup['examples']} per-turn BFCL examples, "
        f"1 torch thread, {result['dtype']}, LoRA r{result['lora']['rank']}; "
        f"TRL {result['trl_version']}",
        ("", *trainers),
        [(label, *(t[key] for t in trainers.values())) for label, key in rows],
        note="\n".join(lines),
    )


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--worker":
        worker(sys.argv[2], Setup(**json.loads(sys.argv[3])), Path(sys.argv[4]))
    else:
        print(json.dumps(run(quick="--quick" in sys.argv), indent=2))
