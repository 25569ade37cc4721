"""The preference objectives' loss: TRL's DPO loss on the same pairs, and no loss on any
token that is not the agent's own (prompt, user turns, tool results)."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from coevolve.services.learner.config import LearnerConfig, PreferenceConfig, WarmStartConfig
from coevolve.services.learner.dpo import dpo_loss, summed_logprobs
from coevolve.services.learner.preference import (
    accumulate_pair,
    pad_sides,
    pair_layout,
    pair_logprobs,
)
from coevolve.services.learner.preference_pairs import (
    EXPERT,
    PairSide,
    PreferencePair,
    expert_sides,
)
from coevolve.services.learner.sft import supervised_mask
from coevolve.services.learner.trainer import GrpoLearner
from coevolve.shared.demonstrations import (
    Conversation,
    replayed_conversation,
    tokenize_conversation,
)
from coevolve.shared.envs import make_environment
from coevolve.shared.envs.bfcl.tasks import seed_tasks
from coevolve.shared.messages import ChatMessage, ToolCall
from coevolve.shared.policy import LoadedPolicy
from coevolve.shared.toolcalls import format_tool_calls

BETA = 0.1
SFT_COEF = 0.7


def side(policy: LoadedPolicy, parts: list[tuple[str, int]], reward: float, name: str) -> PairSide:
    """A sequence of text parts, each tokenized alone, with its mask bit (1: the agent's)."""
    ids: list[int] = []
    mask: list[int] = []
    for text, agent in parts:
        tokens = policy.tokenizer(text, add_special_tokens=False)["input_ids"]
        ids += tokens
        mask += [agent] * len(tokens)
    return PairSide(ids, mask, reward, name)


def fixed_pairs(policy: LoadedPolicy) -> list[PreferencePair]:
    """Expert-vs-failure pairs whose agent turns enclose a tool result (mask 0)."""
    prompt = ("User: list the files, then open the first.\nAssistant:", 0)
    result = ("\nTool: notes.txt report.pdf\nAssistant:", 0)
    chosen = [prompt, (" ls()", 1), result, (" cat('notes.txt') Done.", 1)]
    rejected = [
        [prompt, (" cd('/')", 1), result, (" Done.", 1)],
        [prompt, (" ls(all=True)", 1), result, (" rm('notes.txt')", 1)],
        [prompt, (" I cannot do that.", 1)],
    ]
    expert = side(policy, chosen, 1.0, EXPERT)
    return [
        PreferencePair("t", expert, side(policy, parts, 0.2 * i, f"f{i}"), "expert")
        for i, parts in enumerate(rejected)
    ]


def trl_batch(pairs: list[PreferencePair], reference: torch.Tensor) -> dict[str, torch.Tensor]:
    """``pairs`` as TRL's collator lays out a batch: the chosen rows, then the rejected;
    the agent's tokens as its completion mask, the reference log-probs precomputed."""
    rows = [(p.chosen.token_ids, p.chosen.loss_mask) for p in pairs]
    rows += [(p.rejected.token_ids, p.rejected.loss_mask) for p in pairs]
    ids, attention, mask = pad_sides(rows, 0, torch.device("cpu"))
    return {
        "input_ids": ids,
        "attention_mask": attention,
        "completion_mask": mask.long(),
        "ref_chosen_logps": reference[:, 0],
        "ref_rejected_logps": reference[:, 1],
    }


def trl_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """TRL 1.13's DPO loss (``DPOTrainer._compute_loss`` with ``loss_type=["sigmoid",
    "sft"]``, ``loss_weights=[1, sft_coef]`` and precomputed reference log-probs)."""
    from trl.trainer.dpo_trainer import DPOTrainer

    same = lambda value: value  # noqa: E731  (one process: gathering is the identity)
    trainer = SimpleNamespace(
        accelerator=SimpleNamespace(
            device=torch.device("cpu"), gather=same, gather_for_metrics=same
        ),
        model=model,
        aux_loss_enabled=False,
        ld_alpha=None,
        precompute_ref_logps=True,
        f_divergence_type="reverse_kl",
        loss_types=["sigmoid", "sft"],
        loss_weights=[1.0, SFT_COEF],
        beta=BETA,
        use_weighting=False,
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
        _total_train_tokens=0,
        _tp_size=1,
    )
    loss: torch.Tensor = DPOTrainer._compute_loss(trainer, model, dict(batch), False)
    return loss


class FixedLogits(nn.Module):
    """A model that answers every batch with the same logits."""

    def __init__(self, logits: torch.Tensor) -> None:
        super().__init__()
        self.logits = logits

    def forward(self, **_: object) -> SimpleNamespace:
        return SimpleNamespace(logits=self.logits)


def trained_learner(policy: LoadedPolicy) -> GrpoLearner:
    """An eto learner whose adapter is not at its start (so the policy is not the base)."""
    settings = PreferenceConfig(beta=BETA, sft_coef=SFT_COEF)
    learner = GrpoLearner(policy, LearnerConfig(objective="eto", preference=settings))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in learner.trainable:
            param.copy_(torch.randn(param.shape, generator=generator) * 0.02)
    return learner


OFFSETS = torch.tensor([[0.5, -1.0], [2.0, 0.3], [-0.7, 1.5]])


def test_the_loss_is_trls_on_the_same_pairs(policy: LoadedPolicy) -> None:
    """Both losses from the same logits, in float64 (in float32 TRL's cross-entropy kernel
    and a log-sum-exp differ by ~1e-5 per token, which is not what is compared here)."""
    pytest.importorskip("trl")
    trained_learner(policy)
    pairs = fixed_pairs(policy)
    batch = trl_batch(pairs, torch.zeros(len(pairs), 2))
    with torch.no_grad():
        logits = policy.model(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]
        ).logits.double()
    # ours: each token's log-prob (entry t is token t), summed over the agent's tokens
    ids, mask = batch["input_ids"], batch["completion_mask"]
    token_logps = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None])[..., 0]
    token_logps = torch.cat([torch.zeros_like(token_logps[:, :1]), token_logps], dim=1)
    logps = summed_logprobs(token_logps, mask).view(2, len(pairs)).T
    reference = logps + OFFSETS.double()
    batch |= {"ref_chosen_logps": reference[:, 0], "ref_rejected_logps": reference[:, 1]}

    loss, stats = dpo_loss(
        logps[:, 0],
        logps[:, 1],
        reference[:, 0],
        reference[:, 1],
        beta=BETA,
        sft_coef=SFT_COEF,
        chosen_tokens=torch.tensor([p.chosen.agent_tokens for p in pairs]),
    )
    expected = trl_loss(FixedLogits(logits), batch)
    assert stats.pairs == 3 and stats.sft_tokens == 3 * pairs[0].chosen.agent_tokens
    assert 0 < stats.correct < 3  # the offsets rank some pairs right, some wrong
    assert abs(float(loss) - float(expected)) < 1e-6


def gradients(policy: LoadedPolicy) -> list[torch.Tensor]:
    grads = [p.grad.clone() for p in policy.model.parameters() if p.grad is not None]
    policy.model.zero_grad(set_to_none=True)
    return grads


def test_the_learners_gradient_is_trls(policy: LoadedPolicy) -> None:
    """The learner's way (one pair at a time, log-probs only at the agent's tokens,
    normalised by the whole batch) against TRL's batch on the real model."""
    pytest.importorskip("trl")
    learner = trained_learner(policy)
    pairs = fixed_pairs(policy)
    with torch.no_grad():
        logps = torch.stack([pair_logprobs(learner, policy.model, p, 0)[0] for p in pairs])
    reference = logps + OFFSETS

    expected = trl_loss(policy.model, trl_batch(pairs, reference))
    expected.backward()
    theirs = gradients(policy)
    supervised = sum(p.chosen.agent_tokens for p in pairs)
    total = 0.0
    for pair, ref in zip(pairs, reference, strict=True):
        stats, _ = accumulate_pair(learner, pair, ref, len(pairs), supervised)
        total += stats.preference_loss / len(pairs) + SFT_COEF * stats.sft_nll / supervised
    ours = gradients(policy)
    assert abs(total - float(expected.detach())) < 1e-4 * float(expected.detach())
    assert len(ours) == len(theirs) > 0
    errors = [
        float((mine - trl).norm() / trl.norm()) for mine, trl in zip(ours, theirs, strict=True)
    ]
    assert max(errors) < 1e-3  # float32 noise: different batch shapes, kept logits


def test_the_sft_term_counts_expert_chosen_sides_only() -> None:
    chosen = torch.tensor([-4.0, -2.0])
    rejected = torch.tensor([-5.0, -3.0])
    reference = torch.zeros(2)
    tokens = torch.tensor([4, 8])
    expert_only, stats = dpo_loss(
        chosen,
        rejected,
        reference,
        reference,
        beta=BETA,
        sft_coef=1.0,
        chosen_tokens=tokens,
        expert_chosen=torch.tensor([True, False]),
    )
    preference = -F.logsigmoid(BETA * torch.tensor([1.0, 1.0])).mean()
    assert torch.isclose(expert_only, preference + 4.0 / 4)
    assert (stats.sft_tokens, stats.sft_nll, stats.correct) == (4, 4.0, 2)
    without, _ = dpo_loss(chosen, rejected, reference, reference, beta=BETA)
    assert torch.isclose(without, preference)
    with pytest.raises(ValueError, match="beta"):
        dpo_loss(chosen, rejected, reference, reference, beta=0.0)


def wrong_call_side(policy: LoadedPolicy, conversation: Conversation) -> PairSide:
    """The expert's conversation with its first call replaced by a wrong one: a failure
    in the same format, with the same user turns and tool results around it."""
    messages = list(conversation.messages)
    first = next(i for i, m in enumerate(messages) if m.tool_calls)
    wrong = ToolCall(name="rm", arguments={"file_name": "everything"})
    messages[first] = ChatMessage(
        role="assistant", content=format_tool_calls([wrong]), tool_calls=[wrong]
    )
    changed = replace(conversation, messages=messages)
    [example] = tokenize_conversation(policy.tokenizer, changed)
    return PairSide(example.input_ids, supervised_mask(example), 0.2, "failure")


def test_masked_tokens_carry_no_loss(policy: LoadedPolicy) -> None:
    """A real BFCL entry of two turns: the gradient of the loss w.r.t. the logits that
    predict a prompt, user-turn or tool-result token is exactly zero; it is not at the
    agent's tokens."""
    task = next(t for t in seed_tasks() if t.id == "multi_turn_base_100")
    [expert] = expert_sides(policy, [task], WarmStartConfig()).values()
    env = make_environment("bfcl")
    try:
        conversation = replayed_conversation(task, env)
    finally:
        env.close()
    # the expert's agent tokens are its assistant messages: no user turn, no tool result
    pairs = zip(expert.token_ids, expert.loss_mask, strict=True)
    agent_text = policy.tokenizer.decode([t for t, m in pairs if m])
    for message in conversation.messages:
        if message.role in ("user", "tool"):
            assert message.content not in agent_text
    users = [m for m in conversation.messages if m.role == "user"]
    assert len(users) == 2  # a second user turn lies between the agent's messages
    failure = wrong_call_side(policy, conversation)

    ids, attention, mask = pad_sides(
        [_ids_mask(expert), _ids_mask(failure)], 0, torch.device("cpu")
    )
    with torch.no_grad():
        logits = policy.model(input_ids=ids, attention_mask=attention).logits.float()
    logits.requires_grad_(True)
    token_logps = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None])[..., 0]
    token_logps = torch.cat([torch.zeros_like(token_logps[:, :1]), token_logps], dim=1)
    logps = summed_logprobs(token_logps, mask)
    loss, _ = dpo_loss(
        logps[:1],
        logps[1:],
        logps[:1].detach() - 1.0,
        logps[1:].detach() + 1.0,
        beta=BETA,
        sft_coef=1.0,
        chosen_tokens=mask[:1].sum(dim=1),
    )
    loss.backward()
    assert logits.grad is not None
    predicts = torch.zeros_like(mask)  # the logits at t-1 predict token t
    predicts[:, :-1] = mask[:, 1:]
    touched = logits.grad.abs().amax(dim=-1) > 0
    assert torch.equal(touched, predicts)
    assert int(mask.sum()) < 0.2 * int(attention.sum())  # most tokens are context

    # the learner scores the pair with the same mask (its prompt run once)
    learner = GrpoLearner(policy, LearnerConfig(objective="eto"))
    pair = PreferencePair(task.id, expert, failure, "expert")
    prompt_length, over = pair_layout(learner, pair)
    assert prompt_length > 500 and not over
    with torch.no_grad():
        shared = pair_logprobs(learner, policy.model, pair, prompt_length)[0]
    assert torch.allclose(shared, logps.detach(), atol=2e-3)


def _ids_mask(side: PairSide) -> tuple[list[int], list[int]]:
    return side.token_ids, side.loss_mask
