"""``coevolve eval``: score a policy (or the ground truth) on a BFCL multi-turn suite.

Suites ``bfcl-multi-turn-*`` play whole entries, ``bfcl-turns-*`` one task per user turn.
Prints a progress bar on stderr, then success with a 95% Wilson interval, partial credit,
the ground truth's log-likelihood and seconds per task; ``--json`` puts one JSON object on
the last line of stdout, ``--out`` writes it to a file. ``--compare A B`` scores two
policies (or reads two saved reports) on the same tasks and prints their paired
differences with intervals and p-values. The tools are rendered as the configuration says
(``tool_rendering``, default ``compact``) unless ``--tool-rendering`` names one; the
report records which.
"""

from __future__ import annotations

import json
import os
import random
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

import msgspec
import typer

from coevolve.cli.options import ConfigOption, JsonOption, settings_from
from coevolve.shared.config import EngineKind, Settings
from coevolve.shared.envs import make_environment
from coevolve.shared.envs.bfcl.tasks import SUITES, suite_tasks
from coevolve.shared.envs.protocol import Environment
from coevolve.shared.envs.rendering import (
    TOOL_RENDERINGS,
    ToolRendering,
    configure_tool_rendering,
    configured_tool_rendering,
)
from coevolve.shared.evaluation import (
    BatchPlayer,
    GroundTruthScorer,
    Player,
    SuiteReport,
    ground_truth_player,
    ground_truth_scorer,
    policy_player,
    run_suite,
)
from coevolve.shared.messages import Trajectory
from coevolve.shared.toolcalls import CLOSE_TAG

if TYPE_CHECKING:
    from coevolve.shared.policy import LoadedPolicy
    from coevolve.shared.policy.llama_engine import KvLayout

SPLITS = ("all", "eval", "train")
# The rollout's budget (rollout.max_steps_per_turn, rollout.max_new_tokens): the eval asks
# of the policy what training rewards, and a turn it never finishes costs 4 steps, not 12.
EVAL_MAX_STEPS_PER_TURN = 4
EVAL_MAX_NEW_TOKENS = 128
EVAL_STOP = (CLOSE_TAG,)  # rollout.stop: one call a message
# Tasks played together, by engine. llama.cpp keeps each task's history in its own KV
# sequence, so a batch of 8 different tasks prefills only new tokens at every step. The
# transformers engine keeps only the prefix its prompts share, so a batch of different
# tasks re-prefills every prompt at every step (measured: ~9 min per step for 8 entries).
EVAL_BATCH_SIZE = {"llama_cpp": 8, "transformers": 1, "vllm": 8}
EVAL_ENGINE: EngineKind = "llama_cpp"
# A batch's tasks share little: in llama.cpp's own cache per sequence, each attends only
# to its own history, not to every task's (a batch of 8 prefilled about twice as fast).
EVAL_KV_LAYOUT: KvLayout = "per_sequence"
# KV cells a task's sequence holds, by tool rendering: a per-turn task's first prompt is at
# most 2,230 tokens compact and 5,742 full (bench prompts); a turn adds up to 4 messages.
EVAL_SEQUENCE_TOKENS: dict[ToolRendering, int] = {"compact": 4096, "full": 8192}
# Where `--policy VERSION` looks for that version's exported weights (export_weights bytes).
VERSION_WEIGHT_PATTERNS = ("policies/v{version}.safetensors", "policies/{version}.safetensors")


class PolicyChoiceError(ValueError):
    """``--policy`` names nothing that can be loaded."""


def pick_tasks(tasks: list[Any], limit: int | None, sample: int | None, seed: int) -> list[Any]:
    """The first ``limit`` tasks, or ``sample`` of them drawn with ``seed`` (kept in suite
    order): turns of one entry sit side by side, so a sample spreads over more entries."""
    if limit is not None and sample is not None:
        raise typer.BadParameter("use --limit or --sample, not both", param_hint="--sample")
    if sample is not None:
        chosen = sorted(random.Random(seed).sample(range(len(tasks)), min(sample, len(tasks))))
        return [tasks[i] for i in chosen]
    return tasks[:limit] if limit is not None else tasks


def weights_for_version(run_dir: Path, version: int) -> Path:
    """The exported weights file of policy ``version`` under ``run_dir``."""
    candidates = [run_dir / pattern.format(version=version) for pattern in VERSION_WEIGHT_PATTERNS]
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    looked = ", ".join(str(c) for c in candidates)
    raise PolicyChoiceError(f"no weights for policy version {version} (looked for {looked})")


def _load_with_weights(model: str | None, run_dir: Path, weights: Path) -> LoadedPolicy:
    from safetensors import safe_open

    from coevolve.shared.policy import import_weights, load_policy

    with safe_open(str(weights), framework="pt") as handle:
        kind = (handle.metadata() or {}).get("kind", "lora")
    policy = load_policy(model, run_dir=run_dir, finetune="lora" if kind == "lora" else "full")
    import_weights(policy.model, weights.read_bytes())
    policy.model.eval()
    return policy


@dataclass(frozen=True)
class PolicyChoice:
    """What ``--policy`` names: the base model, or weights/model files to load."""

    kind: Literal["base", "weights", "model"]
    path: Path | None = None


def resolve_policy_choice(policy: str, run_dir: Path) -> PolicyChoice:
    """Check ``--policy`` before anything heavy is imported."""
    if policy == "base":
        return PolicyChoice("base")
    if policy.isdigit():
        return PolicyChoice("weights", weights_for_version(run_dir, int(policy)))
    path = Path(policy)
    if path.is_dir() or (path.is_file() and path.suffix == ".gguf"):
        return PolicyChoice("model", path)
    if path.is_file() and path.suffix == ".safetensors":
        return PolicyChoice("weights", path)
    raise PolicyChoiceError(
        f"--policy {policy!r}: use 'base', 'ground-truth', a policy version number, "
        "a .safetensors weights file, a .gguf file or a model directory"
    )


def load_policy_choice(choice: PolicyChoice, model: str | None, run_dir: Path) -> LoadedPolicy:
    from coevolve.shared.policy import load_policy

    if choice.kind == "weights" and choice.path is not None:
        return _load_with_weights(model, run_dir, choice.path)
    if choice.kind == "model" and choice.path is not None:
        return load_policy(str(choice.path), run_dir=run_dir, finetune="none")
    return load_policy(model, run_dir=run_dir, finetune="none")


def trajectory_writer(path: Path) -> Callable[[Trajectory], None]:
    """Append each trajectory as one JSON line (to inspect what the policy did)."""
    path.parent.mkdir(parents=True, exist_ok=True)

    def write(trajectory: Trajectory) -> None:
        with path.open("ab") as handle:
            handle.write(msgspec.json.encode(trajectory) + b"\n")

    return write


def step_reporter() -> Callable[[int, int, float], None]:
    """A line per batched generation step on stderr: long batches show they are moving."""

    def report(step: int, running: int, seconds: float) -> None:
        typer.echo(f"  step {step}: {running} episode(s) generated in {seconds:.1f} s", err=True)

    return report


@dataclass(frozen=True)
class PlayOptions:
    """How a policy plays a suite: its budget, batch size (None: the engine's own), engine,
    whether each batched step is reported and whether the ground truth is scored too."""

    max_steps_per_turn: int = EVAL_MAX_STEPS_PER_TURN
    max_new_tokens: int = EVAL_MAX_NEW_TOKENS
    batch_size: int | None = None
    show_steps: bool = False
    likelihood: bool = True
    engine_kind: EngineKind = EVAL_ENGINE


def build_player(
    policy: str,
    model: str | None,
    run_dir: Path,
    trajectories: Path | None = None,
    options: PlayOptions = PlayOptions(),
    environment: str = "bfcl",
) -> tuple[Player | BatchPlayer, int, dict[str, Any], GroundTruthScorer | None]:
    """(player, batch size (0: one task at a time), facts for the report, the scorer of
    the ground truth's likelihood (None for the ground-truth player or when not asked)),
    playing in fresh environments of ``environment``."""

    def make_env() -> Environment:
        return make_environment(environment)

    if policy == "ground-truth":
        return ground_truth_player(make_env), 0, {}, None
    choice = resolve_policy_choice(policy, run_dir)
    from coevolve.shared.policy import SamplingParams
    from coevolve.shared.policy.engine import TokenScorer
    from coevolve.shared.policy.factory import engine_for_policy

    loaded = load_policy_choice(choice, model, run_dir)
    batch_size = options.batch_size or EVAL_BATCH_SIZE[options.engine_kind]
    llama_options: dict[str, Any] = {}
    if options.engine_kind == "llama_cpp":
        sequences = max(batch_size, 1)
        llama_options = {
            "kv_layout": EVAL_KV_LAYOUT,
            "sequences": sequences,
            "context_tokens": sequences * EVAL_SEQUENCE_TOKENS[configured_tool_rendering()],
        }
    engine = engine_for_policy(options.engine_kind, loaded, run_dir=run_dir, **llama_options)
    params = SamplingParams(
        max_new_tokens=options.max_new_tokens, temperature=0.0, seed=0, stop=EVAL_STOP
    )
    extra: dict[str, Any] = {
        "model": loaded.name,
        "engine": options.engine_kind,
        "device": str(loaded.device),
        "dtype": str(next(loaded.model.parameters()).dtype).removeprefix("torch."),
        "load_seconds": loaded.load_seconds,
        "max_steps_per_turn": options.max_steps_per_turn,
        "max_new_tokens": options.max_new_tokens,
        "decoding": "greedy",
        "stop": list(EVAL_STOP),
        "batch_size": batch_size,
        "max_context": engine.max_context,
    }
    writer = None
    if trajectories is not None:
        writer = trajectory_writer(trajectories)
        extra["trajectories"] = str(trajectories)
    on_step = step_reporter() if options.show_steps else None
    player = policy_player(engine, make_env, params, options.max_steps_per_turn, writer, on_step)
    scorer = None
    if options.likelihood:
        # llama.cpp scores a batch's ground truths together, sharing their prefixes
        token_logprobs = engine.token_logprobs if isinstance(engine, TokenScorer) else None
        scorer = ground_truth_scorer(loaded, make_env, token_logprobs)
        extra["likelihood_engine"] = options.engine_kind if token_logprobs else "torch"
    return player, batch_size, extra, scorer


def evaluate(
    policy: str,
    tasks: list[Any],
    *,
    suite: str,
    split: str,
    model: str | None,
    run_dir: Path,
    options: PlayOptions,
) -> SuiteReport:
    """Score ``policy`` on ``tasks``; its trajectories go to ``RUN_DIR/eval/``."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "_", Path(policy).name or policy)
    trajectories = run_dir / "eval" / f"{suite}-{split}-{slug}-{stamp}.jsonl"
    player, batch_size, extra, scorer = build_player(policy, model, run_dir, trajectories, options)
    report = run_suite(
        tasks,
        player,
        suite=suite,
        split=split,
        policy=policy,
        batch_size=batch_size,
        scorer=scorer,
    )
    report.extra.update(extra)
    return report


def saved_report(path: str) -> dict[str, Any] | None:
    """A report ``--compare`` reads instead of scoring a policy (a ``--json``/``--out``
    file), or None when ``path`` names a policy."""
    if not path.endswith(".json"):
        return None
    file = Path(path)
    if not file.is_file():
        raise PolicyChoiceError(f"{path}: no such report file")
    text = file.read_text(encoding="utf-8").strip()
    try:  # an --out file, else a --json capture: the report is its last line
        report = json.loads(text)
    except json.JSONDecodeError:
        try:
            report = json.loads(text.splitlines()[-1]) if text else None
        except json.JSONDecodeError as exc:
            raise PolicyChoiceError(f"{path}: not a report of coevolve eval ({exc})") from exc
    if not isinstance(report, dict) or "entries" not in report:
        raise PolicyChoiceError(f"{path}: not a report of coevolve eval (no entries)")
    return report


SuiteOption = Annotated[
    str,
    typer.Option(
        "--suite",
        help="One of: " + ", ".join(SUITES) + " (bfcl-turns-*: one task per user turn).",
    ),
]
SplitOption = Annotated[
    str,
    typer.Option(
        "--split",
        help="all: every entry (BFCL's full category); eval / train: the held-out or "
        "training half (deterministic, by scenario).",
    ),
]
PolicyOption = Annotated[
    str,
    typer.Option(
        "--policy",
        help="base | ground-truth | a policy VERSION number | a PATH to exported "
        "weights (.safetensors), a .gguf file or a model directory.",
    ),
]
CompareOption = Annotated[
    tuple[str, str] | None,
    typer.Option(
        "--compare",
        help="Two policies A B (each as --policy takes it, or a report .json saved "
        "with --out) scored on the same tasks; prints A - B per measure with a 95% "
        "bootstrap interval and a paired p-value (exact sign test for success).",
        show_default=False,
    ),
]
ClassesOption = Annotated[
    str | None,
    typer.Option(
        "--classes",
        help="Comma-separated BFCL API classes: only entries (and their turns) that use "
        "no other class; 'all': every entry. Default: the configuration's "
        "pool_store.seed_classes, the world a run trains in.",
        show_default=False,
    ),
]
LimitOption = Annotated[
    int | None, typer.Option("--limit", help="Only the first N entries.", min=1)
]
SampleOption = Annotated[
    int | None,
    typer.Option("--sample", help="N tasks drawn at random (with --seed) across the suite.", min=1),
]
SeedOption = Annotated[int, typer.Option("--seed", help="Seed of --sample.")]
OutOption = Annotated[
    Path | None,
    typer.Option(
        "--out",
        help="Also write the JSON report there (with --compare: the comparison, and "
        "each scored policy's report beside it as OUT-a.json / OUT-b.json).",
    ),
]
ModelOption = Annotated[
    str | None,
    typer.Option(
        "--model",
        help="Base model (hub id, directory or .gguf); default SmolLM2-135M-Instruct.",
    ),
]
EvalRunDirOption = Annotated[
    Path,
    typer.Option("--run-dir", envvar="COEVOLVE_RUN_DIR", help="The run's directory."),
]
MaxStepsOption = Annotated[
    int,
    typer.Option(
        "--max-steps-per-turn",
        min=1,
        help="Assistant messages per user turn (policy only; the rollout's budget).",
    ),
]
MaxNewTokensOption = Annotated[
    int,
    typer.Option("--max-new-tokens", min=1, help="Tokens per assistant message (policy only)."),
]
BatchSizeOption = Annotated[
    int | None,
    typer.Option(
        "--batch-size",
        min=1,
        help="Tasks generated together (policy only; default 8 with llama_cpp, 1 with "
        "transformers).",
        show_default=False,
    ),
]
EngineOption = Annotated[
    EngineKind,
    typer.Option(
        "--engine",
        help="llama_cpp (CPU: a float GGUF base with the policy's LoRA as an adapter) "
        "| transformers | vllm (GPU).",
    ),
]
LikelihoodOption = Annotated[
    bool,
    typer.Option(
        "--likelihood/--no-likelihood",
        help="Also score the ground truth's calls teacher-forced (one forward pass "
        "per task): their mean per-token log-likelihood.",
    ),
]
ToolRenderingOption = Annotated[
    str | None,
    typer.Option(
        "--tool-rendering",
        help="compact | full: how prompts show the tools (default: the configuration's "
        "tool_rendering, compact unless set; full is BFCL's own docs).",
        show_default=False,
    ),
]


def eval_command(
    suite: SuiteOption = "bfcl-multi-turn-base",
    split: SplitOption = "all",
    policy: PolicyOption = "base",
    compare: CompareOption = None,
    classes: ClassesOption = None,
    limit: LimitOption = None,
    sample: SampleOption = None,
    seed: SeedOption = 0,
    json_output: JsonOption = False,
    out: OutOption = None,
    model: ModelOption = None,
    run_dir: EvalRunDirOption = Path("runs/default"),
    max_steps_per_turn: MaxStepsOption = EVAL_MAX_STEPS_PER_TURN,
    max_new_tokens: MaxNewTokensOption = EVAL_MAX_NEW_TOKENS,
    batch_size: BatchSizeOption = None,
    engine: EngineOption = EVAL_ENGINE,
    likelihood: LikelihoodOption = True,
    tool_rendering: ToolRenderingOption = None,
    config: ConfigOption = None,
) -> None:
    """Score a policy (or the ground truth) on a BFCL multi-turn suite, or compare two."""
    check_choices(suite, split, tool_rendering)
    settings = settings_from(config, None)
    configure_tool_rendering(tool_rendering or settings.tool_rendering)  # for this process
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    options = PlayOptions(
        max_steps_per_turn=max_steps_per_turn,
        max_new_tokens=max_new_tokens,
        batch_size=batch_size,
        show_steps=True,
        likelihood=likelihood,
        engine_kind=engine,
    )
    from coevolve.report.compare import UnpairedReportsError, describe_comparison

    world = world_classes(classes, settings)
    try:
        tasks = pick_tasks(suite_tasks(suite, split, world), limit, sample, seed)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--classes") from exc
    scoring = Scoring(
        tasks,
        suite=suite,
        split=split,
        model=model,
        run_dir=run_dir,
        options=options,
        world=world,
        sample=sample,
        seed=seed,
        # the description is the output of a plain single eval; otherwise it is progress
        describe_on_stderr=json_output or compare is not None,
    )
    try:
        scoring.read_saved(compare or (policy,))  # read reports, and fail on a bad name, first
        if compare is None:
            result = scoring.score(policy)
        else:
            first, second = scoring.score(compare[0]), scoring.score(compare[1])
            result = _comparison(first, second, compare, out)
            typer.echo(describe_comparison(result, compare), err=json_output)
    except PolicyChoiceError as exc:
        hint = "--compare" if compare else "--policy"
        raise typer.BadParameter(str(exc), param_hint=hint) from exc
    except UnpairedReportsError as exc:
        raise typer.BadParameter(str(exc), param_hint="--compare") from exc
    write_result(result, out, json_output)


def check_choices(suite: str, split: str, tool_rendering: str | None) -> None:
    """Refuse a suite, split or tool rendering that does not exist."""
    if suite not in SUITES:
        raise typer.BadParameter(f"choose from {', '.join(SUITES)}", param_hint="--suite")
    if split not in SPLITS:
        raise typer.BadParameter(f"choose from {', '.join(SPLITS)}", param_hint="--split")
    if tool_rendering is not None and tool_rendering not in TOOL_RENDERINGS:
        raise typer.BadParameter(
            f"choose from {', '.join(TOOL_RENDERINGS)}", param_hint="--tool-rendering"
        )


@dataclass
class Scoring:
    """Each policy scored once on the same tasks; a saved report stands for its policy."""

    tasks: list[Any]
    suite: str
    split: str
    model: str | None
    run_dir: Path
    options: PlayOptions
    world: list[str] | None  # the API classes (None: every class)
    sample: int | None
    seed: int
    describe_on_stderr: bool
    saved: dict[str, dict[str, Any]] = field(default_factory=dict)

    def read_saved(self, names: Sequence[str]) -> None:
        """Take the saved reports among ``names``; fail on a policy name that loads nothing."""
        for name in names:
            report = saved_report(name)
            if report is not None:
                self.saved[name] = report
            elif name != "ground-truth":
                resolve_policy_choice(name, self.run_dir)

    def score(self, name: str) -> dict[str, Any]:
        if name in self.saved:
            return self.saved[name]
        report = evaluate(
            name,
            self.tasks,
            suite=self.suite,
            split=self.split,
            model=self.model,
            run_dir=self.run_dir,
            options=self.options,
        )
        report.extra["classes"] = sorted(self.world) if self.world is not None else "all"
        if self.sample is not None:
            report.extra.update(sample=self.sample, seed=self.seed)
        typer.echo(report.describe(), err=self.describe_on_stderr)
        return report.to_json()


def write_result(result: dict[str, Any], out: Path | None, json_output: bool) -> None:
    """The report (or comparison) to ``--out`` and, with ``--json``, to stdout."""
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    if json_output:
        typer.echo(json.dumps(result))


def world_classes(option: str | None, settings: Settings) -> list[str] | None:
    """The API classes of ``--classes`` (None: every class), by default the run's world."""
    if option is None:
        from coevolve.services.pool_store.config import PoolStoreConfig

        return settings.section("pool_store", PoolStoreConfig).seed_classes
    if option.strip().lower() == "all":
        return None
    return [name.strip() for name in option.split(",") if name.strip()]


def _comparison(
    first: dict[str, Any], second: dict[str, Any], names: tuple[str, str], out: Path | None
) -> dict[str, Any]:
    """The paired comparison, with each side's summary (and its full report beside ``out``)."""
    from coevolve.report.compare import compare_reports

    comparison = compare_reports(first, second)
    for side, report in (("a", first), ("b", second)):
        comparison[side] = {k: v for k, v in report.items() if k != "entries"}
        if out is not None:
            path = out.with_name(f"{out.stem}-{side}.json")
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(report) + "\n", encoding="utf-8")
            comparison[side]["report"] = str(path)
    comparison["names"] = list(names)
    return comparison
