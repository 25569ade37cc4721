"""Run the policy in environments: K episodes of one task, generated together in batches.

Token bookkeeping. ``Trajectory.token_ids`` is exactly the context every generation was
conditioned on, followed by what was sampled, so the learner can recompute log-probs
without re-tokenizing anything:

- the first prompt is the chat template's rendering of the first messages with the tools;
- each generation appends its sampled ids verbatim (``loss_mask`` 1, behaviour log-probs);
- the observations that follow are appended as the template renders them: the
  conversation is rendered as text before (prompt text + the sampled text, stop token
  included) and after adding the assistant message and the observations; the new tail is
  the text difference, tokenized on its own (``loss_mask`` 0, log-prob 0.0). It also
  closes the assistant turn (``\\n`` after ``<|im_end|>``, or the end token itself when
  generation stopped at ``max_new_tokens``) and opens the next assistant turn;
- when the "before" text is not a prefix of the "after" text (a template that rewrites
  earlier turns, e.g. strips reasoning, or tools that changed mid-episode), the earlier
  tokens are NOT re-rendered: they are what the model saw and what its log-probs belong
  to. Instead the new messages are rendered after a fixed anchor conversation (one user
  and this assistant message) and that tail is appended.

A navigated episode (``Navigation``, see ``shared/experience/guidance.py``) is sampled
with advice in its first prompt; when it ends, its first prompt's tokens and messages are
swapped for the plain rendering's, so the trajectory holds no advice, while its behaviour
log-probs stay those the advice shaped (the learner corrects for that).

After the last step nothing more is appended: the sequence ends with the last sampled
token. ``finished`` is True only when the environment itself ended the episode; an
episode cut by ``max_steps`` has ``finished=False`` and no error (its score still counts).
``Trajectory.error`` says why an episode was stopped otherwise: the context is full, the
environment raised, or the template cannot render the observations.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from coevolve.shared.envs.protocol import Environment
from coevolve.shared.envs.rendering import configured_tool_rendering
from coevolve.shared.experience.guidance import with_guidance
from coevolve.shared.messages import ChatMessage, Task, Timings, Trajectory, derived_id, new_id
from coevolve.shared.policy.chat import decode_ids, encode_text, render_text
from coevolve.shared.policy.engine import Engine, Generation, SamplingParams
from coevolve.shared.toolcalls import parse_tool_calls

EnvFactory = Callable[[], Environment]
# (step number, episodes generated for in that step, seconds the step's generation took)
StepCallback = Callable[[int, int, float], None]

_ANCHOR_USER = ChatMessage(role="user", content="(anchor)")
_MARKER = "\u2063coevolve-assistant-text\u2063"


class RenderError(RuntimeError):
    """The chat template cannot render new messages after an assistant turn."""


@dataclass(frozen=True)
class Navigation:
    """Advice for one episode's prompt (``guidance_text``) and the experiences it holds."""

    text: str
    experience_ids: list[str]


@dataclass
class _PlainPrompt:
    """A navigated episode's first prompt as it renders without the advice."""

    messages: list[ChatMessage]
    token_ids: list[int]
    guided_messages: int  # how many of the episode's first messages the guided prompt has
    guided_tokens: int
    experience_ids: list[str]


@dataclass
class _Episode:
    index: int
    task: Task
    env: Environment
    messages: list[ChatMessage]
    tools: list[dict[str, Any]]
    text: str  # rendering of ``messages`` (with the assistant prompt) that token_ids hold
    token_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    started: float
    entropies: list[float] = field(default_factory=list)
    actions: list[str] = field(default_factory=list)
    steps: int = 0
    done: bool = False
    finished: bool = False
    error: str | None = None
    generate_s: float = 0.0
    environment_s: float = 0.0
    total_s: float = 0.0
    rerendered: int = 0
    plain: _PlainPrompt | None = None  # navigated episodes only


def run_group(
    engine: Engine,
    env_factory: EnvFactory,
    task: Task,
    group_size: int,
    params: SamplingParams,
    max_steps: int = 12,
    *,
    id_prefix: str | None = None,
    partial_credit: float = 0.0,
    navigation: list[Navigation | None] | None = None,
) -> list[Trajectory]:
    """``group_size`` episodes of ``task``, each in its own fresh environment.

    All still-running episodes generate together in one batched call per step.
    ``max_steps`` bounds the assistant messages per episode. With ``id_prefix`` the
    trajectory ids are derived from it (a redelivered job yields the same ids).
    ``partial_credit``: see ``run_groups``. ``navigation[i]``: advice for episode i's
    prompt (None: none).
    """
    return run_groups(
        engine,
        env_factory,
        [task],
        group_size,
        params,
        max_steps,
        id_prefixes=[id_prefix],
        partial_credit=partial_credit,
        navigation=[navigation] if navigation is not None else None,
    )[0]


def run_groups(
    engine: Engine,
    env_factory: EnvFactory,
    tasks: list[Task],
    group_size: int,
    params: SamplingParams,
    max_steps: int = 12,
    *,
    id_prefixes: list[str | None] | None = None,
    on_step: StepCallback | None = None,
    partial_credit: float = 0.0,
    navigation: list[list[Navigation | None]] | None = None,
) -> list[list[Trajectory]]:
    """Several groups at once (one per task), all episodes batched together.

    A trajectory's reward is the environment's score; with ``partial_credit`` w > 0 an
    unsolved episode earns w times the environment's partial credit instead of 0 (keep
    w below the signal threshold, so a reward above it still means solved).

    Per trajectory, ``timings.generate_s`` is the wall time of the batched generation
    calls it took part in, ``environment_s`` its reset, steps and scoring, ``total_s``
    from its start to its end. ``on_step(step, running, seconds)`` is called after each
    batched generation (progress for long episodes). ``navigation[g][i]``: advice for
    episode i of group g (None: none).
    """
    if group_size < 1:
        raise ValueError("group_size must be at least 1")
    prefixes = id_prefixes or [None] * len(tasks)
    if len(prefixes) != len(tasks):
        raise ValueError(f"{len(prefixes)} id prefixes for {len(tasks)} tasks")
    advice = navigation or [[None] * group_size for _ in tasks]
    if len(advice) != len(tasks) or any(len(row) != group_size for row in advice):
        raise ValueError(f"navigation must give {group_size} entries for each of {len(tasks)}")
    policy_version = engine.policy_version
    groups: list[list[_Episode]] = []
    try:
        for task, row in zip(tasks, advice, strict=True):
            groups.append([_start(engine, env_factory, task, i, row[i]) for i in range(group_size)])
        episodes = [episode for group in groups for episode in group]
        _run_until_done(engine, episodes, params, max_steps, on_step)
        return [
            [_finish(episode, policy_version, prefix, params, partial_credit) for episode in group]
            for group, prefix in zip(groups, prefixes, strict=True)
        ]
    finally:
        for group in groups:
            for episode in group:
                _close(episode)


def _start(
    engine: Engine,
    env_factory: EnvFactory,
    task: Task,
    index: int,
    navigation: Navigation | None = None,
) -> _Episode:
    started = time.perf_counter()
    env = env_factory()
    messages = list(env.reset(task))
    tools = env.tools()
    plain: _PlainPrompt | None = None
    if navigation is not None:
        plain_ids = encode_text(engine.tokenizer, render_text(engine.tokenizer, messages, tools))
        guided = with_guidance(messages, navigation.text)
        plain = _PlainPrompt(messages, plain_ids, len(guided), 0, navigation.experience_ids)
        messages = guided
    text = render_text(engine.tokenizer, messages, tools)
    ids = encode_text(engine.tokenizer, text)
    if plain is not None:
        plain.guided_tokens = len(ids)
    episode = _Episode(
        index=index,
        task=task,
        env=env,
        messages=messages,
        tools=tools,
        text=text,
        token_ids=ids,
        loss_mask=[0] * len(ids),
        logprobs=[0.0] * len(ids),
        started=started,
        plain=plain,
    )
    episode.environment_s = time.perf_counter() - started
    return episode


def _run_until_done(
    engine: Engine,
    episodes: list[_Episode],
    params: SamplingParams,
    max_steps: int,
    on_step: StepCallback | None = None,
) -> None:
    for step in range(max_steps):
        running = [e for e in episodes if not e.done]
        for episode in running:
            if len(episode.token_ids) + params.max_new_tokens > engine.max_context:
                _end(episode, error=f"context full ({len(episode.token_ids)} tokens)")
        running = [e for e in running if not e.done]
        if not running:
            return
        step_params = params
        if params.seed is not None:
            step_params = dataclasses.replace(params, seed=params.seed + step)
        started = time.perf_counter()
        generations = engine.generate([e.token_ids for e in running], step_params)
        elapsed = time.perf_counter() - started
        for episode, generation in zip(running, generations, strict=True):
            episode.generate_s += elapsed
            _apply(engine, episode, generation)
        if on_step is not None:
            on_step(step + 1, len(running), elapsed)
    for episode in episodes:
        if not episode.done:
            _end(episode, error=None)


def _apply(engine: Engine, episode: _Episode, generation: Generation) -> None:
    """Record one generation, let the environment act on it, append the observations."""
    episode.steps += 1
    episode.token_ids.extend(generation.completion_ids)
    episode.loss_mask.extend([1] * len(generation.completion_ids))
    episode.logprobs.extend(generation.logprobs)
    if generation.entropies:
        episode.entropies.append(sum(generation.entropies) / len(generation.entropies))
    parsed = parse_tool_calls(generation.text)
    assistant = ChatMessage(role="assistant", content=generation.text, tool_calls=parsed.calls)
    episode.messages.append(assistant)

    started = time.perf_counter()
    try:
        result = episode.env.step(generation.text)
        tools = episode.env.tools() if not result.done else episode.tools
    except Exception as exc:  # an environment bug ends this episode, not the group
        episode.environment_s += time.perf_counter() - started
        _end(episode, error=f"environment error: {type(exc).__name__}: {exc}")
        return
    episode.environment_s += time.perf_counter() - started
    called = result.info.get("calls")
    episode.actions.extend(called if isinstance(called, list) else [c.name for c in parsed.calls])
    episode.messages.extend(result.observations)
    if result.done:
        _end(episode, error=None, finished=True)
        return
    try:
        _append_observations(engine, episode, generation, assistant, result.observations, tools)
    except RenderError as exc:
        _end(episode, error=str(exc))


def _append_observations(
    engine: Engine,
    episode: _Episode,
    generation: Generation,
    assistant: ChatMessage,
    observations: list[ChatMessage],
    tools: list[dict[str, Any]],
) -> None:
    tokenizer = engine.tokenizer
    sampled_text = decode_ids(tokenizer, generation.completion_ids)
    before = episode.text + sampled_text
    after = render_text(tokenizer, episode.messages, tools)
    if after.startswith(before):
        tail = after[len(before) :]
    else:
        episode.rerendered += 1
        tail = _anchored_tail(engine, assistant, sampled_text, observations, tools)
    episode.tools = tools
    episode.text = after
    tail_ids = encode_text(tokenizer, tail)
    episode.token_ids.extend(tail_ids)
    episode.loss_mask.extend([0] * len(tail_ids))
    episode.logprobs.extend([0.0] * len(tail_ids))


def _anchored_tail(
    engine: Engine,
    assistant: ChatMessage,
    sampled_text: str,
    observations: list[ChatMessage],
    tools: list[dict[str, Any]],
) -> str:
    """The text that follows ``sampled_text`` when the observations are rendered after it.

    Rendered after a fixed one-turn anchor conversation instead of the real history
    (which the template does not reproduce verbatim): the assistant message there holds
    a marker, and everything the template writes after the marker is the tail.
    """
    extended = render_text(
        engine.tokenizer,
        [_ANCHOR_USER, ChatMessage(role="assistant", content=_MARKER), *observations],
        tools,
    )
    at = extended.find(_MARKER)
    if at < 0:
        raise RenderError(
            "the chat template drops the assistant's text; cannot continue the episode "
            "with tokens consistent with what the policy saw"
        )
    tail = extended[at + len(_MARKER) :]
    # The sampled text may already hold the start of the closing (its stop token).
    content = assistant.content
    sampled_end = sampled_text[len(content) :] if sampled_text.startswith(content) else ""
    if sampled_end and tail.startswith(sampled_end):
        tail = tail[len(sampled_end) :]
    return tail


def _end(episode: _Episode, *, error: str | None, finished: bool = False) -> None:
    episode.done = True
    episode.finished = finished
    episode.error = error
    episode.total_s = time.perf_counter() - episode.started


def _finish(
    episode: _Episode,
    policy_version: int,
    id_prefix: str | None,
    params: SamplingParams,
    partial_credit: float = 0.0,
) -> Trajectory:
    started = time.perf_counter()
    try:
        reward = float(episode.env.score())
        if reward < 1.0 and partial_credit > 0.0:
            reward = partial_credit * float(episode.env.partial_credit())
    except Exception as exc:
        reward = 0.0
        failure = f"scoring error: {type(exc).__name__}: {exc}"
        episode.error = f"{episode.error}; {failure}" if episode.error else failure
    episode.environment_s += time.perf_counter() - started
    messages, token_ids = episode.messages, episode.token_ids
    logprobs, loss_mask = episode.logprobs, episode.loss_mask
    if (plain := episode.plain) is not None:  # the advice leaves the training sample
        prompt = len(plain.token_ids)
        messages = [*plain.messages, *messages[plain.guided_messages :]]
        token_ids = [*plain.token_ids, *token_ids[plain.guided_tokens :]]
        logprobs = [0.0] * prompt + logprobs[plain.guided_tokens :]
        loss_mask = [0] * prompt + loss_mask[plain.guided_tokens :]
    return Trajectory(
        id=derived_id(id_prefix, episode.task.id, episode.index) if id_prefix else new_id(),
        task_id=episode.task.id,
        messages=messages,
        token_ids=token_ids,
        logprobs=logprobs,
        loss_mask=loss_mask,
        reward=reward,
        policy_version=policy_version,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=getattr(params, "top_k", None),  # engines without top-k do not truncate by it
        timings=Timings(
            generate_s=episode.generate_s,
            environment_s=episode.environment_s,
            total_s=episode.total_s or time.perf_counter() - episode.started,
        ),
        actions=episode.actions,
        entropies=episode.entropies,
        finished=episode.finished,
        error=episode.error,
        tool_rendering=configured_tool_rendering(),  # what render_text used
        experience_ids=list(plain.experience_ids) if plain is not None else [],
    )


def _close(episode: _Episode) -> None:
    with contextlib.suppress(Exception):  # closing must never mask the real outcome
        episode.env.close()


__all__ = [
    "EnvFactory",
    "Navigation",
    "RenderError",
    "StepCallback",
    "run_group",
    "run_groups",
]
