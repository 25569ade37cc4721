"""The BFCL multi-turn environment: one object per episode, its own API instances.

A user turn is answered by zero or more assistant messages with ``<tool_call>`` blocks;
an assistant message without any tool call ends the turn and the next user message comes
back as an observation. The episode ends after the last turn or when a step budget runs
out (then, as in BFCL, it counts as force-terminated and scores 0).

A per-turn task (``env_config["grain"] == "turn"``, see ``tasks.py``) starts where the
earlier turns' ground truth leaves the entry: ``reset`` replays those calls on the fresh
instances and returns the conversation so far (each earlier user turn, then for each of its
ground-truth calls an assistant message with that call and its observation, then a closing
reply) followed by the turn's
own user message; the episode then covers that one turn. Turn numbers (``info["turn"]``,
held-out functions of miss_func) stay those of the entry.
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
from coevolve.shared.envs.bfcl.scoring import (
    EpisodeRecord,
    ScoreReport,
    partial_credit,
    score_episode,
)
from coevolve.shared.envs.bfcl.tasks import (
    ENVIRONMENT_NAME,
    prior_ground_truth,
    train_argument_values,
)
from coevolve.shared.envs.bfcl.validation import (
    CallLimits,
    CallValidationError,
    ValidatedCall,
    validate_call,
)
from coevolve.shared.envs.episode import EpisodeNotStartedError, EpisodeState, StepCount
from coevolve.shared.envs.protocol import ReplayResult, StepResult
from coevolve.shared.messages import ChatMessage, Task, ToolCall
from coevolve.shared.toolcalls import format_tool_calls, parse_tool_calls

# The assistant replies that close an earlier turn in a per-turn task's conversation: after
# its ground-truth calls, and when its ground truth has no call (a function or a parameter
# is missing, as in BFCL's miss_func / miss_param).
PRIOR_TURN_DONE = "Done."
PRIOR_TURN_UNABLE = "I cannot do that yet: a function or some information I need is missing."


class BfclEnvironment(EpisodeState):
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
        self._clear_episode(started=False)

    def _clear_episode(self, *, started: bool) -> None:
        """The episode's record and counters at their start; ``started``: its first turn is
        open (not yet: nothing recorded, and done until ``reset``)."""
        self._record: EpisodeRecord = [[]] if started else []
        # per turn, the names of calls refused by validation (partial credit counts them)
        self._refused: list[list[str]] = [[]] if started else []
        self._turn = 0
        self._first_turn = 0
        self._steps = StepCount()
        self._done = not started
        self._completed = False
        self._end_reason = ""
        self._report: ScoreReport | None = None

    # ------------------------------------------------------------------ episode state

    @property
    def turn(self) -> int:
        """The current turn's index in the entry (per-turn tasks start at their turn)."""
        return self._first_turn + self._turn

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

    def argument_values(self, function: str, parameter: str) -> list[str]:
        """Strings the train split's ground truth passes to ``function``'s ``parameter``."""
        return list(train_argument_values().get((function, parameter), ()))

    # ------------------------------------------------------------------ protocol

    def reset(self, task: Task) -> list[ChatMessage]:
        if task.environment != ENVIRONMENT_NAME:
            raise ValueError(f"task {task.id} is for {task.environment!r}, not {self.name!r}")
        config = task.env_config
        involved = config.get("involved_classes")
        if not isinstance(involved, list) or not involved:
            raise ValueError(f"task {task.id}: env_config.involved_classes must list API classes")
        unknown = [name for name in involved if name not in all_class_names()]
        if unknown:
            raise ValueError(f"task {task.id}: unknown BFCL API classes {unknown}")
        prior_turns = config.get("prior_turns") or []
        prior_truth = prior_ground_truth(config)
        if len(prior_truth) != len(prior_turns) or config.get("turn", len(prior_turns)) != len(
            prior_turns
        ):
            raise ValueError(
                f"task {task.id}: env_config.turn, prior_turns and prior_ground_truth disagree"
            )
        self._task = task
        self._instances = create_instances(
            involved, task.initial_state, bool(config.get("long_context"))
        )
        self._clear_episode(started=True)
        conversation = self._replay_prior_turns(prior_turns, prior_truth)
        self._first_turn = len(prior_turns)
        self._refresh_functions()
        if not task.user_turns:  # a start state to explore from: nothing to answer
            return conversation
        return [*conversation, self._user_message(0)]

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
        self._steps.take()
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
        self._steps.take()
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
                errors.append(f"turn {self.turn + offset}: the task has no more turns")
                break
            step_calls: list[ValidatedCall] = []
            for call in calls:
                ok, text = self._execute_into(call, step_calls)
                observations.append(text)
                if not ok:
                    errors.append(f"turn {self.turn}: {call.name}: {text}")
            if step_calls:
                self._record[self._turn].append(step_calls)
            self._steps.total += 1
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

    def partial_credit(self) -> float:
        """Matched ground-truth calls in [0, 1] (``scoring.partial_credit``)."""
        if self._task is None:
            raise EpisodeNotStartedError("call reset(task) first")
        return partial_credit(self._task, self._record, self._refused)

    def close(self) -> None:
        self._instances = {}
        self._functions = {}

    # ------------------------------------------------------------------ internals

    def _replay_prior_turns(
        self, texts: list[str], ground_truth: list[list[ToolCall]]
    ) -> list[ChatMessage]:
        """Run the earlier turns' ground truth (each turn with the functions it offered);
        the conversation an agent that followed it would have had."""
        messages: list[ChatMessage] = []
        for turn, (text, calls) in enumerate(zip(texts, ground_truth, strict=True)):
            self._first_turn = turn
            self._refresh_functions()
            messages.append(self._user_text_message(turn, text))
            if not calls:
                messages.append(ChatMessage(role="assistant", content=PRIOR_TURN_UNABLE))
                continue
            # one call per message with its result after it, as the agent acts
            for call in calls:
                messages.append(
                    ChatMessage(
                        role="assistant", content=format_tool_calls([call]), tool_calls=[call]
                    )
                )
                _, observation = self._execute_into(call, [])
                messages.append(ChatMessage(role="tool", content=self._clip(observation)))
            messages.append(ChatMessage(role="assistant", content=PRIOR_TURN_DONE))
        return messages

    def _refresh_functions(self) -> None:
        """Offer every function except those held out until a later turn (miss_func)."""
        missed: dict[str, list[str]] = self.task.env_config.get("missed_function", {})
        hidden = [name for turn, names in missed.items() if int(turn) > self.turn for name in names]
        self._functions = function_table(self.task.env_config["involved_classes"], hidden)

    def _user_message(self, turn: int) -> ChatMessage:
        """The user message of the task's ``turn`` (an index into ``task.user_turns``)."""
        return self._user_text_message(self._first_turn + turn, self.task.user_turns[turn])

    def _user_text_message(self, entry_turn: int, text: str) -> ChatMessage:
        missed = self.task.env_config.get("missed_function", {})
        if not text.strip() and str(entry_turn) in missed:
            text = DEFAULT_USER_PROMPT_FOR_ADDITIONAL_FUNCTION_FC
        return ChatMessage(role="user", content=text)

    def _advance_turn(self) -> ChatMessage | None:
        if self._turn + 1 >= len(self.task.user_turns):
            self._done = True
            self._completed = True
            self._end_reason = "all turns answered"
            return None
        self._turn += 1
        self._steps.in_turn = 0
        self._record.append([])
        self._refused.append([])
        self._refresh_functions()
        self._check_budget()
        if self._done:
            return None
        return self._user_message(self._turn)

    def _execute_into(self, call: ToolCall, step_calls: list[ValidatedCall]) -> tuple[bool, str]:
        try:
            validated = validate_call(call, self._functions, self.limits)
        except CallValidationError as exc:
            if self._refused:
                self._refused[-1].append(call.name)
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
            "turn": self.turn,
            "step": self._steps.total,
            "turn_ended": turn_ended,
            "end_reason": self._end_reason if self._done else "",
        }
