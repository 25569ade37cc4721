"""Run a suite of tasks through a player and summarize: success, partial credit, the
ground truth's likelihood, their intervals, time per task.

A *player* takes a task and returns its score in [0, 1] (and a short reason). Two come
with the project: ``ground_truth_player`` replays each entry's own answer (a check of the
environment), and ``policy_player`` lets a policy act through ``coevolve.shared.episodes``
(a batch of tasks at a time, so their generations share batched forward passes); it also
records each task's partial credit (matched ground-truth calls, what the rollout reward
uses). A *scorer* (``ground_truth_scorer``) adds the mean per-token log-likelihood of the
ground truth's calls, teacher-forced on the replayed conversation (on the eval's llama.cpp
engine a batch at a time, else one torch forward pass per task): a continuous measure
that moves before a 0/1 decision does.
A player that raises on one entry gives that entry 0 with the error recorded; the suite
goes on. A report records the tool rendering its prompts used (``compact`` or ``full``).
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, TextIO

from tqdm import tqdm

from coevolve.shared.envs.protocol import Environment
from coevolve.shared.envs.rendering import configured_tool_rendering
from coevolve.shared.messages import Task, Trajectory

if TYPE_CHECKING:
    from coevolve.shared.policy import LoadedPolicy, SamplingParams

Z_95 = 1.959963984540054


@dataclass
class EntryOutcome:
    score: float
    detail: str = ""
    partial_credit: float | None = None


Player = Callable[[Task], EntryOutcome]
# Plays several tasks at once (a policy batches their generations); one outcome per task.
BatchPlayer = Callable[[list[Task]], list[EntryOutcome]]
EnvironmentFactory = Callable[[], Environment]
# (mean log-prob per token, tokens) of each task's ground-truth calls; None: not scorable
GroundTruthScorer = Callable[[list[Task]], list[tuple[float, int] | None]]


@dataclass
class EntryResult:
    entry_id: str
    score: float
    seconds: float
    detail: str = ""
    error: str | None = None
    # matched ground-truth calls in [0, 1] (1 when solved); None: the player gives none
    partial_credit: float | None = None
    # mean per-token log-likelihood of the ground truth's calls under the policy
    gt_logprob: float | None = None
    gt_tokens: int = 0


@dataclass
class SuiteReport:
    suite: str
    split: str
    policy: str
    entries: list[EntryResult] = field(default_factory=list)
    total_seconds: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)
    # how the prompts showed the tools (the process's configured rendering by default)
    tool_rendering: str = field(default_factory=configured_tool_rendering)

    @property
    def n(self) -> int:
        return len(self.entries)

    @property
    def accuracy(self) -> float:
        return sum(e.score for e in self.entries) / self.n if self.n else 0.0

    @property
    def ci95(self) -> tuple[float, float]:
        return wilson_interval(sum(e.score for e in self.entries), self.n)

    @property
    def partial_credit_mean(self) -> float | None:
        values = [e.partial_credit for e in self.entries if e.partial_credit is not None]
        return sum(values) / len(values) if values else None

    @property
    def gt_logprob_per_token(self) -> float | None:
        """The mean over tasks of each task's mean per-token log-likelihood."""
        values = [e.gt_logprob for e in self.entries if e.gt_logprob is not None]
        return sum(values) / len(values) if values else None

    @property
    def seconds_per_entry(self) -> float:
        return sum(e.seconds for e in self.entries) / self.n if self.n else 0.0

    def failures(self) -> list[EntryResult]:
        return [e for e in self.entries if e.score < 1.0]

    def summary(self) -> dict[str, Any]:
        low, high = self.ci95
        return {
            "suite": self.suite,
            "split": self.split,
            "policy": self.policy,
            "tool_rendering": self.tool_rendering,
            "n": self.n,
            "accuracy": self.accuracy,
            "success": self.accuracy,
            "ci95_low": low,
            "ci95_high": high,
            "partial_credit_mean": self.partial_credit_mean,
            "gt_logprob_per_token": self.gt_logprob_per_token,
            "seconds_per_entry": self.seconds_per_entry,
            "s_per_task": self.seconds_per_entry,
            "total_seconds": self.total_seconds,
            "errors": sum(1 for e in self.entries if e.error),
            **self.extra,
        }

    def to_json(self) -> dict[str, Any]:
        return {**self.summary(), "entries": [asdict(e) for e in self.entries]}

    def describe(self) -> str:
        low, high = self.ci95
        lines = [
            f"{self.suite} [{self.split}] policy={self.policy} tools={self.tool_rendering}: "
            f"accuracy {self.accuracy:.3f} (95% CI {low:.3f}-{high:.3f}) over {self.n} entries, "
            f"{self.seconds_per_entry:.2f} s/entry"
        ]
        measures = []
        if self.partial_credit_mean is not None:
            measures.append(f"partial credit {self.partial_credit_mean:.3f}")
        if self.gt_logprob_per_token is not None:
            measures.append(f"ground-truth log-likelihood {self.gt_logprob_per_token:.3f}/token")
        if measures:
            lines.append("; ".join(measures))
        failures = self.failures()
        if failures:
            lines.append(f"{len(failures)} entries below 1.0:")
            for entry in failures[:50]:
                reason = entry.error or entry.detail
                lines.append(f"  {entry.entry_id}: {entry.score:.2f} {reason}".rstrip())
            if len(failures) > 50:
                lines.append(f"  ... and {len(failures) - 50} more")
        return "\n".join(lines)


def wilson_interval(successes: float, n: int, z: float = Z_95) -> tuple[float, float]:
    """Wilson score interval for a proportion (``successes`` may be a sum of scores)."""
    if n <= 0:
        return 0.0, 1.0
    p = min(max(successes / n, 0.0), 1.0)
    denominator = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denominator
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denominator
    low = 0.0 if p == 0.0 else max(0.0, centre - half)
    high = 1.0 if p == 1.0 else min(1.0, centre + half)
    return low, high


def run_suite(
    tasks: Sequence[Task],
    player: Player | BatchPlayer,
    *,
    suite: str,
    split: str,
    policy: str,
    batch_size: int = 0,
    progress: bool = True,
    stream: TextIO | None = None,
    scorer: GroundTruthScorer | None = None,
) -> SuiteReport:
    """Play every task in order; a progress bar (with running accuracy) goes to stderr.

    With ``batch_size`` > 0, ``player`` is a BatchPlayer given that many tasks at a time,
    and each entry's seconds are its batch's wall time divided by the batch's size.
    ``scorer`` adds each task's ground-truth log-likelihood (its time is counted too).
    """
    report = SuiteReport(suite=suite, split=split, policy=policy)
    started = time.perf_counter()
    size = max(batch_size, 1)
    with tqdm(
        total=len(tasks),
        desc=f"{suite} [{split}]",
        unit="entry",
        file=stream or sys.stderr,
        disable=not progress,
        dynamic_ncols=True,
        mininterval=0.5,
    ) as bar:
        for start in range(0, len(tasks), size):
            chunk = list(tasks[start : start + size])
            chunk_started = time.perf_counter()
            results = _play_chunk(chunk, player, batched=batch_size > 0)
            if scorer is not None:
                _add_likelihoods(chunk, results, scorer)
            seconds = (time.perf_counter() - chunk_started) / len(chunk)
            for result in results:
                result.seconds = seconds
            report.entries.extend(results)
            bar.set_postfix(acc=f"{report.accuracy:.3f}")
            bar.update(len(chunk))
    report.total_seconds = time.perf_counter() - started
    return report


def _play_chunk(
    chunk: list[Task], player: Player | BatchPlayer, *, batched: bool
) -> list[EntryResult]:
    if batched:
        batch_player: Any = player
        try:
            outcomes: list[EntryOutcome] = batch_player(chunk)
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
            return [EntryResult(task.id, 0.0, 0.0, error=error) for task in chunk]
        return [_result(task, outcome) for task, outcome in zip(chunk, outcomes, strict=True)]
    single: Any = player
    results = []
    for task in chunk:
        try:
            results.append(_result(task, single(task)))
        except Exception as exc:
            results.append(EntryResult(task.id, 0.0, 0.0, error=f"{type(exc).__name__}: {exc}"))
    return results


def _result(task: Task, outcome: EntryOutcome) -> EntryResult:
    return EntryResult(
        task.id, float(outcome.score), 0.0, outcome.detail, partial_credit=outcome.partial_credit
    )


def _add_likelihoods(
    chunk: list[Task], results: list[EntryResult], scorer: GroundTruthScorer
) -> None:
    try:
        scores = scorer(chunk)
    except Exception as exc:  # the measure is missing for this chunk; the scores stand
        for result in results:
            result.error = result.error or f"likelihood: {type(exc).__name__}: {exc}"
        return
    for result, score in zip(results, scores, strict=True):
        if score is not None:
            result.gt_logprob, result.gt_tokens = score


def ground_truth_player(make_env: EnvironmentFactory) -> Player:
    """Replay each entry's own ground truth and score it: 1.0 unless the environment is off."""

    def play(task: Task) -> EntryOutcome:
        env = make_env()
        try:
            env.reset(task)
            replay = env.replay(task.ground_truth)
            score = env.score()
            detail = _report_message(env)
            if score < 1.0 and replay.errors:
                detail = f"{detail}; replay errors: {'; '.join(replay.errors)[:300]}"
            return EntryOutcome(score, detail)
        finally:
            env.close()

    return play


def policy_player(
    engine: Any,
    make_env: EnvironmentFactory,
    params: SamplingParams,
    max_steps_per_turn: int,
    on_trajectory: Callable[[Trajectory], None] | None = None,
    on_step: Callable[[int, int, float], None] | None = None,
) -> BatchPlayer:
    """Let the policy play tasks through ``coevolve.shared.episodes.run_groups``: one
    episode per task, all of a batch generated together (use with ``batch_size``).

    A batch may take ``max_steps_per_turn`` assistant messages per user turn of its
    longest task (the rollout's budget). Each outcome carries the episode's partial credit.
    """
    from coevolve.shared.episodes import run_groups

    def play(tasks: list[Task]) -> list[EntryOutcome]:
        made: list[Environment] = []

        def make_and_keep() -> Environment:
            env = make_env()
            made.append(env)
            return env

        turns = max((len(task.user_turns) for task in tasks), default=1)
        max_steps = max_steps_per_turn * max(turns, 1)
        groups = run_groups(engine, make_and_keep, tasks, 1, params, max_steps, on_step=on_step)
        outcomes = []
        # one episode per task, made in task order: made[i] played tasks[i]
        for (trajectory,), env in zip(groups, made, strict=True):
            if on_trajectory is not None:
                on_trajectory(trajectory)
            outcome = _trajectory_outcome(trajectory, max_steps)
            outcome.partial_credit = 1.0 if outcome.score >= 1.0 else _partial_credit(env)
            outcomes.append(outcome)
        return outcomes

    return play


def _partial_credit(env: Environment) -> float | None:
    try:
        return float(env.partial_credit())
    except Exception:  # an environment without the measure, or one that failed to score
        return None


def _trajectory_outcome(trajectory: Trajectory, max_steps: int) -> EntryOutcome:
    # the policy's own messages: runs of generated tokens (the conversation so far is not)
    mask = trajectory.loss_mask
    steps = sum(1 for i, m in enumerate(mask) if m and (i == 0 or not mask[i - 1]))
    parts = [f"{steps} steps, {len(trajectory.actions)} calls"]
    if trajectory.error:
        parts.append(trajectory.error)
    if not trajectory.finished:
        parts.append(f"not finished within {max_steps} steps")
    return EntryOutcome(float(trajectory.reward), "; ".join(parts))


def _report_message(env: Environment) -> str:
    report = getattr(env, "last_report", None)
    message = getattr(report, "message", "")
    return str(message)


# teacher-forced log-probs of sequences[i][p] for p in positions[i]; None: not scorable
TokenLogprobs = Callable[[list[list[int]], list[list[int]]], list[list[float] | None]]


def ground_truth_scorer(
    policy: LoadedPolicy, make_env: EnvironmentFactory, token_logprobs: TokenLogprobs | None = None
) -> GroundTruthScorer:
    """Each task's mean per-token log-likelihood of its ground-truth calls under ``policy``.

    The ground truth is replayed in a fresh environment one call per assistant message
    (``coevolve.shared.demonstrations``, the warm start's format), and its call messages
    are scored teacher-forced at temperature 1; the closing replies are in the context but
    not scored. ``token_logprobs`` (the eval's llama.cpp engine) scores a batch's tasks
    together, sharing their common prefixes; without it the torch policy makes one
    forward pass per sequence. A task without calls, or whose ground truth does not
    replay, gets None.
    """
    from coevolve.shared.demonstrations import (
        IGNORE_INDEX,
        ReplayError,
        replayed_conversation,
        tokenize_conversation,
    )

    def scored_sequences(task: Task) -> list[tuple[list[int], list[int]]] | None:
        """(token ids, the positions of the call tokens) of each sequence of the task."""
        if not any(task.ground_truth):
            return None
        env = make_env()
        try:
            conversation = replayed_conversation(task, env)
        except ReplayError:
            return None
        finally:
            env.close()
        examples = tokenize_conversation(policy.tokenizer, conversation, supervise_closing=False)
        sequences = [
            (
                example.input_ids,
                [i for i, label in enumerate(example.labels) if label != IGNORE_INDEX],
            )
            for example in examples
        ]
        return [(ids, wanted) for ids, wanted in sequences if wanted] or None

    score_sequences = token_logprobs or _torch_token_logprobs(policy)

    def score(tasks: list[Task]) -> list[tuple[float, int] | None]:
        per_task = [scored_sequences(task) for task in tasks]
        flat = [sequence for sequences in per_task if sequences for sequence in sequences]
        logprobs = iter(score_sequences([ids for ids, _ in flat], [wanted for _, wanted in flat]))
        results: list[tuple[float, int] | None] = []
        for sequences in per_task:
            scores = [next(logprobs) for _ in sequences or ()]
            if not scores or any(row is None for row in scores):
                results.append(None)
                continue
            values = [value for row in scores if row is not None for value in row]
            results.append((sum(values) / len(values), len(values)))
        return results

    return score


def _torch_token_logprobs(policy: LoadedPolicy) -> TokenLogprobs:
    """``TokenLogprobs`` from the torch policy, in eval mode, one forward pass a sequence."""
    import torch

    from coevolve.shared.policy.logprobs import sequence_logprobs

    model = policy.model
    device = torch.device(policy.device)

    def one(ids: list[int], wanted: list[int]) -> list[float]:
        tensor = torch.tensor([ids], device=device)
        mask = torch.zeros_like(tensor, dtype=torch.bool)
        mask[0, wanted] = True
        logprobs, _ = sequence_logprobs(
            model, tensor, torch.ones_like(tensor), 1.0, positions=mask, with_entropy=False
        )
        return [float(value) for value in logprobs[mask]]

    def score(sequences: list[list[int]], positions: list[list[int]]) -> list[list[float] | None]:
        was_training = model.training
        model.eval()
        try:
            with torch.inference_mode():
                return [one(ids, wanted) for ids, wanted in zip(sequences, positions, strict=True)]
        finally:
            model.train(was_training)

    return score
