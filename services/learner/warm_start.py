"""The SFT warm start without the bus: which tasks it trains on, and the run itself.

The learner service and the lockstep schedule both call these, so a ``warm_start`` setting
means the same in both; each then makes the warm-started policy the KL reference
(``GrpoLearner.freeze_reference``).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from coevolve.services.learner.learner_view import LearnerView
from coevolve.services.learner.memory import release_freed_memory
from coevolve.services.learner.sft import (
    Progress,
    WarmStartReport,
    build_examples,
    truncate,
    warm_start,
)
from coevolve.shared.demonstrations import SftExample
from coevolve.shared.messages import Origin, Task
from coevolve.shared.policy import LoadedPolicy

if TYPE_CHECKING:
    from coevolve.services.learner.config import WarmStartConfig

# the pool mixes grains: sample this many times ``tasks`` and keep the wanted grain
OVERSAMPLE = 4
# the pool sample the demonstrations are drawn from (the warm start's is seed 0)
DEMONSTRATIONS_SEED = 1


def demonstration_origin(labels: str) -> Origin:
    """Whose calls the warm start and the replay imitate: the labelled train split's
    (origin "seed"), or with no labels D0's validated calls (origin "explored")."""
    return "seed" if labels == "bfcl" else "explored"


def warm_start_tasks(
    sampled: Sequence[Task], config: WarmStartConfig, count: int | None = None
) -> list[Task]:
    """The first ``count`` (default ``config.tasks``) distinct tasks of ``sampled`` with
    ground truth and of the configured grain (``turn``, ``entry`` or ``any``)."""
    unique = {
        t.id: t
        for t in sampled
        if any(t.ground_truth) and config.grain in ("any", t.env_config.get("grain", "entry"))
    }
    return list(unique.values())[: config.tasks if count is None else count]


def demonstrations(
    policy: LoadedPolicy, tasks: Sequence[Task], config: WarmStartConfig
) -> list[SftExample]:
    """``tasks``' ground truth replayed as the warm start replays it, within its length
    limits: the examples GRPO's demonstration replay draws from (``demo_coef``)."""
    examples, _, _ = build_examples(policy, tasks, max_target_tokens=config.max_target_tokens)
    return [truncate(e, config.max_len) for e in examples]


def run_warm_start(
    policy: LoadedPolicy,
    tasks: Sequence[Task],
    config: WarmStartConfig,
    *,
    progress: bool | Progress = False,
    checkpoint: Path | None = None,
) -> WarmStartReport:
    """SFT of ``policy`` in place on ``tasks`` with ``config.threads`` torch threads (every
    core when unset), resumable from ``checkpoint``; torch's thread count is restored."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(config.threads or os.cpu_count() or threads)
    try:
        return warm_start(
            policy,
            tasks,
            epochs=config.epochs,
            lr=config.lr,
            batch_size=config.batch_size,
            max_len=config.max_len,
            progress=progress,
            checkpoint=checkpoint,
            max_target_tokens=config.max_target_tokens,
            min_steps=config.min_steps,
        )
    finally:
        torch.set_num_threads(threads)
        release_freed_memory()


def adopt_warm_start(learner: LearnerView, path: str | Path, sha256: str | None = None) -> str:
    """Make ``learner`` the warm-started policy exported to ``path`` (both adapters, as
    ``export_weights`` writes them) at version 1, in place of the SFT; returns the file's
    sha256. Refused (``WeightsMismatch``) when it differs from ``sha256`` or does not fit
    the model."""
    from coevolve.shared.policy.weights import WeightsMismatch, import_weights, weights_digest

    path = Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"warm_start.from_policy: no such file {path}")
    blob = path.read_bytes()
    digest = weights_digest(blob)
    if sha256 is not None and digest != sha256:
        raise WeightsMismatch(f"{path} has sha256 {digest}, not the expected {sha256}")
    import_weights(learner.model, blob)
    learner.optimizer.state.clear()
    learner.warm_started = True
    learner.version = max(learner.version, 1)
    learner.restart_failure_agent()
    return digest
