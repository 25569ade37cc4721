"""SFT warm start: teach the policy the tool-call format from tasks with ground truth.

The default model writes no well-formed tool call, so every GRPO group starts with equal
(zero) rewards and no gradient. One short supervised pass on the pool's tasks fixes that:
each task becomes the conversation an ideal agent would have had, in the format it acts
in (``coevolve.shared.demonstrations``: one call per assistant message, the call's real
result after it, a closing reply that ends the turn), and the loss is the cross-entropy
of the assistant tokens only. A task with a message longer than the rollout may generate
(``max_target_tokens``) is left out and counted: the policy could never produce it.

Observations come from replaying the ground truth in the real environment, exactly as the
rollout service would see them, so the model is trained on the prompts it will meet. When
no environment is available the conversation is built without them.

Why a small loop and not TRL's SFTTrainer: its assistant-only loss needs a chat template
with ``{% generation %}`` markers, which SmolLM2's lacks, so we would tokenize and mask
ourselves anyway (prompts are rendered by ``render_prompt_ids``, with the tools prompt the
rollout uses); the remaining work is a plain loop. SFTTrainer also pulls in ``datasets``
(whose pyarrow build does not import in this environment). The loop below computes logits
only at the supervised positions, which matters with a 49k vocabulary, and runs a prompt
shared by the examples of a micro-batch (the tools prompt) once.
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch
from torch import Tensor, nn
from tqdm import tqdm

from coevolve.services.learner.checkpoint import load_checkpoint, save_checkpoint
from coevolve.services.learner.config import DEFAULT_ACTIVATION_TOKENS
from coevolve.services.learner.grpo import SharedPrefix, shared_prompt_length
from coevolve.services.learner.memory import (
    activation_checkpointing,
    over_budget,
    padded_tokens,
)
from coevolve.shared.demonstrations import (
    IGNORE_INDEX,
    ReplayError,
    SftExample,
    conversation_without_observations,
    replayed_conversation,
    target_token_counts,
    tokenize_conversation,
)
from coevolve.shared.envs import Environment, make_environment
from coevolve.shared.messages import Task
from coevolve.shared.policy import LoadedPolicy
from coevolve.shared.policy.logprobs import sequence_logprobs

log = logging.getLogger(__name__)

EnvironmentFactory = Callable[[str], Environment]
Progress = Callable[[int, int, float], None]


@dataclass
class WarmStartReport:
    tasks: int
    examples: int
    skipped_tasks: int
    replayed: bool
    epochs: int
    steps: int
    supervised_tokens: int
    truncated_examples: int
    first_loss: float
    final_loss: float
    losses: list[float] = field(default_factory=list)
    duration_s: float = 0.0
    # tasks left out because one of their assistant messages is longer than the rollout
    # may generate (the policy could never produce it)
    over_budget_tasks: int = 0


def build_examples(
    policy: LoadedPolicy,
    tasks: Sequence[Task],
    *,
    replay: bool = True,
    env_factory: EnvironmentFactory | None = None,
    max_target_tokens: int | None = None,
) -> tuple[list[SftExample], int, int]:
    """(examples, tasks skipped, of which over ``max_target_tokens``): a task whose
    longest assistant message needs more tokens than that is skipped."""
    factory = env_factory or make_environment
    examples: list[SftExample] = []
    skipped = over_budget = 0
    for task in tasks:
        if not any(task.ground_truth):
            skipped += 1
            continue
        if replay:
            env = factory(task.environment)
            try:
                conversation = replayed_conversation(task, env)
            except ReplayError as exc:
                log.warning("warm start skips %s", exc)
                skipped += 1
                continue
            finally:
                env.close()
        else:
            conversation = conversation_without_observations(task)
        lengths = target_token_counts(policy.tokenizer, conversation)
        if max_target_tokens is not None and max(lengths, default=0) > max_target_tokens:
            log.info("warm start skips %s: a message of %d tokens", task.id, max(lengths))
            skipped += 1
            over_budget += 1
            continue
        examples.extend(tokenize_conversation(policy.tokenizer, conversation))
    return examples, skipped, over_budget


def truncate(example: SftExample, max_len: int) -> SftExample:
    return SftExample(example.task_id, example.input_ids[:max_len], example.labels[:max_len])


def collate(
    examples: Sequence[SftExample], pad_id: int, device: torch.device
) -> tuple[Tensor, ...]:
    """Right-padded ids, attention mask and the bool mask of supervised tokens."""
    length = max(len(e.input_ids) for e in examples)
    ids = torch.full((len(examples), length), pad_id, dtype=torch.long)
    attention = torch.zeros((len(examples), length), dtype=torch.long)
    supervised = torch.zeros((len(examples), length), dtype=torch.bool)
    for row, example in enumerate(examples):
        n = len(example.input_ids)
        ids[row, :n] = torch.tensor(example.input_ids)
        attention[row, :n] = 1
        supervised[row, :n] = torch.tensor([label != IGNORE_INDEX for label in example.labels])
    return ids.to(device), attention.to(device), supervised.to(device)


def supervised_mask(example: SftExample) -> list[int]:
    return [int(label != IGNORE_INDEX) for label in example.labels]


def prompt_key(example: SftExample) -> list[int]:
    """The tokens before the first supervised one: examples that share them batch well."""
    return example.input_ids[: supervised_mask(example).index(1)]


def accumulate_sft_gradients(
    model: nn.Module,
    examples: Sequence[SftExample],
    pad_id: int,
    device: torch.device,
    token_normalizer: float,
    min_shared_prompt: int = 16,
    activation_tokens: int | None = DEFAULT_ACTIVATION_TOKENS,
) -> float:
    """Backpropagate the summed assistant-token cross-entropy over ``token_normalizer``.

    When the examples share a prompt (same tools), it runs once through ``SharedPrefix``.
    Above ``activation_tokens`` tokens the examples run one at a time with activation
    checkpointing (see ``memory``). Returns this micro-batch's share of the loss.
    """
    shared = 0
    if len(examples) > 1:
        shared = shared_prompt_length(
            [e.input_ids for e in examples], [supervised_mask(e) for e in examples]
        )
    if shared < min_shared_prompt:
        shared = 0
    held = [shared, padded_tokens([len(e.input_ids) - shared for e in examples])]
    if over_budget(held, activation_tokens):
        total = 0.0
        with activation_checkpointing(model):
            for example in examples:
                total += _example_loss_backward(model, [example], pad_id, device, token_normalizer)
        return total
    if not shared:
        return _example_loss_backward(model, examples, pad_id, device, token_normalizer)
    prompt = SharedPrefix(
        model, torch.tensor(examples[0].input_ids[:shared], device=device), 1.0, requires_grad=True
    )
    tails = [SftExample(e.task_id, e.input_ids[shared:], e.labels[shared:]) for e in examples]
    ids, attention, supervised = collate(tails, pad_id, device)
    logprobs, _ = prompt.logprobs(ids, attention, supervised, with_entropy=False)
    loss = -(logprobs * supervised).sum() / token_normalizer
    loss.backward()
    prompt.backward()
    return loss.item()


def _example_loss_backward(
    model: nn.Module,
    examples: Sequence[SftExample],
    pad_id: int,
    device: torch.device,
    token_normalizer: float,
) -> float:
    ids, attention, supervised = collate(examples, pad_id, device)
    logprobs, _ = sequence_logprobs(
        model, ids, attention, 1.0, positions=supervised, with_entropy=False
    )
    loss = -(logprobs * supervised).sum() / token_normalizer
    loss.backward()
    return loss.item()


def sft_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: Sequence[SftExample],
    pad_id: int,
    device: torch.device,
    *,
    micro_batch_size: int,
    activation_tokens: int | None,
    max_grad_norm: float,
) -> float:
    """One optimizer step on ``batch`` (in micro-batches, gradients clipped); its loss."""
    normalizer = sum(e.supervised_tokens for e in batch)
    loss = 0.0
    # examples with the same prompt (tools) side by side share its forward pass
    batch = sorted(batch, key=prompt_key)
    for start in range(0, len(batch), micro_batch_size):
        micro = batch[start : start + micro_batch_size]
        loss += accumulate_sft_gradients(
            model, micro, pad_id, device, normalizer, activation_tokens=activation_tokens
        )
    trainable = [p for p in model.parameters() if p.requires_grad]
    torch.nn.utils.clip_grad_norm_(trainable, max_grad_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss


def warm_start(
    policy: LoadedPolicy,
    tasks: Sequence[Task],
    epochs: int = 2,
    lr: float = 2e-4,
    batch_size: int = 8,
    max_len: int = 4096,
    progress: bool | Progress = False,
    *,
    micro_batch_size: int = 2,
    activation_tokens: int | None = DEFAULT_ACTIVATION_TOKENS,
    max_grad_norm: float = 1.0,
    seed: int = 0,
    replay: bool = True,
    env_factory: EnvironmentFactory | None = None,
    checkpoint: Path | None = None,
    max_target_tokens: int | None = None,
    min_steps: int = 0,
) -> WarmStartReport:
    """Supervised fine-tuning of ``policy`` in place on ``tasks``' ground truth.

    ``progress``: True shows a progress bar; a callable gets ``(step, total_steps, loss)``.
    Sequences longer than ``max_len`` are cut (their later turns are not trained).
    Micro-batches over ``activation_tokens`` tokens trade compute for memory (``memory``).
    ``checkpoint``: after every optimizer step the adapter, the optimizer and the position
    (epoch, batch) are saved there; when the file exists the run resumes from it, so a
    killed warm start loses one step at most. Resuming needs the same ``tasks`` and ``seed``.
    ``max_target_tokens``: tasks with a longer assistant message are left out (the
    rollout's ``max_new_tokens``; the report counts them).
    ``min_steps``: more epochs than ``epochs`` where needed to make at least this many
    optimizer steps (a handful of tasks still teaches the tool-call format).
    """
    started = time.perf_counter()
    examples, skipped, over_budget = build_examples(
        policy, tasks, replay=replay, env_factory=env_factory, max_target_tokens=max_target_tokens
    )
    truncated = sum(1 for e in examples if len(e.input_ids) > max_len)
    examples = [truncate(e, max_len) for e in examples]
    examples = [e for e in examples if e.supervised_tokens > 0]

    model: nn.Module = policy.model
    trainable = [p for p in model.parameters() if p.requires_grad]
    if not trainable:
        raise ValueError("the policy has no trainable parameters (finetune='none'?)")
    optimizer = torch.optim.AdamW(trainable, lr=lr)
    tokenizer = policy.tokenizer
    pad_id = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0)
    device = torch.device(policy.device)
    steps_per_epoch = math.ceil(len(examples) / batch_size) if examples else 0
    if steps_per_epoch:
        epochs = max(epochs, math.ceil(min_steps / steps_per_epoch))
    total_steps = steps_per_epoch * epochs
    bar = tqdm(total=total_steps, desc="warm start", unit="step") if progress is True else None
    order = random.Random(seed)
    losses: list[float] = []
    resume_epoch = resume_batch = 0
    if checkpoint is not None and checkpoint.exists():
        position = load_checkpoint(checkpoint, model, optimizer).extra
        resume_epoch, resume_batch = int(position["epoch"]), int(position["batch"])
        losses = [float(x) for x in position["losses"]]
        log.info("warm start resumes at epoch %d, batch %d", resume_epoch + 1, resume_batch)
        if bar is not None:
            bar.update(len(losses))

    step = partial(
        sft_step,
        micro_batch_size=micro_batch_size,
        activation_tokens=activation_tokens,
        max_grad_norm=max_grad_norm,
    )
    was_training = model.training
    model.train()
    try:
        for epoch in range(epochs):
            shuffled = list(examples)
            order.shuffle(shuffled)  # every epoch's order is drawn, so a resume sees the same
            if epoch < resume_epoch:
                continue
            first = resume_batch * batch_size if epoch == resume_epoch else 0
            for start in range(first, len(shuffled), batch_size):
                batch = shuffled[start : start + batch_size]
                step_loss = step(model, optimizer, batch, pad_id, device)
                losses.append(step_loss)
                if checkpoint is not None:
                    done = start // batch_size + 1
                    at = {"epoch": epoch, "batch": done, "losses": losses}
                    save_checkpoint(checkpoint, model, optimizer, len(losses), 0, extra=at)
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(loss=f"{step_loss:.3f}")
                elif callable(progress):
                    progress(len(losses), total_steps, step_loss)
    finally:
        model.train(was_training)
        if bar is not None:
            bar.close()

    last_epoch = losses[-steps_per_epoch:] if steps_per_epoch else []
    return WarmStartReport(
        tasks=len(tasks),
        examples=len(examples),
        skipped_tasks=skipped,
        replayed=replay,
        epochs=epochs,
        steps=len(losses),
        supervised_tokens=sum(e.supervised_tokens for e in examples),
        truncated_examples=truncated,
        first_loss=losses[0] if losses else 0.0,
        final_loss=sum(last_epoch) / len(last_epoch) if last_epoch else 0.0,
        losses=losses,
        duration_s=time.perf_counter() - started,
        over_budget_tasks=over_budget,
    )
