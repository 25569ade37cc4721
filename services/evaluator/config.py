"""The evaluator's settings (the ``services.evaluator`` section)."""

from __future__ import annotations

import msgspec

from coevolve.shared.config import EngineKind, Settings
from coevolve.shared.envs.bfcl.tasks import TURN_SUITES

SECTION = "evaluator"


class EvaluatorConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, frozen=True):
    # `coevolve up` starts the evaluator only when this is true: it takes CPU from training
    enabled: bool = False
    # score a version once at least this many versions came after the last one scored
    every_versions: int = 2
    # held-out turns scored per version: drawn once per run with `seed` from the eval split
    # of the run's world and kept in RUN_DIR/evaluator/sample.json
    tasks: int = 16
    seed: int = 0
    suite: str = "bfcl-turns-base"
    # the user's own held-out tasks (a JSON list of tasks, or an object with `tasks`, as
    # in docs/evaluator.md), relative to the folder coevolve runs in; null: BFCL's eval
    # split in the bfcl world, the D0 file's held-out slice in a user's environment
    # (d0.heldout_every, which a file turns off)
    heldout_file: str | None = None
    # the base model the learner trains (None: the shipped SmolLM2-135M-Instruct)
    model: str | None = None
    # how the policy plays, greedy as in `coevolve eval`; None: eval's default (llama_cpp,
    # the rollout's budget of 128 tokens a message and 4 messages a turn, 8 turns a batch)
    engine: EngineKind | None = None
    max_new_tokens: int | None = None
    max_steps_per_turn: int | None = None
    batch_size: int | None = None
    likelihood: bool = True
    # torch and llama.cpp threads of an evaluation: it runs beside the training
    threads: int = 1
    # an evaluation still running after this long is killed and its version skipped
    timeout_s: float = 3600.0

    def __post_init__(self) -> None:
        for name in ("every_versions", "tasks", "max_new_tokens", "max_steps_per_turn", "threads"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"evaluator.{name} must be at least 1, not {getattr(self, name)}")
        if self.timeout_s <= 0:
            raise ValueError(f"evaluator.timeout_s must be > 0, not {self.timeout_s}")
        if self.suite not in TURN_SUITES:
            turns = ", ".join(TURN_SUITES)
            raise ValueError(f"evaluator.suite: {self.suite!r} is not one of {turns}")


def evaluator_enabled(settings: Settings) -> bool:
    """Whether ``coevolve up`` should start the evaluator (``services.evaluator.enabled``)."""
    return settings.section(SECTION, EvaluatorConfig).enabled


def heldout_every(settings: Settings) -> int:
    """Every how many accepted tasks D0 holds one out for the evaluator: none in the bfcl
    world (its eval split) or when the user gives held-out tasks of their own."""
    if settings.section(SECTION, EvaluatorConfig).heldout_file is not None:
        return 0
    return settings.d0.keeps_heldout_every
