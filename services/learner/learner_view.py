"""What the learner's parts use of the learner (``trainer.GrpoLearner``): the preference
objectives, the failure agent and the warm start take a ``LearnerView``, so that they
need not import the trainer, which imports them."""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Protocol

import torch
from torch import nn

from coevolve.services.learner.config import LearnerConfig
from coevolve.services.learner.step_metrics import StepMetrics


class LearnerView(Protocol):
    config: LearnerConfig
    model: nn.Module
    device: torch.device
    pad_id: int
    # the parameters the optimizer updates (the adapter's, under LoRA)
    trainable: list[nn.Parameter]
    optimizer: torch.optim.AdamW
    step_count: int
    version: int  # the policy version
    warm_started: bool

    def apply_update(self) -> float: ...

    def export_weights(self) -> bytes: ...

    def reference_model(self) -> AbstractContextManager[nn.Module]: ...

    def restart_failure_agent(self) -> None: ...

    def log_metrics(self, metrics: StepMetrics) -> None: ...
