"""The explorer's work without the bus: a signal (or an exploration request) in, the
exploration to publish out.

The explorer service publishes what :func:`explore_signal` and :func:`explore_request`
return; the lockstep schedule hands it to the abstractor's handler itself.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Literal

import anyio
from opentelemetry.trace import NoOpTracer, Tracer

from coevolve.services.explorer.composition import (
    Atom,
    atom_of,
    composed_rounds,
    orders,
    previous_turn,
)
from coevolve.services.explorer.config import ExplorerConfig
from coevolve.services.explorer.exploration import ExplorationSetup, ExplorationStats, explore
from coevolve.services.explorer.prompts import (
    CONTEXT_SCHEMA,
    GOAL_TEMPLATES,
    aimed_goal,
    describe_signal,
    exploration_goal,
    render_task,
    summarizer_messages,
    unguided_goal,
)
from coevolve.services.explorer.state_variation import state_variation_rounds
from coevolve.services.explorer.substitution import substitution_rounds
from coevolve.shared.envs import Environment, make_environment, state_of
from coevolve.shared.failures import failed_calls, target_functions
from coevolve.shared.llm import RoleLLM
from coevolve.shared.messages import (
    Exploration,
    ExplorationContext,
    ExplorationMode,
    ExplorationRequest,
    ExplorationRound,
    FailedCall,
    Signal,
    Task,
    derived_id,
)
from coevolve.shared.structured import Rejection, RejectionCounter, ask_structured

log = logging.getLogger(__name__)

# explored: an exploration to publish; empty: no usable action; dropped_without_context:
# the summary was unusable and ``on_context_rejection`` is ``drop``; nothing_failed: the
# trajectory got no ground-truth call wrong (``require_failure``); too_deep: the task is
# more synthesis generations from a seed task than ``max_parent_depth`` (and not
# repaired from seed turns: ``repair_children_from_seeds``);
# nothing_to_substitute: the parent turn gives no substitution and
# ``explore_without_substitution`` is off; recently_varied: the turn's children were made
# for a signal at most ``parent_cooldown_versions`` policy versions older
ExploreOutcome = Literal[
    "explored",
    "empty",
    "dropped_without_context",
    "nothing_failed",
    "too_deep",
    "nothing_to_substitute",
    "recently_varied",
]


@dataclass
class ExplorerDeps:
    """What exploring needs besides the message."""

    summarizer: RoleLLM
    explorer: RoleLLM
    config: ExplorerConfig
    summaries: RejectionCounter  # unusable summaries, by kind
    actions: RejectionCounter  # unusable actions, by kind
    tracer: Tracer = field(default_factory=NoOpTracer)
    # whether the run has labels (``settings.labels``): without, substitution takes no
    # value the environment knows only from them
    labelled: bool = True
    # the pool's tasks that may be joined with a task (``AtomsFor``), the atoms of a
    # composed turn; None: composition joins only the turn before
    atoms: Callable[[Task], Awaitable[list[Task]]] | None = None
    # the pool's unsynthesized tasks, other than the given one, that call one of the given
    # functions (``TasksCalling``): other parents for a signal's failure; None: the
    # signal's own turn alone
    siblings: Callable[[Task, list[str]], Awaitable[list[Task]]] | None = None
    # task id -> the policy version of the last signal whose turn was varied, kept from
    # one signal to the next (``parent_cooldown_versions``)
    varied_at: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Explored:
    exploration: Exploration | None  # None: nothing to publish (see ``outcome``)
    outcome: ExploreOutcome
    stats: ExplorationStats
    summary_rejection: Rejection | None = None  # the summarizer's unusable output
    # composed turns (``composition.py``): their own exploration, as they may start from
    # another state than the signal's task (the turn before it)
    composed: Exploration | None = None
    # state variants (``state_variation.py``): each starts from its own state
    on_states: tuple[Exploration, ...] = ()
    # what other parents of the same signal gave (``sibling_parents``)
    siblings: tuple[Exploration, ...] = ()

    @property
    def explorations(self) -> list[Exploration]:
        own = [e for e in (self.exploration, self.composed) if e is not None]
        return own + list(self.on_states) + list(self.siblings)


async def composed_rounds_for(
    task: Task, seed: str, variants: list[ExplorationRound], deps: ExplorerDeps
) -> tuple[Task, list[ExplorationRound]] | None:
    """(start, rounds): up to ``composition_rounds`` turns joining ``task``'s turn (or a
    variant of it whose request code made) with the turn before it, or else with tasks of
    the pool in its setting (``deps.atoms``), shuffled by ``seed``; None when none
    replays."""
    limit = deps.config.composition_limit(deps.labelled)
    parent = atom_of(task)
    if limit <= 0 or parent is None:
        return None
    failed_atoms = [parent] + [
        Atom(parent.task_id, r.request, tuple(step.action for step in r.steps))
        for r in variants
        if r.request is not None
    ]
    earlier = previous_turn(task)
    if earlier is not None:
        start, first = earlier
        pairs: Iterator[tuple[Atom, ...]] = iter([(first, atom) for atom in failed_atoms])
    elif deps.atoms is not None:
        start = task
        found = await deps.atoms(task)
        others = [
            atom
            for other in found
            if other.id != task.id
            and other.lineage.parent_task_id != task.id
            and (atom := atom_of(other)) is not None
        ]
        random.Random(seed).shuffle(others)
        pairs = orders(failed_atoms, others)
    else:
        return None
    make_env = partial(make_environment, task.environment)
    rounds = await anyio.to_thread.run_sync(partial(composed_rounds, start, pairs, make_env, limit))
    return (start, rounds) if rounds else None


async def synthesized(
    task: Task,
    seed: str,
    deps: ExplorerDeps,
    *,
    signal: Signal | None,
    failed: list[FailedCall],
) -> Explored:
    """The synthesis machinery on ``task``: up to ``substitution_rounds`` variants, up to
    ``composition_rounds`` composed turns and up to ``state_variation_rounds`` state
    variants, as guided explorations of ``signal`` (aimed at ``failed``) or, without a
    signal, unguided ones (the control that the same machinery aimed at nothing gives).
    No LLM is asked."""
    config = deps.config
    make_env = partial(make_environment, task.environment)
    substituted: list[ExplorationRound] = []
    if config.substitution_rounds > 0:
        with deps.tracer.start_as_current_span("explorer substitute"):
            substitute = partial(substitution_rounds, known_values=deps.labelled)
            substituted = await anyio.to_thread.run_sync(
                partial(substitute, task, make_env, config.substitution_rounds, seed=seed)
            )
    with deps.tracer.start_as_current_span("explorer compose"):
        composed = await composed_rounds_for(task, seed, substituted, deps)
    with deps.tracer.start_as_current_span("explorer vary state"):
        limit = config.state_variation_rounds
        varied = await anyio.to_thread.run_sync(
            partial(state_variation_rounds, task, make_env, limit, seed=seed)
        )
    mode: ExplorationMode = "guided" if signal is not None else "unguided"

    def published(
        suffix: tuple[str, ...], start: Task, rounds: list[ExplorationRound]
    ) -> Exploration:
        exploration_id = derived_id("exploration", seed, *suffix)
        return exploration_message(
            exploration_id, mode, start, rounds, context=None, signal=signal, failed=failed
        )

    substitution = published((), task, substituted) if substituted else None
    composition = published(("composed",), *composed) if composed else None
    on_states = tuple(
        published(("state", str(index)), start, rounds)
        for index, (start, rounds) in enumerate(varied)
    )
    made = [e for e in (substitution, composition, *on_states) if e is not None]
    stats = ExplorationStats(steps=sum(len(r.steps) for e in made for r in e.rounds))
    outcome: ExploreOutcome = "explored" if made else "nothing_to_substitute"
    return Explored(substitution, outcome, stats, composed=composition, on_states=on_states)


def recently_varied(task_id: str, policy_version: int, deps: ExplorerDeps) -> bool:
    """Whether the turn was varied for a signal of a policy at most
    ``parent_cooldown_versions`` versions older than ``policy_version``."""
    cooldown = deps.config.parent_cooldown_versions
    last = deps.varied_at.get(task_id)
    return cooldown > 0 and last is not None and last <= policy_version <= last + cooldown


async def sibling_parents(
    signal: Signal, failed: list[FailedCall], deps: ExplorerDeps
) -> list[Task]:
    """Up to ``sibling_parents`` of the pool's unsynthesized turns other than the signal's
    that call a function its trajectory got wrong and were not varied recently, in an
    order seeded by the signal: the failure repaired from more than one parent."""
    limit = deps.config.sibling_parents
    if limit <= 0 or deps.siblings is None:
        return []
    found = await deps.siblings(signal.task, target_functions(failed))
    fresh = [
        task
        for task in found
        if task.id != signal.task.id and not recently_varied(task.id, signal.policy_version, deps)
    ]
    random.Random(signal.id).shuffle(fresh)
    return fresh[:limit]


async def vary_for_signal(
    signal: Signal, failed: list[FailedCall], deps: ExplorerDeps, *, own_turn: bool = True
) -> Explored:
    """``synthesized`` on the signal's turn (unless varied recently, or not ``own_turn``)
    and on its sibling parents, as one result; ``recently_varied`` when no parent is left
    to vary."""
    resting = not own_turn or recently_varied(signal.task.id, signal.policy_version, deps)
    own = [] if resting else [signal.task]
    parents = own + await sibling_parents(signal, failed, deps)
    if not parents:
        return Explored(None, "recently_varied", ExplorationStats())
    made: list[Explored] = []
    for parent in parents:
        seed = signal.id if parent is signal.task else derived_id("sibling", signal.id, parent.id)
        explored = await synthesized(parent, seed, deps, signal=signal, failed=failed)
        if explored.explorations:
            deps.varied_at[parent.id] = signal.policy_version
            made.append(explored)
    if not made:
        return Explored(None, "nothing_to_substitute", ExplorationStats())
    first, others = made[0], made[1:]
    steps = sum(explored.stats.steps for explored in made)
    return Explored(
        first.exploration,
        "explored",
        ExplorationStats(steps=steps),
        composed=first.composed,
        on_states=first.on_states,
        siblings=tuple(e for explored in others for e in explored.explorations),
    )


async def explore_signal(signal: Signal, deps: ExplorerDeps) -> Explored:
    """The summarizer's context for ``signal`` (for an aimed signal only with
    ``summarize_aimed``), then ``rounds`` guided rounds from its task, aimed at what its
    trajectory got wrong (``shared/failures.py``).

    A signal whose trajectory got no ground-truth call wrong (with ``require_failure``),
    or whose task is too many generations from a seed task, is not explored. Without a
    usable summary the signal's own description steers the rounds (or, with
    ``on_context_rejection: drop``, nothing is explored). Raises only ``LLMUnavailable``.
    """
    config = deps.config
    if signal.task.lineage.depth > config.max_parent_depth:
        return await repair_from_seeds(signal, deps)
    failed = failed_calls(signal.task, signal.trajectory)
    if config.require_failure and not failed:
        return Explored(None, "nothing_failed", ExplorationStats())
    exploration_id = derived_id("exploration", signal.id)
    composition = config.composition_limit(deps.labelled)
    synthesis = config.substitution_rounds + composition + config.state_variation_rounds
    if failed and synthesis > 0:
        made = await vary_for_signal(signal, failed, deps)
        if made.explorations or made.outcome == "recently_varied":
            return made
        if config.substitution_rounds > 0 and not config.explore_without_substitution:
            return made
    summary: ExplorationContext | Rejection | None = None
    if not failed or config.summarize_aimed:
        with deps.tracer.start_as_current_span(
            "explorer summarize", attributes={"coevolve.detail": signal.kind}
        ):
            summary = await summarize_signal(
                deps.summarizer, signal, config.summary_max_tokens, deps.summaries, failed
            )
    if summary is None:
        context, rejection = None, None
    elif isinstance(summary, Rejection):
        if config.on_context_rejection == "drop":
            return Explored(None, "dropped_without_context", ExplorationStats(), summary)
        context, rejection = None, summary
    else:
        context, rejection = summary, None
    if failed:
        state = await anyio.to_thread.run_sync(start_state, signal.task)
        goal = aimed_goal(signal, failed, state, context)
    else:
        goal = guided_goal(signal, context)
    explored = await explore_task(
        deps,
        exploration_id=exploration_id,
        mode="guided",
        task=signal.task,
        goal=goal,
        rounds=config.rounds,
        context=context,
        signal=signal,
        failed=failed,
    )
    return Explored(explored.exploration, explored.outcome, explored.stats, rejection)


def repairs_children(deps: ExplorerDeps) -> bool:
    """Whether a too-deep signal is repaired from seed turns (``repair_children_from_seeds``)."""
    setting = deps.config.repair_children_from_seeds
    return not deps.labelled if setting is None else setting


async def repair_from_seeds(signal: Signal, deps: ExplorerDeps) -> Explored:
    """For a signal on a task too many generations from a seed: the seed turns that call a
    function its trajectory got wrong, varied as sibling parents; ``too_deep`` where
    repairing children is off, there are no sibling parents, or nothing failed."""
    if not repairs_children(deps) or deps.config.sibling_parents <= 0:
        return Explored(None, "too_deep", ExplorationStats())
    failed = failed_calls(signal.task, signal.trajectory)
    if not failed:
        return Explored(None, "too_deep", ExplorationStats())
    return await vary_for_signal(signal, failed, deps, own_turn=False)


def start_state(task: Task) -> dict[str, Any] | None:
    """The state ``task`` starts in (its environment's ``state()``; None without one).
    Blocking (run it in a worker thread)."""
    environment = make_environment(task.environment)
    try:
        environment.reset(task)
        return state_of(environment)
    finally:
        environment.close()


async def explore_request(request: ExplorationRequest, deps: ExplorerDeps) -> Explored:
    """Unguided rounds (``request.rounds``, capped at ``max_request_rounds``) from the
    request's task; with ``request.vary``, the synthesis machinery on it instead, aimed at
    nothing (``synthesized``). Raises only ``LLMUnavailable``."""
    if request.vary:
        return await synthesized(request.task, request.id, deps, signal=None, failed=[])
    return await explore_task(
        deps,
        exploration_id=derived_id("exploration", request.id),
        mode="unguided",
        task=request.task,
        goal=unguided_goal(request.task, request.covered),
        rounds=max(1, min(request.rounds, deps.config.max_request_rounds)),
        context=None,
        signal=None,
    )


async def explore_task(
    deps: ExplorerDeps,
    *,
    exploration_id: str,
    mode: ExplorationMode,
    task: Task,
    goal: str,
    rounds: int,
    context: ExplorationContext | None,
    signal: Signal | None,
    failed: list[FailedCall] | None = None,
) -> Explored:
    """``rounds`` rounds towards ``goal``, each in a fresh environment in the task's state;
    with ``failed``, each round's first call is one of their functions."""
    environment = task.environment

    def make_env() -> Environment:
        return make_environment(environment)

    with deps.tracer.start_as_current_span(
        "explorer explore", attributes={"coevolve.detail": mode}
    ):
        setup = ExplorationSetup(
            deps.explorer,
            make_env,
            task,
            goal,
            deps.config,
            deps.actions,
            first_functions=target_functions(failed or []),
            avoid=[call.expected for call in failed or []],
        )
        done, stats = await explore(setup, rounds)
    if stats.steps == 0:
        log.warning("exploration %s: no usable action in %d rounds", exploration_id, rounds)
        return Explored(None, "empty", stats)
    exploration = exploration_message(
        exploration_id, mode, task, done, context=context, signal=signal, failed=failed
    )
    return Explored(exploration, "explored", stats)


async def summarize_signal(
    llm: RoleLLM,
    signal: Signal,
    max_tokens: int,
    counter: RejectionCounter,
    failed: list[FailedCall] | None = None,
) -> ExplorationContext | Rejection:
    """The summarizer role's :class:`ExplorationContext` for ``signal`` (told what its
    trajectory got wrong, ``failed``), or why it is unusable (counted in ``counter``).
    Raises only ``LLMUnavailable``."""
    return await ask_structured(
        llm,
        summarizer_messages(signal, failed or []),
        ExplorationContext,
        schema=CONTEXT_SCHEMA,
        max_tokens=max_tokens,
        temperature=llm.settings.temperature,
        counter=counter,
    )


def guided_goal(signal: Signal, context: ExplorationContext | None) -> str:
    """The exploration goal for ``signal``: its kind's goal with the summarized context, or
    with the signal's own description when there is no usable summary."""
    if context is not None:
        return exploration_goal(signal.kind, context, signal.task)
    return signal_goal(signal)


def exploration_message(
    exploration_id: str,
    mode: ExplorationMode,
    task: Task,
    rounds: list[ExplorationRound],
    *,
    context: ExplorationContext | None,
    signal: Signal | None,
    failed: list[FailedCall] | None = None,
) -> Exploration:
    """The exploration as published: its rounds plus the signal (if any) that steered it
    and what the signal's trajectory got wrong."""
    return Exploration(
        id=exploration_id,
        mode=mode,
        task=task,
        rounds=rounds,
        context=context,
        signal_id=signal.id if signal else None,
        signal_kind=signal.kind if signal else None,
        signal_evidence=dict(signal.evidence) if signal else {},
        failed_calls=list(failed or []),
        signal_version=signal.policy_version if signal else None,
    )


def signal_goal(signal: Signal) -> str:
    """The signal kind's goal when no summary is available: the signal's own words (its
    kind and evidence) stand in for the context."""
    goal = GOAL_TEMPLATES[signal.kind].format(context=describe_signal(signal.kind, signal.evidence))
    return (
        f"{goal}\n\nThe environment starts in the state of this task:\n{render_task(signal.task)}"
    )
