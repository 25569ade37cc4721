"""Score an episode with BFCL's own multi-turn checkers, without BFCL's ``eval`` executor.

BFCL's ``multi_turn_checker`` re-executes the model's calls and the ground truth turn by
turn, then after every turn with a non-empty ground truth runs ``state_checker`` (the
instances' public attributes must equal the ground truth's) and ``response_checker``
(every ground-truth result must appear among the model's results so far). Its executor
turns call strings into code with ``eval`` and keeps instances in module globals, so this
module performs the same turn loop with the episode's validated calls dispatched to fresh
instances, and hands the instances and results to BFCL's ``state_checker`` and
``response_checker`` unchanged. As in BFCL's runner, an episode that did not reach the end
of every turn (force-terminated) scores 0.

A per-turn task is scored on its own turn only: both sides start from the instances reached
by replaying the earlier turns' ground truth, whose results count as the model's earlier
results (as in a whole entry whose earlier turns matched the ground truth); then the same
checks run after the turn.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from bfcl_eval.eval_checker.multi_turn_eval.multi_turn_checker import (
    response_checker,
    state_checker,
)
from bfcl_eval.eval_checker.multi_turn_eval.multi_turn_utils import is_empty_execute_response

from coevolve.shared.envs.bfcl.calls import call_string
from coevolve.shared.envs.bfcl.catalog import FunctionDoc
from coevolve.shared.envs.bfcl.instances import create_instances, dispatch, function_table
from coevolve.shared.envs.bfcl.tasks import prior_ground_truth
from coevolve.shared.envs.bfcl.validation import (
    CallValidationError,
    ValidatedCall,
    validate_call,
)
from coevolve.shared.messages import Task, ToolCall

# turn -> step -> validated calls of that step
EpisodeRecord = list[list[list[ValidatedCall]]]


@dataclass
class ScoreReport:
    valid: bool
    error_type: str | None = None
    message: str = ""
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def score(self) -> float:
        return 1.0 if self.valid else 0.0


def _ground_truth_results(
    calls: Sequence[ToolCall], instances: Mapping[str, Any], functions: Mapping[str, FunctionDoc]
) -> list[str]:
    results = []
    for call in calls:
        try:
            validated = validate_call(call, functions)
        except CallValidationError as exc:
            results.append(f"Error during execution: {exc}")
            continue
        results.append(dispatch(instances, validated).observation)
    return results


def score_episode(task: Task, record: EpisodeRecord, completed: bool) -> ScoreReport:
    """BFCL's verdict for an episode whose calls per turn and step are in ``record``."""
    ground_truth = task.ground_truth
    if len(ground_truth) != len(task.user_turns):
        return ScoreReport(
            False,
            "task:ground_truth_mismatch",
            f"task {task.id} has {len(task.user_turns)} user turns but "
            f"{len(ground_truth)} ground-truth turns",
        )
    if not completed or len(record) != len(ground_truth):
        return ScoreReport(
            False,
            "multi_turn:force_terminated",
            f"the episode answered {len(record)} of {len(ground_truth)} turns",
        )
    config = task.env_config
    involved = list(config.get("involved_classes", []))
    long_context = bool(config.get("long_context", False))
    model_instances = create_instances(involved, task.initial_state, long_context)
    truth_instances = create_instances(involved, task.initial_state, long_context)
    all_functions = function_table(involved)

    all_model_results: list[str] = []
    prior = prior_ground_truth(config)
    for truth_calls in prior:
        all_model_results.extend(_ground_truth_results(truth_calls, model_instances, all_functions))
        _ground_truth_results(truth_calls, truth_instances, all_functions)
    for offset, truth_calls in enumerate(ground_truth):
        turn_index = len(prior) + offset
        steps = [step for step in record[offset] if step]
        turn_results = [
            dispatch(model_instances, call).observation for step in steps for call in step
        ]
        truth_results = _ground_truth_results(truth_calls, truth_instances, all_functions)
        all_model_results.extend(turn_results)

        if truth_calls and (not steps or is_empty_execute_response(steps)):
            return ScoreReport(
                False,
                "multi_turn:empty_turn_model_response",
                f"no function call in turn {turn_index}",
            )
        if not truth_calls:
            continue
        state = state_checker(model_instances, truth_instances)
        if not state["valid"]:
            return _failed_check(state, turn_index, "differences")
        response = response_checker(all_model_results, truth_results, turn_index)
        if not response["valid"]:
            return _failed_check(response, turn_index, "missing_items")
    return ScoreReport(True)


def _failed_check(check: dict[str, Any], turn_index: int, detail: str) -> ScoreReport:
    """The report of a BFCL checker's failed ``check`` in turn ``turn_index``, with the one
    ``detail`` it names."""
    return ScoreReport(
        False,
        check["error_type"],
        f"turn {turn_index}: {check['error_message']}",
        {detail: check["details"][detail], "turn": turn_index},
    )


def record_call_strings(record: EpisodeRecord) -> list[list[list[str]]]:
    """The record in BFCL's decoded-result shape, built from validated values."""
    return [
        [[call_string(call.name, call.arguments) for call in step] for step in turn]
        for turn in record
    ]


def partial_credit(
    task: Task, record: EpisodeRecord, refused: Sequence[Sequence[str]] = ()
) -> float:
    """How close an episode came to the ground truth's calls, in [0, 1].

    Per turn with ground-truth calls, each is matched once: 1 by a made call with the same
    function and arguments (compared after validation, so defaults and coercions do not
    count), else 0.5 by a made or refused call (``refused[turn]``: names of calls that
    failed validation, e.g. a wrong argument) of the same function. The sum is divided by
    the larger of the two call counts (so extra calls cost); turns are averaged.

    A training signal for a policy that solves nothing yet (reward shaping); BFCL's verdict
    is ``score_episode``, which evaluation keeps using.
    """
    functions = function_table(list(task.env_config.get("involved_classes", [])))
    credits: list[float] = []
    for offset, truth_calls in enumerate(task.ground_truth):
        if not truth_calls:
            continue
        made = [call for step in record[offset] for call in step] if offset < len(record) else []
        unused_names = list(refused[offset]) if offset < len(refused) else []
        attempts = len(made) + len(unused_names)
        expected = [_validated_or_none(call, functions) for call in truth_calls]
        unused = list(made)
        matched = 0.0
        for truth, call in zip(expected, truth_calls, strict=True):
            exact = next((c for c in unused if truth is not None and _same(c, truth)), None)
            if exact is not None:
                matched += 1.0
                unused.remove(exact)
                continue
            named = next((c for c in unused if c.name == call.name), None)
            if named is not None:
                matched += 0.5
                unused.remove(named)
            elif call.name in unused_names:
                matched += 0.5
                unused_names.remove(call.name)
        credits.append(matched / max(len(truth_calls), attempts))
    return sum(credits) / len(credits) if credits else 0.0


def _validated_or_none(
    call: ToolCall, functions: Mapping[str, FunctionDoc]
) -> ValidatedCall | None:
    try:
        return validate_call(call, functions)
    except CallValidationError:
        return None


def _same(made: ValidatedCall, truth: ValidatedCall) -> bool:
    return made.name == truth.name and made.arguments == truth.arguments
