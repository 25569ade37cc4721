"""The BFCL multi-turn environment: one object per episode, its own API instances.

A user turn is answered by zero or more assistant messages with ``<tool_call>`` blocks;
an assistant message without any tool call ends the turn and the next user message comes
back as an observation. The episode ends after the last turn or when a step budget runs
out (then, as in BFCL, it counts as force-terminated and scores 0).
"""

from __future__ import annotations

from typing import Any

from bfcl_eval.constants.default_prompts import (
    DEFAULT_USER_PROMPT_FOR_ADDITIONAL_FUNCTION_FC,
    MAXIMUM_STEP_LIMIT,
)

from coevolve.shared.envs.bfcl.calls import call_string
from coevolve.shared.envs.bfcl.catalog import FunctionDoc, all_class_names
from coevolve.shared.envs.bfcl.instances import (
    Instances,
    create_instances,
    dispatch,
    function_table,
    public_state,
)
from coevolve.shared.envs.bfcl.scoring import EpisodeRecord, ScoreReport, score_episode
from coevolve.shared.envs.bfcl.tasks import ENVIRONMENT_NAME
from coevolve.shared.envs.bfcl.validation import (
    CallLimits,
    CallValidationError,
    ValidatedCall,
    validate_call,
)
from coevolve.shared.envs.protocol import ReplayResult, StepResult
from coevolve.shared.messages import ChatMessage, Task, ToolCall
from coevolve.shared.toolcalls import parse_tool_calls


class EpisodeNotStartedError(RuntimeError):
    """``reset(task)`` must come first."""


class BfclEnvironment:
    """BFCL multi-turn episodes over the API classes a task involves."""

    name = ENVIRONMENT_NAME

    def __init__(
        self,
        *,
        max_steps: int = 60,
        max_steps_per_turn: int = MAXIMUM_STEP_LIMIT,
        max_observation_chars: int | None = 16_000,
        limits: CallLimits | None = None,
    ) -> None:
        self.max_steps = max_steps
        self.max_steps_per_turn = max_steps_per_turn
        self.max_observation_chars = max_observation_chars
        self.limits = limits or CallLimits()
        self._task: Task | None = None
        self._instances: Instances = {}
        self._functions: dict[str, FunctionDoc] = {}
        self._record: EpisodeRecord = []
        self._turn = 0
        self._steps = 0
        self._steps_in_turn = 0
        self._done = True
        self._completed = False
        self._end_reason = ""
        self._report: ScoreReport | None = None

    # ------------------------------------------------------------------ episode state

    @property
    def task(self) -> Task:
        if self._task is None:
            raise EpisodeNotStartedError("call reset(task) first")
        return self._task

    @property
    def turn(self) -> int:
        return self._turn

    @property
    def done(self) -> bool:
        return self._done

    @property
    def record(self) -> EpisodeRecord:
        """Validated calls per turn and step (what scoring re-executes)."""
        return self._record

    @property
    def last_report(self) -> ScoreReport | None:
        """BFCL's verdict with its reason, after ``score()``."""
        return self._report

    def state(self) -> dict[str, dict[str, Any]]:
        """A copy of the instances' public attributes (what BFCL's state checker compares)."""
        return public_state(self._instances)

    # ------------------------------------------------------------------ protocol

    def reset(self, task: Task) -> list[ChatMessage]:
        if task.environment != ENVIRONMENT_NAME:
            raise ValueError(f"task {task.id} is for {task.environment!r}, not {self.name!r}")
        if not task.user_turns:
            raise ValueError(f"task {task.id} has no user turns")
        config = task.env_config
        involved = config.get("involved_classes")
        if not isinstance(involved, list) or not involved:
            raise ValueError(f"task {task.id}: env_config.involved_classes must list API classes")
        unknown = [name for name in involved if name not in all_class_names()]
        if unknown:
            raise ValueError(f"task {task.id}: unknown BFCL API classes {unknown}")
        self._task = task
        self._instances = create_instances(
            involved, task.initial_state, bool(config.get("long_context"))
        )
        self._record = [[]]
        self._turn = 0
        self._steps = 0
        self._steps_in_turn = 0
        self._done = False
        self._completed = False
        self._end_reason = ""
        self._report = None
        self._refresh_functions()
        return [self._user_message(0)]

    def tools(self) -> list[dict[str, Any]]:
        return [doc.tool_schema() for doc in self._functions.values()]

    def step(self, assistant_text: str) -> StepResult:
        if self._task is None:
            raise EpisodeNotStartedError("call reset(task) first")
        if self._done:
            return StepResult(
                observations=[],
                done=True,
                info=self._info(["the episode is over"], turn_ended=False),
            )
        parsed = parse_tool_calls(assistant_text)
        self._steps += 1
        self._steps_in_turn += 1
        if not parsed.has_tool_call_blocks:
            user = self._advance_turn()
            return StepResult(
                observations=[user] if user is not None else [],
                done=self._done,
                info=self._info([], turn_ended=True),
            )
        observations: list[ChatMessage] = []
        errors: list[str] = []
        step_calls: list[ValidatedCall] = []
        for item in parsed.ordered:
            if isinstance(item, str):
                ok, text = False, f"Error: {item}"
            else:
                ok, text = self._execute_into(item, step_calls)
            if not ok:
                errors.append(text)
            observations.append(ChatMessage(role="tool", content=self._clip(text)))
        self._record[self._turn].append(step_calls)
        self._check_budget()
        return StepResult(
            observations=observations,
            done=self._done,
            info=self._info(errors, turn_ended=False, executed=step_calls),
        )

    def execute(self, call: ToolCall) -> tuple[bool, str]:
        """Run one call as a step of the current turn (for explorers and judges)."""
        if self._task is None:
            raise EpisodeNotStartedError("call reset(task) first")
        if self._done:
            return False, "Error: the episode is over"
        step_calls: list[ValidatedCall] = []
        ok, text = self._execute_into(call, step_calls)
        self._record[self._turn].append(step_calls)
        self._steps += 1
        self._steps_in_turn += 1
        self._check_budget()
        return ok, self._clip(text)

    def replay(self, ground_truth: list[list[ToolCall]]) -> ReplayResult:
        """Each inner list is one turn's calls, run as one step; then the turn ends."""
        if self._task is None:
            raise EpisodeNotStartedError("call reset(task) first")
        before = public_state(self._instances)
        observations: list[str] = []
        errors: list[str] = []
        for offset, calls in enumerate(ground_truth):
            if self._done:
                errors.append(f"turn {self._turn + offset}: the task has no more turns")
                break
            step_calls: list[ValidatedCall] = []
            for call in calls:
                ok, text = self._execute_into(call, step_calls)
                observations.append(text)
                if not ok:
                    errors.append(f"turn {self._turn}: {call.name}: {text}")
            if step_calls:
                self._record[self._turn].append(step_calls)
            self._steps += 1
            self._advance_turn()
        return ReplayResult(
            ok=not errors,
            observations=observations,
            errors=errors,
            state_changed=public_state(self._instances) != before,
        )

    def score(self) -> float:
        if self._task is None:
            raise EpisodeNotStartedError("call reset(task) first")
        if self._report is None or not self._done:
            self._report = score_episode(self._task, self._record, self._completed)
            if not self._completed and self._end_reason:
                self._report.message = f"{self._end_reason}; {self._report.message}"
        return self._report.score

    def close(self) -> None:
        self._instances = {}
        self._functions = {}

    # ------------------------------------------------------------------ internals

    def _refresh_functions(self) -> None:
        """Offer every function except those held out until a later turn (miss_func)."""
        missed: dict[str, list[str]] = self.task.env_config.get("missed_function", {})
        hidden = [
            name for turn, names in missed.items() if int(turn) > self._turn for name in names
        ]
        self._functions = function_table(self.task.env_config["involved_classes"], hidden)

    def _user_message(self, turn: int) -> ChatMessage:
        text = self.task.user_turns[turn]
        missed = self.task.env_config.get("missed_function", {})
        if not text.strip() and str(turn) in missed:
            text = DEFAULT_USER_PROMPT_FOR_ADDITIONAL_FUNCTION_FC
        return ChatMessage(role="user", content=text)

    def _advance_turn(self) -> ChatMessage | None:
        if self._turn + 1 >= len(self.task.user_turns):
            self._done = True
            self._completed = True
            self._end_reason = "all turns answered"
            return None
        self._turn += 1
        self._steps_in_turn = 0
        self._record.append([])
        self._refresh_functions()
        self._check_budget()
        if self._done:
            return None
        return self._user_message(self._turn)

    def _check_budget(self) -> None:
        if self._done:
            return
        # As in BFCL, a turn may take max_steps_per_turn tool steps; one more ends the episode.
        if self._steps_in_turn > self.max_steps_per_turn:
            self._done = True
            self._end_reason = f"step budget: {self.max_steps_per_turn} steps in turn {self._turn}"
        elif self._steps >= self.max_steps:
            self._done = True
            self._end_reason = f"step budget: {self.max_steps} steps in the episode"

    def _execute_into(self, call: ToolCall, step_calls: list[ValidatedCall]) -> tuple[bool, str]:
        try:
            validated = validate_call(call, self._functions, self.limits)
        except CallValidationError as exc:
            return False, f"Error: {exc}"
        step_calls.append(validated)
        outcome = dispatch(self._instances, validated)
        return outcome.ok, outcome.observation

    def _clip(self, text: str) -> str:
        limit = self.max_observation_chars
        if limit is None or len(text) <= limit:
            return text
        return text[:limit] + f"... [truncated {len(text) - limit} characters]"

    def _info(
        self,
        errors: list[str],
        *,
        turn_ended: bool,
        executed: list[ValidatedCall] | None = None,
    ) -> dict[str, Any]:
        return {
            "calls": [c.name for c in executed or []],
            "call_strings": [call_string(c.name, c.arguments) for c in executed or []],
            "errors": errors,
            "turn": self._turn,
            "step": self._steps,
            "turn_ended": turn_ended,
            "end_reason": self._end_reason if self._done else "",
        }
