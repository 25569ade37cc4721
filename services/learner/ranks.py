"""The other ranks of a data-parallel learner (``learner.world_size`` > 1).

Rank 0 is the learner service: it talks to the bus, warm-starts, checkpoints and announces
versions. Ranks 1..N-1 are processes it starts; each loads the same policy, joins the
process group and follows rank 0's orders, handed over by broadcast: ``sync`` (take rank
0's weights, optimizer state, step count, version and demonstrations), ``step`` (train on
a step's groups, each rank its share, with the expert sides of a preference objective;
``distributed``) and ``stop``. A rank that dies fails
rank 0's next collective and is seen by ``Ranks.dead``; the service then exits and is
restarted from its last checkpoint, as a one-process learner is.
"""

from __future__ import annotations

import logging
import multiprocessing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import msgspec
import torch

from coevolve.services.learner.config import LearnerConfig
from coevolve.services.learner.distributed import (
    broadcast_object,
    broadcast_parameters,
    close_ranks,
    init_ranks,
)
from coevolve.services.learner.memory import map_large_blocks
from coevolve.services.learner.preference_pairs import PairSide
from coevolve.services.learner.step_metrics import StepMetrics
from coevolve.services.learner.trainer import GrpoLearner
from coevolve.shared.messages import RolloutGroup
from coevolve.shared.runtime.child_process import terminate_with_parent
from coevolve.shared.runtime.nats_server import free_port

log = logging.getLogger(__name__)

STOP_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class PolicySpec:
    """What every rank needs to load the same policy and learner."""

    model: str | None
    device: str | None
    finetune: str
    grpo: bytes  # LearnerConfig as JSON
    run_dir: str
    threads: int
    map_large_blocks: bool = False


def build_learner(spec: PolicySpec, log_dir: Path | None = None) -> GrpoLearner:
    from coevolve.shared.policy import load_policy

    if spec.map_large_blocks:
        map_large_blocks()
    policy = load_policy(
        spec.model,
        run_dir=Path(spec.run_dir),
        device=spec.device,
        finetune=spec.finetune,  # type: ignore[arg-type]
    )
    config = msgspec.json.decode(spec.grpo, type=LearnerConfig)
    return GrpoLearner(policy, config, log_dir=log_dir)


def sync_payload(learner: GrpoLearner) -> dict[str, Any]:
    return {
        "warm_started": learner.warm_started,
        "step_count": learner.step_count,
        "version": learner.version,
        "optimizer": learner.optimizer.state_dict(),
        "demonstrations": learner.demonstrations,
    }


def synced(learner: GrpoLearner, payload: dict[str, Any]) -> None:
    """Take rank 0's state: its weights by ``broadcast_parameters`` (a collective rank 0
    runs right after sending ``payload``), then its counters, optimizer and demonstrations.

    The warm start's reference is taken as rank 0 took it: under LoRA it is an adapter,
    added before the weights arrive so both ranks hold the same parameters; under full
    fine-tuning a copy of the weights, made once they have arrived.
    """
    freeze = payload["warm_started"] and not learner.warm_started
    lora = learner.policy.finetune == "lora"
    if freeze and lora:
        learner.freeze_reference()
    broadcast_parameters(learner.model)
    if freeze and not lora:
        learner.freeze_reference()
    learner.step_count = payload["step_count"]
    learner.version = payload["version"]
    learner.optimizer.load_state_dict(payload["optimizer"])
    learner.set_demonstrations(payload["demonstrations"])


def rank_main(rank: int, world_size: int, address: str, spec: PolicySpec) -> None:
    """A rank other than 0: load, join, then follow orders until ``stop``."""
    terminate_with_parent()
    torch.set_num_threads(spec.threads)
    learner = build_learner(spec)
    init_ranks(rank, world_size, address, device=learner.device)
    try:
        while True:
            order: str
            payload: Any
            order, payload = broadcast_object(None)
            if order == "stop":
                return
            if order == "sync":
                synced(learner, payload)
            elif order == "step":
                groups, experts = payload
                learner.step(groups, experts)
    finally:
        close_ranks()


def free_address() -> str:
    """A loopback address for the process group's rendezvous."""
    return f"tcp://127.0.0.1:{free_port()}"


class Ranks:
    """Rank 0's handle on ranks 1..N-1: start them, join the group, send orders."""

    def __init__(self, world_size: int, spec: PolicySpec) -> None:
        if world_size < 2:
            raise ValueError("Ranks is for a world of two or more ranks")
        self.world_size = world_size
        self.address = free_address()
        context = multiprocessing.get_context("spawn")
        # started from the thread that lives as long as the service (the parent-death
        # signal follows the starting thread)
        self.processes: list[BaseProcess] = [
            context.Process(
                target=rank_main,
                args=(rank, world_size, self.address, spec),
                name=f"learner-rank-{rank}",
                daemon=True,
            )
            for rank in range(1, world_size)
        ]
        for process in self.processes:
            process.start()
        self.joined = False

    def join_group(self, device: torch.device | str) -> None:
        """Rank 0 joins; blocks until every rank has (run it off the event loop)."""
        init_ranks(0, self.world_size, self.address, device=device)
        self.joined = True

    def sync(self, learner: GrpoLearner) -> None:
        broadcast_object(("sync", sync_payload(learner)))
        broadcast_parameters(learner.model)

    def step(
        self,
        learner: GrpoLearner,
        groups: Sequence[RolloutGroup],
        experts: Mapping[str, PairSide] | None = None,
    ) -> StepMetrics:
        broadcast_object(("step", (list(groups), dict(experts or {}))))
        return learner.step(groups, experts)

    def dead(self) -> list[str]:
        """The ranks whose process has exited, with its exit code."""
        return [f"{p.name} (exit code {p.exitcode})" for p in self.processes if not p.is_alive()]

    def stop(self) -> None:
        """Ask every rank to stop; whatever is still running after the timeout is killed."""
        if self.joined and not self.dead():
            try:
                broadcast_object(("stop", None))
            except Exception as exc:  # a rank died meanwhile: the kill below ends the rest
                log.warning("could not ask the learner ranks to stop: %s", exc)
        for process in self.processes:
            process.join(STOP_TIMEOUT_S)
            if process.is_alive():
                process.kill()
                process.join(STOP_TIMEOUT_S)
        if self.joined:
            close_ranks()
            self.joined = False
