"""The co-evolving failure agent: a second adapter on the policy's base, trained by DPO
to fail closer to success (Co-Evolving Agents' hard negatives).

It shares the learner's network: its adapter weights live here and are swapped into the
learner's trainable parameters (an in-place copy, both ways) to train or export it, with
its own AdamW state. Its reference is the target's, the network with the trained adapter
off (base + warm start), and it starts as the target's fresh adapter, so both agents
start as the warm-started policy. Its versions count its own updates, announced apart
from the target's (``policy_sync.updates_subject``).

Each learner step it trains on failure-vs-failure pairs (``preference_pairs``) from the
failures of both agents on the same task, the higher partial credit chosen: it learns
what separates a near miss from a far one, and rolled on the tasks the target fails its
failures become the target's hard negatives (expert against them).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor

from coevolve.services.learner.learner_view import LearnerView


class FailureAgent:
    """The failure agent's weights (same order as ``learner.trainable``), its optimizer,
    and its version and step count."""

    def __init__(self, learner: LearnerView, version: int = 1) -> None:
        self.weights: list[Tensor] = [p.detach().clone() for p in learner.trainable]
        config = learner.config
        self.optimizer = torch.optim.AdamW(
            learner.trainable, lr=config.lr, betas=config.betas, weight_decay=config.weight_decay
        )
        self.version = version
        self.step_count = 0

    @contextmanager
    def swapped_in(self, learner: LearnerView) -> Iterator[None]:
        """Inside, the learner's trainable parameters and optimizer are the failure
        agent's (its updates, exports and log-probs are the failure agent's)."""
        learner.optimizer.zero_grad(set_to_none=True)
        self._exchange(learner)
        target_optimizer, learner.optimizer = learner.optimizer, self.optimizer
        try:
            yield
        finally:
            learner.optimizer.zero_grad(set_to_none=True)
            learner.optimizer = target_optimizer
            self._exchange(learner)

    def _exchange(self, learner: LearnerView) -> None:
        with torch.no_grad():
            for param, mine in zip(learner.trainable, self.weights, strict=True):
                held = param.detach().clone()
                param.copy_(mine)
                mine.copy_(held)

    def export(self, learner: LearnerView) -> bytes:
        """The failure agent's weights in the target's export format (for rollout)."""
        with self.swapped_in(learner):
            return learner.export_weights()

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps of it."""
        return {
            "weights": [w.clone() for w in self.weights],
            "optimizer": self.optimizer.state_dict(),
            "version": self.version,
            "step": self.step_count,
        }

    def restore(self, state: dict[str, Any]) -> None:
        saved: list[Tensor] = state["weights"]
        if len(saved) != len(self.weights) or any(
            s.shape != w.shape for s, w in zip(saved, self.weights, strict=True)
        ):
            raise ValueError("the checkpoint's failure agent does not fit this policy's adapter")
        with torch.no_grad():
            for mine, value in zip(self.weights, saved, strict=True):
                mine.copy_(value.to(mine.device, mine.dtype))
        self.optimizer.load_state_dict(state["optimizer"])
        self.version = int(state["version"])
        self.step_count = int(state["step"])
