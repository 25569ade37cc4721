"""Data-parallel learning over torch.distributed: N ranks compute the update one rank would.

Every rank holds the same weights and optimizer state. A step's groups (and replayed
demonstrations) are dealt round-robin to the ranks; each rank normalises its loss by the
whole step's token count and the gradients are summed across ranks before the one clipped
update every rank applies. The gradients are all-reduced by hand rather than through
``DistributedDataParallel``: a group's shared prompt runs once and is backpropagated
separately (``SharedPrefix``), which DDP's one-forward-one-backward hooks do not model.
The backend is gloo on CPU and nccl on CUDA.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn

T = TypeVar("T")

# a collective waits this long for a rank before failing (a dead rank must not hang a step)
DEFAULT_TIMEOUT_S = 300.0


def world() -> tuple[int, int]:
    """(rank, world size) of this process; (0, 1) outside a process group."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def backend_for(device: torch.device | str) -> str:
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def init_ranks(
    rank: int,
    world_size: int,
    address: str,
    *,
    device: torch.device | str = "cpu",
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> None:
    """Join the process group at ``address`` (``tcp://host:port``) as ``rank``."""
    dist.init_process_group(
        backend_for(device),
        init_method=address,
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def close_ranks() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def share(items: Sequence[T]) -> list[T]:
    """This rank's share of ``items``, dealt round-robin (all of them on one rank)."""
    rank, size = world()
    return list(items[rank::size])


class GradientSum:
    """The gradient of a step as a float64 sum of its units' gradients, over every rank.

    A unit (a group, a micro-batch of demonstrations) is computed the same way whichever
    rank runs it; summing units in float64 makes the total independent of their order and
    of how they were dealt to ranks, up to the one rounding back to the parameters' dtype.
    Summed in float32, N ranks drifted from one rank by rounding that Adam, which divides
    by the gradient's scale, amplifies where a gradient is nearly zero.
    """

    def __init__(self, parameters: Iterable[nn.Parameter]) -> None:
        self.parameters = list(parameters)
        self.totals = [torch.zeros_like(p, dtype=torch.float64) for p in self.parameters]

    def collect(self) -> None:
        """Add the gradients accumulated since the last call, and clear them."""
        for param, total in zip(self.parameters, self.totals, strict=True):
            if param.grad is not None:
                total += param.grad.double()
                param.grad = None

    def finish(self) -> None:
        """Sum across ranks and leave the result in the parameters' ``.grad``."""
        self.collect()
        if world()[1] > 1:
            flat = torch.cat([t.reshape(-1) for t in self.totals])
            dist.all_reduce(flat, op=dist.ReduceOp.SUM)
            self.totals = [
                part.view_as(t)
                for part, t in zip(
                    flat.split([t.numel() for t in self.totals]), self.totals, strict=True
                )
            ]
        for param, total in zip(self.parameters, self.totals, strict=True):
            param.grad = total.to(param.dtype)


def broadcast_parameters(module: nn.Module, source: int = 0) -> None:
    """Copy ``source``'s parameters and buffers to every rank (a start from one state)."""
    if world()[1] == 1:
        return
    with torch.no_grad():
        for tensor in [*module.parameters(), *module.buffers()]:
            dist.broadcast(tensor.data, src=source)


def gathered(value: T) -> list[T]:
    """Every rank's ``value``, in rank order (``[value]`` on one rank)."""
    size = world()[1]
    if size == 1:
        return [value]
    out: list[Any] = [None] * size
    dist.all_gather_object(out, value)
    return out


def broadcast_object(value: T | None, source: int = 0) -> T:
    """``source``'s ``value`` on every rank (how rank 0 hands the others a step's groups)."""
    if world()[1] == 1:
        assert value is not None
        return value
    box: list[Any] = [value]
    dist.broadcast_object_list(box, src=source)
    result: T = box[0]
    return result
