"""The message catalogue: every Struct that crosses the bus.

Each top-level message is tagged (``"type"`` on the wire) and carries ``schema`` so a
consumer can refuse a version it does not understand. Encoding is msgpack. Identity
fields (``id``) are what handlers de-duplicate on and what publishers put in
``Nats-Msg-Id``; derive them deterministically from the input when a handler republishes,
so a redelivered input produces the same output ids.
"""

from __future__ import annotations

import hashlib
import sys
import time
import uuid
from typing import Annotated, Any, Literal, TypeVar

import msgspec

SCHEMA_VERSION = 1

# Constraints checked when a message is decoded (never when one is built): a message that
# breaks one is refused like undecodable bytes, and the runtime dead-letters it.
# NaN and +-inf fail these bounds, so "finite" is a range.
Finite = Annotated[float, msgspec.Meta(ge=-sys.float_info.max, le=sys.float_info.max)]
NonNegativeFinite = Annotated[float, msgspec.Meta(ge=0.0, le=sys.float_info.max)]
Count = Annotated[int, msgspec.Meta(ge=0)]
Version = Annotated[int, msgspec.Meta(ge=0)]
TokenId = Annotated[int, msgspec.Meta(ge=0)]
StepLabel = Annotated[int, msgspec.Meta(ge=-1, le=1)]
# far beyond any context window: a longer trajectory is garbage or an attack
MAX_TRAJECTORY_TOKENS = 262_144
MAX_GROUP_SIZE = 1024

Origin = Literal["seed", "explored", "synthesized"]
SignalKind = Literal["forgetting", "boundary", "rare", "uncertainty"]
TaskStatus = Literal["active", "retired"]
ExplorationMode = Literal["guided", "unguided"]
# which policy a rollout samples: the agent being trained, or the co-evolving failure
# agent whose near-success failures are its hard negatives (learner.grpo.preference)
Agent = Literal["target", "failure"]

ORIGINS: tuple[Origin, ...] = ("seed", "explored", "synthesized")
SIGNAL_KINDS: tuple[SignalKind, ...] = ("forgetting", "boundary", "rare", "uncertainty")


def new_id() -> str:
    return uuid.uuid4().hex


def derived_id(*parts: object) -> str:
    """A stable id from its inputs: the same input always yields the same output id."""
    digest = hashlib.sha256("\x1f".join(str(p) for p in parts).encode()).hexdigest()
    return digest[:32]


def now() -> float:
    return time.time()


class Part(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A value nested inside a message (not sent on its own)."""

    def validate(self) -> None:
        """Raise ValueError for what the field constraints cannot say (run by ``decode``)."""


class Message(msgspec.Struct, kw_only=True, omit_defaults=True, tag_field="type", tag=True):
    """A top-level message. ``id`` is its identity for de-duplication."""

    id: str = msgspec.field(default_factory=new_id)
    schema: Annotated[int, msgspec.Meta(ge=1)] = SCHEMA_VERSION

    def validate(self) -> None:
        """Raise ValueError for what the field constraints cannot say (run by ``decode``)."""


# --------------------------------------------------------------------------- parts


class ToolCall(Part):
    name: str
    arguments: dict[str, Any] = msgspec.field(default_factory=dict)


class ChatMessage(Part):
    role: Literal["system", "user", "assistant", "tool"]
    content: str
    tool_calls: list[ToolCall] = msgspec.field(default_factory=list)


class Timings(Part):
    generate_s: float = 0.0
    environment_s: float = 0.0
    total_s: float = 0.0


class ExplorationContext(Part):
    summary: str
    failure_cause: str
    instability_pattern: str
    focus_pattern: list[str]
    mistakes_to_avoid: list[str]


CallProblem = Literal["missed", "wrong_function", "wrong_arguments", "wrong_order"]


class FailedCall(Part):
    """A ground-truth call the policy did not make as it should have in one trajectory.

    ``got`` is the policy's call that stood in its place (None when it made none):
    another function (``wrong_function``), the same function with other arguments
    (``wrong_arguments``), or the right call after a call it should have followed
    (``wrong_order``).
    """

    expected: ToolCall
    problem: CallProblem
    got: ToolCall | None = None


class Lineage(Part):
    """How a task came to be: signal -> context -> exploration -> candidate -> verdict.

    Each stage fills its part as the candidate travels, so the accepted task carries its
    whole chain into pool-store (and so into DuckDB) without a join across services.
    """

    signal_id: str | None = None
    signal_kind: SignalKind | None = None
    signal_evidence: dict[str, Any] = msgspec.field(default_factory=dict)
    parent_task_id: str | None = None
    context: ExplorationContext | None = None
    exploration_id: str | None = None
    exploration_mode: ExplorationMode | None = None
    exploration_steps: int = 0
    candidate_id: str | None = None
    verdict_id: str | None = None
    trace_id: str | None = None
    # synthesis generations from a seed task: a seed task 0, its child 1, a child's child 2
    depth: int = 0
    # what the policy got wrong in the parent turn whose rollout raised the signal, and
    # the functions of those calls: a child must call at least one of them
    failed_calls: list[FailedCall] = msgspec.field(default_factory=list)
    target_functions: list[str] = msgspec.field(default_factory=list)
    # the policy version whose rollout raised the signal (freshness: how many versions
    # pass before the child is first drawn)
    signal_version: int | None = None
    # a substitution child: the parent's request and the value swapped (old, new), so the
    # judge can check that the new value keeps the old one's role
    parent_request: str | None = None
    replaced: list[Any] | None = None
    # a composed task: the ids of the tasks whose turns it joins, in order
    composed_from: list[str] = msgspec.field(default_factory=list)
    # a state variant: the parent's turn on another initial state
    varied_state: bool = False
    # a labelled train turn (origin "seed") that the experiment's labelled_control arm
    # added while a run with no labels trained: new to the run, so the job feed gives it
    # the fresh-first share a synthesized task gets (pool_store.sampling.fresh_share)
    labelled_control: bool = False


class Task(Part):
    """A unit of training or evaluation work in one environment.

    ``user_turns[i]`` is answered by ``ground_truth[i]`` (zero or more calls).
    ``env_config`` holds what the environment needs beyond the initial state (for BFCL:
    involved classes, held-out functions).
    """

    id: str
    environment: str
    user_turns: list[str]
    initial_state: dict[str, Any] = msgspec.field(default_factory=dict)
    ground_truth: list[list[ToolCall]] = msgspec.field(default_factory=list)
    env_config: dict[str, Any] = msgspec.field(default_factory=dict)
    origin: Origin = "seed"
    description: str = ""
    source_entry: str | None = None
    lineage: Lineage = msgspec.field(default_factory=Lineage)
    status: TaskStatus = "active"
    created_at: float = msgspec.field(default_factory=now)

    def content_hash(self) -> str:
        """Identity of what the task asks, independent of ids, lineage and time."""
        body = msgspec.json.encode(
            [self.environment, self.user_turns, self.initial_state, self.env_config]
        )
        return hashlib.sha256(body).hexdigest()


class Trajectory(Part):
    """One episode of the policy on one task, ready for the learner.

    ``token_ids`` covers the whole conversation; ``loss_mask[i]`` is 1 only for tokens
    the policy generated, and ``logprobs[i]`` is the behaviour log-prob of token i
    (0.0 where the mask is 0), sampled at ``temperature``. ``entropies`` is the policy's
    mean token entropy per assistant turn, used by the uncertainty signal.
    ``tool_rendering`` is how the prompt showed the tools (``compact`` or ``full``; None
    when not recorded). ``step_labels`` is the attributor's word on each assistant message
    the policy generated, in order (+1 helped, -1 hurt, 0 neutral; empty: not labelled);
    the i-th is about the i-th run of 1s in ``loss_mask`` (``shared/attribution``).
    """

    id: str
    task_id: str
    messages: list[ChatMessage]
    token_ids: Annotated[list[TokenId], msgspec.Meta(max_length=MAX_TRAJECTORY_TOKENS)]
    logprobs: list[Finite]
    loss_mask: list[Annotated[int, msgspec.Meta(ge=0, le=1)]]
    reward: Finite
    policy_version: Version
    temperature: NonNegativeFinite = 1.0
    # nucleus / top-k truncation it was sampled with (1.0 / None: the full softmax)
    top_p: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] = 1.0
    top_k: int | None = None
    timings: Timings = msgspec.field(default_factory=Timings)
    actions: list[str] = msgspec.field(default_factory=list)
    entropies: list[Finite] = msgspec.field(default_factory=list)
    finished: bool = True
    error: str | None = None
    tool_rendering: Literal["compact", "full"] | None = None
    step_labels: list[StepLabel] = msgspec.field(default_factory=list)
    # navigated (``rollout.navigation``): the experiences that were in its prompt when it
    # was sampled; ``messages`` and ``token_ids`` hold the prompt without them, and
    # ``logprobs`` stay those of the prompt with them (empty: sampled without)
    experience_ids: list[str] = msgspec.field(default_factory=list)

    def validate(self) -> None:
        if not len(self.token_ids) == len(self.logprobs) == len(self.loss_mask):
            raise ValueError(
                f"trajectory {self.id}: {len(self.token_ids)} token ids, "
                f"{len(self.logprobs)} log-probs, {len(self.loss_mask)} mask entries"
            )


class InteractionStep(Part):
    """One (history, action, observation) tuple of an exploration round."""

    history: list[ChatMessage]
    action: ToolCall
    observation: str
    ok: bool = True  # the call ran without an error


class ExplorationRound(Part):
    """One round's steps. A substitution round (``explorer/substitution.py``) is the
    parent turn's calls with the value ``replaced[0]`` replaced by ``replaced[1]``;
    ``request`` is then the parent's request with the same replacement when it states
    the value (None: the abstractor's LLM edits the parent's request). A round the
    explorer LLM made has neither."""

    steps: list[InteractionStep]
    request: str | None = None
    replaced: list[Any] | None = None
    # a composed round (``explorer/composition.py``): the ids of the tasks whose turns its
    # calls join, its ``request`` theirs joined; a unit as it is, like a substitution
    composed_from: list[str] | None = None
    # a state variant (``explorer/state_variation.py``): the parent's turn on another
    # initial state, its calls replayed there; a unit as it is, like a substitution
    varied_state: bool = False


class ScoreSample(Part):
    task_id: str
    policy_version: Version
    score: Finite
    length: Count
    generate_s: float = 0.0
    environment_s: float = 0.0


# --------------------------------------------------------------------------- agent loop


class Experience(Message):
    """An insight the distiller drew from one rollout group's best and worst attempts,
    for navigated rollouts of similar tasks (AgentEvolver's self-navigating).

    ``request`` is the task's user turns and ``functions`` the functions its attempts
    called: what retrieval matches a new task against. ``trajectory_ids`` and ``rewards``
    are the two attempts it compares (best first): its lineage.
    """

    text: Annotated[str, msgspec.Meta(min_length=1, max_length=2000)]
    task_id: str
    environment: str
    request: str
    group_id: str
    trajectory_ids: list[str]
    rewards: list[Finite]
    policy_version: Version
    functions: list[str] = msgspec.field(default_factory=list)
    created_at: float = msgspec.field(default_factory=now)


class RolloutJob(Message):
    """Roll out ``group_size`` trajectories of one task (one group); ``experiences``: the
    stored experiences most like the task, for navigated rollouts (empty: none)."""

    task: Task
    group_size: Annotated[int, msgspec.Meta(ge=1, le=MAX_GROUP_SIZE)] = 8
    min_policy_version: Version = 0
    experiences: list[Experience] = msgspec.field(default_factory=list)
    agent: Agent = "target"


class RolloutGroup(Message):
    task_id: str
    origin: Origin
    policy_version: Version
    trajectories: Annotated[list[Trajectory], msgspec.Meta(max_length=MAX_GROUP_SIZE)]
    job_id: str | None = None
    created_at: float = msgspec.field(default_factory=now)
    # seconds the attributor role spent labelling the group's steps (failed tries
    # included; 0: not labelled), see ``rollout.step_credit``
    label_s: NonNegativeFinite = 0.0
    # the policy that sampled it; ``policy_version`` is that agent's version
    agent: Agent = "target"

    def validate(self) -> None:
        for trajectory in self.trajectories:
            if trajectory.task_id != self.task_id:
                raise ValueError(
                    f"trajectory {trajectory.id} is of task {trajectory.task_id}, "
                    f"the group of task {self.task_id}"
                )
            trajectory.validate()

    def rewards(self) -> list[float]:
        return [t.reward for t in self.trajectories]


class RolloutResults(Message):
    """Scores of one group, for pool-store's history (small, unlike the group)."""

    group_id: str
    samples: list[ScoreSample]

    def validate(self) -> None:
        for sample in self.samples:
            sample.validate()


class PolicyVersion(Message):
    """A new policy: weights are in the object store under ``object_name``."""

    version: Version
    step: Version
    bucket: str
    object_name: str
    base_model: str
    kind: Literal["lora", "full"] = "lora"
    sha256: str = ""
    created_at: float = msgspec.field(default_factory=now)


# --------------------------------------------------------------------------- data loop


class Signal(Message):
    kind: SignalKind
    task: Task
    trajectory: Trajectory
    group_id: str
    policy_version: Version
    evidence: dict[str, Any] = msgspec.field(default_factory=dict)
    created_at: float = msgspec.field(default_factory=now)

    def validate(self) -> None:
        self.trajectory.validate()


class ExplorationRequest(Message):
    """Ask for unguided exploration from a train-split state (seed mode / baseline).
    ``covered``: calls the task set already has (``name(arg=value)``), for the explorer
    to go beyond."""

    task: Task
    rounds: Annotated[int, msgspec.Meta(ge=1, le=100)] = 1
    covered: Annotated[list[str], msgspec.Meta(max_length=200)] = msgspec.field(
        default_factory=list
    )
    # vary the task with the synthesis machinery an aimed signal's turn gets (variants and
    # composed turns, no LLM), aimed at nothing: the unguided control of guided synthesis
    vary: bool = False


class Exploration(Message):
    mode: ExplorationMode
    task: Task
    rounds: list[ExplorationRound]
    context: ExplorationContext | None = None
    signal_id: str | None = None
    signal_kind: SignalKind | None = None
    signal_evidence: dict[str, Any] = msgspec.field(default_factory=dict)
    # what the policy got wrong in the signal's trajectory (guided explorations)
    failed_calls: list[FailedCall] = msgspec.field(default_factory=list)
    # the policy version whose rollout raised the signal
    signal_version: int | None = None
    created_at: float = msgspec.field(default_factory=now)


class TaskCandidate(Message):
    exploration_id: str
    task: Task
    created_at: float = msgspec.field(default_factory=now)


class Verdict(Message):
    candidate_id: str
    accepted: bool
    reasons: list[str]
    task: Task
    criteria: dict[str, bool] = msgspec.field(default_factory=dict)
    created_at: float = msgspec.field(default_factory=now)


class TaskAdded(Message):
    task_id: str
    origin: Origin


# --------------------------------------------------------------------------- operations


class Heartbeat(Message):
    service: str
    instance: str
    pid: int
    host: str
    started_at: float
    sent_at: float = msgspec.field(default_factory=now)
    # "starting" until setup ends, then "running", unless the service reports its own
    # phase ("warm start"); progress_done of progress_total, and a detail, go with it
    phase: str = "running"
    in_flight: int = 0
    processed: int = 0
    failed: int = 0
    dead_lettered: int = 0
    progress_done: int | None = None
    progress_total: int | None = None
    detail: str = ""


# the learner's heartbeat phase while it runs a GRPO step (what `bench chaos` waits for)
GRPO_STEP_PHASE = "grpo step"
# the learner holds its next step until the data loop keeps the pacing contract
WAITING_FOR_DATA_PHASE = "waiting for data"


class Metric(Message):
    service: str
    name: str
    value: float
    step: int = 0
    tags: dict[str, str] = msgspec.field(default_factory=dict)
    at: float = msgspec.field(default_factory=now)


class DeadLetter(Message):
    service: str
    subject: str
    reason: str
    payload: bytes
    headers: dict[str, str] = msgspec.field(default_factory=dict)
    at: float = msgspec.field(default_factory=now)


# --------------------------------------------------------------------------- pool-store API


class AddTasks(Message):
    tasks: list[Task]


class AddTasksReply(Message):
    added: list[str]
    duplicates: list[str]


class GetTask(Message):
    task_id: str


class GetTaskReply(Message):
    task: Task | None


class SampleBatch(Message):
    size: int
    mix: dict[str, float] = msgspec.field(default_factory=dict)
    environment: str | None = None
    seed: int | None = None


class SampleBatchReply(Message):
    tasks: list[Task]


class AtomsFor(Message):
    """Active tasks that may be joined with ``task_id`` into one composed turn, at most
    ``limit``: one user turn with no conversation before it, in the same environment and
    configuration (for BFCL, the same API classes); their calls may still fail from the
    task's state, which composition checks by running them."""

    task_id: str
    limit: Annotated[int, msgspec.Meta(ge=1, le=200)] = 20


class TasksCalling(Message):
    """Active tasks of ``environment`` that are no one's child (synthesis depth 0: seed
    turns, or D0's tasks with no labels) and whose calls include one of ``functions``,
    at most ``limit``, none of ``exclude``: other parents for a failure of those
    functions."""

    functions: list[str]
    environment: str
    exclude: list[str] = msgspec.field(default_factory=list)
    limit: Annotated[int, msgspec.Meta(ge=1, le=200)] = 20


class GetStats(Message):
    pass


class PoolStats(Message):
    tasks_by_origin: dict[str, int]
    results: int
    rejected_candidates: int = 0
    accepted_candidates: int = 0


class LineageQuery(Message):
    task_id: str


class LineageReply(Message):
    task: Task | None
    chain: dict[str, Any] = msgspec.field(default_factory=dict)


class ListExperiences(Message):
    """The newest ``limit`` kept experiences (the distiller's), with their use counts."""

    limit: Annotated[int, msgspec.Meta(ge=1, le=10_000)] = 50


class ExperiencesReply(Message):
    experiences: list[Experience]
    # how many rollout jobs carried each, by experience id
    uses: dict[str, int] = msgspec.field(default_factory=dict)
    total: Count = 0


class ErrorReply(Message):
    error: str


PoolRequest = (
    AddTasks
    | GetTask
    | SampleBatch
    | AtomsFor
    | TasksCalling
    | GetStats
    | LineageQuery
    | ListExperiences
)
PoolReply = (
    AddTasksReply
    | GetTaskReply
    | SampleBatchReply
    | PoolStats
    | LineageReply
    | ExperiencesReply
    | ErrorReply
)

AnyMessage = (
    RolloutJob
    | Experience
    | RolloutGroup
    | RolloutResults
    | PolicyVersion
    | Signal
    | ExplorationRequest
    | Exploration
    | TaskCandidate
    | Verdict
    | TaskAdded
    | Heartbeat
    | Metric
    | DeadLetter
    | AddTasks
    | AddTasksReply
    | GetTask
    | GetTaskReply
    | SampleBatch
    | SampleBatchReply
    | AtomsFor
    | TasksCalling
    | GetStats
    | PoolStats
    | LineageQuery
    | LineageReply
    | ListExperiences
    | ExperiencesReply
    | ErrorReply
)


M = TypeVar("M", bound=Message)


class DecodeError(ValueError):
    """Bytes that are not a message of the expected type and schema."""


_encoder = msgspec.msgpack.Encoder()
_decoders: dict[object, msgspec.msgpack.Decoder[Any]] = {}


def encode(message: Message) -> bytes:
    return _encoder.encode(message)


def decode(data: bytes, kind: type[M]) -> M:
    """Decode ``data`` as ``kind`` (a message type or a tagged union of them).

    Raises DecodeError with a readable reason for anything else, including a message of
    a newer schema than this code understands.
    """
    name = getattr(kind, "__name__", None) or " | ".join(
        t.__name__ for t in getattr(kind, "__args__", ())
    )
    decoder = _decoders.get(kind)
    if decoder is None:
        decoder = _decoders[kind] = msgspec.msgpack.Decoder(kind)
    try:
        message: M = decoder.decode(data)
    except msgspec.DecodeError as exc:
        raise DecodeError(f"not a valid {name}: {_readable(str(exc))}") from exc
    if message.schema > SCHEMA_VERSION:
        raise DecodeError(f"{name} schema {message.schema} is newer than {SCHEMA_VERSION}")
    try:
        message.validate()
    except ValueError as exc:
        raise DecodeError(f"invalid {type(message).__name__}: {exc}") from exc
    return message


def _readable(reason: str) -> str:
    """msgspec's words for a broken ``Finite`` bound, as what they mean."""
    for bound in (f"`float` >= {-sys.float_info.max!r}", f"`float` <= {sys.float_info.max!r}"):
        reason = reason.replace(bound, "a finite `float`")
    return reason.replace("`float` >= 0.0", "a finite `float` >= 0")


def decode_any(data: bytes) -> Message:
    decoder = _decoders.get("any")
    if decoder is None:
        decoder = _decoders["any"] = msgspec.msgpack.Decoder(AnyMessage)
    try:
        message: Message = decoder.decode(data)
    except msgspec.DecodeError as exc:
        raise DecodeError(f"not a CoEvolve message: {exc}") from exc
    return message
