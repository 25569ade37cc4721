"""Memory freed after a learner step goes back to the OS instead of staying resident."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from coevolve.services.learner.memory import _malloc_trim, release_freed_memory


def resident_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or _malloc_trim is None, reason="needs glibc"
)
def test_freed_holes_are_returned_after_release() -> None:
    # many small tensors (heap, not mmap), every tenth kept: the freed ones are holes glibc
    # keeps resident, as a step's activations between the weights' allocations are
    tensors = [torch.ones(16 * 1024) for _ in range(6000)]  # 64 KiB each, ~375 MiB
    kept = tensors[::10]
    del tensors
    held = resident_mb()
    release_freed_memory()
    released = resident_mb()
    assert held - released > 150, (held, released)
    assert all(float(t[0]) == 1.0 for t in kept)
