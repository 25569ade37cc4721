"""Learner checkpoints: everything needed to resume training exactly where it stopped.

A checkpoint holds the trainable weights (the LoRA adapters, or all weights under full
fine-tuning), the frozen reference adapter after a warm start, the optimizer state, the
step and policy version counters and the RNG states (so dropout and any sampling repeat).
It is written to a temporary file in the same directory, flushed to disk and renamed over
the old one, so a learner killed at any moment (SIGKILL included) leaves either the
previous checkpoint or the new one, never half of one.
"""

from __future__ import annotations

import os
import random
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from coevolve.shared.policy.adapters import add_reference_adapter, is_reference_parameter

FORMAT_VERSION = 1


@dataclass
class CheckpointState:
    step: int
    version: int
    extra: dict[str, Any] = field(default_factory=dict)


def trainable_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The parameters that training changes, by name, detached and on the CPU."""
    return {
        name: param.detach().cpu().clone()
        for name, param in model.named_parameters()
        if param.requires_grad
    }


def reference_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The frozen reference adapter (empty before a warm start, or without LoRA)."""
    return {
        name: param.detach().cpu().clone()
        for name, param in model.named_parameters()
        if is_reference_parameter(name)
    }


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def atomic_torch_save(payload: dict[str, Any], path: Path) -> None:
    """``torch.save`` to ``path`` via a fsynced temporary file and an atomic rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            torch.save(payload, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp_name, path)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


def save_checkpoint(
    path: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    step: int,
    version: int,
    extra: dict[str, Any] | None = None,
) -> None:
    payload = {
        "format": FORMAT_VERSION,
        "step": step,
        "version": version,
        "weights": trainable_state(model),
        "reference": reference_state(model),
        "optimizer": optimizer.state_dict(),
        "rng": rng_state(),
        "extra": extra or {},
    }
    atomic_torch_save(payload, path)


def load_checkpoint(
    path: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    check: Callable[[Path, dict[str, Any]], None] | None = None,
) -> CheckpointState:
    """Restore ``model``'s trainable weights, ``optimizer`` and the RNGs from ``path``.

    The model must have the same trainable parameters (same names and shapes) as the one
    saved; anything else is refused with a clear error rather than loaded partially.
    ``check(path, extra)`` sees the saved ``extra`` first and may refuse it by raising,
    before anything is restored.
    """
    payload = torch.load(path, map_location="cpu", weights_only=True)
    if payload.get("format") != FORMAT_VERSION:
        raise ValueError(f"{path}: unsupported checkpoint format {payload.get('format')}")
    if check is not None:
        check(path, payload["extra"])
    reference: dict[str, torch.Tensor] = payload.get("reference") or {}
    if reference:
        add_reference_adapter(model)
        named = dict(model.named_parameters())
        with torch.no_grad():
            for name, value in reference.items():
                named[name].copy_(value.to(named[name].device, named[name].dtype))
    saved: dict[str, torch.Tensor] = payload["weights"]
    params = {name: p for name, p in model.named_parameters() if p.requires_grad}
    if set(saved) != set(params):
        missing = sorted(set(params) - set(saved))[:3]
        unexpected = sorted(set(saved) - set(params))[:3]
        raise ValueError(
            f"{path}: trainable parameters differ (missing {missing}, unexpected {unexpected})"
        )
    with torch.no_grad():
        for name, param in params.items():
            if saved[name].shape != param.shape:
                raise ValueError(f"{path}: shape of {name} is {tuple(saved[name].shape)}")
            param.copy_(saved[name].to(param.device, param.dtype))
    optimizer.load_state_dict(payload["optimizer"])
    restore_rng_state(payload["rng"])
    return CheckpointState(
        step=int(payload["step"]), version=int(payload["version"]), extra=payload["extra"]
    )
