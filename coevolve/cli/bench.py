"""``coevolve bench NAME``: benchmarks that print ratios measured side by side in one run."""

from __future__ import annotations

import importlib
import inspect
import json
from pathlib import Path
from typing import Annotated, Any

import typer

from coevolve.cli.options import JsonOption

BENCHMARKS = {
    "engine": "llama.cpp vs transformers engine: group s, tokens/s, eval s/task, log-prob gap",
    "kv_layout": "llama.cpp KV layout x flash attention: CPU ms/token of groups and eval",
    "llama_base": "llama.cpp base f16/bf16/f32/q8_0: CPU ms/token, log-prob gap to the learner",
    "learning": "held-out success: base, after warm start, after N GRPO steps",
    "learner_rss": "a learner pass by tokens, dropout, attention: peak and held RSS",
    "dataloop": "coevolve up for N minutes: signals, explorations, verdicts, pool growth",
    "sampling": "share of uniform groups, uniform vs dynamic sampler, synthetic policy",
    "flood": "10,000 bad messages on every subject: good msgs/s with and without, dead letters",
    "chaos": "coevolve up under kill -9 of every service, a NATS and an LLM restart: audit",
    "services": "coevolve up vs up --schedule lockstep, or (--compare data-loop) vs up "
    "--scale explorer=0: learner steps and accepted tasks per hour, CPU per part",
    "judge": "judge stages on BFCL train turns and corrupted copies: accept/reject rates, s/cand",
    "synthesis": "recorded explorations through abstractor and judge per role model: accepted",
    "ddp": "2 learner ranks (gloo) vs 1 on the same batches: weight difference, step s",
    "failover": "coevolve up on a 3-node NATS cluster losing its stream leader, then quorum",
    "hard_negatives": "co-evolving DPO's failure agent: its failures against the "
    "target's on the same tasks (reward), until 200 pairs",
}


# benchmarks that share a module: name -> "module:function" (the others: module NAME, run)
RUNNERS = {
    "engine": "engines:run_engine",
    "kv_layout": "engines:run_kv_layout",
    "llama_base": "engines:run_llama_base",
    "chaos": "faults:run_chaos",
    "failover": "faults:run_failover",
}
# the module attribute that lists an option's accepted values, where one does
CHOICES = {"compare": "COMPARISONS", "models": "MODEL_CHOICES"}


def bench(
    name: Annotated[str, typer.Argument(help="One of: " + ", ".join(BENCHMARKS))],
    quick: Annotated[bool, typer.Option("--quick", help="Small sizes: under a minute.")] = False,
    minutes: Annotated[
        float | None,
        typer.Option(
            help="Wall time of the benchmarks that run for a time (dataloop, chaos, failover; "
            "services: of each phase).",
            min=0.1,
        ),
    ] = None,
    seeds: Annotated[
        int | None,
        typer.Option(
            help="Training seeds of the benchmarks that repeat over seeds (learning).", min=1
        ),
    ] = None,
    resume: Annotated[
        Path | None,
        typer.Option(
            help="An earlier run directory of a benchmark that resumes (learning: its "
            "finished seeds are read back, the others run).",
            exists=True,
            file_okay=False,
        ),
    ] = None,
    compare: Annotated[
        str | None,
        typer.Option(
            help="services: the two phases compared. schedule (default): coevolve up vs up "
            "--schedule lockstep, 15 min each. data-loop: coevolve up (full) vs up --scale "
            "explorer=0 (no_data_loop: nothing explored, abstracted or judged), 30 min each; "
            "learner_steps_per_hour_ratio = full / no_data_loop, learner steps per hour "
            "counted from spawn (below 1: the data loop slows the learner).",
        ),
    ] = None,
    inputs: Annotated[
        Path | None,
        typer.Option(
            help="synthesis: a file of recorded explorations (one msgspec JSON a line, as a "
            "run's RUN_DIR/explorer/explorations-*.jsonl) instead of the committed inputs.",
            exists=True,
            dir_okay=False,
        ),
    ] = None,
    models: Annotated[
        str | None,
        typer.Option(
            help="synthesis: the role models compared, comma-separated aliases (default: "
            "every one it knows).",
        ),
    ] = None,
    json_output: JsonOption = False,
) -> None:
    """Run a benchmark and print its table; --json adds one JSON object as the last line."""
    if name not in BENCHMARKS:
        listing = "\n".join(f"  {k:<10}{v}" for k, v in BENCHMARKS.items())
        raise typer.BadParameter(f"unknown benchmark {name!r}; available:\n{listing}")
    module_name, _, function = RUNNERS.get(name, f"{name}:run").partition(":")
    try:
        module = importlib.import_module(f"coevolve.bench.{module_name}")
    except ModuleNotFoundError as exc:
        typer.echo(f"error: benchmark {name!r} is not available in this build: {exc}", err=True)
        raise typer.Exit(1) from exc
    options: dict[str, Any] = {"quick": quick}
    given: tuple[tuple[str, str, Any], ...] = (
        ("minutes", "minutes", minutes),
        ("seeds", "seeds", seeds),
        ("resume", "run_dir", resume),
        ("compare", "compare", compare),
        ("inputs", "inputs", inputs),
        ("models", "models", models.split(",") if models else None),
    )
    for option, parameter, value in given:
        if value is None:
            continue
        if parameter not in inspect.signature(getattr(module, function)).parameters:
            raise typer.BadParameter(f"benchmark {name!r} does not take --{option}")
        choices = getattr(module, CHOICES.get(option, ""), {})
        values = value if isinstance(value, list) else [value]
        if choices and any(v not in choices for v in values):
            raise typer.BadParameter(f"--{option} takes: {', '.join(choices)}")
        options[parameter] = value
    result: dict[str, Any] = getattr(module, function)(**options)
    if json_output:
        typer.echo(json.dumps(result))
