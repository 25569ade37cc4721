"""Keeping a learner step's activation memory bounded on long sequences.

Autograd keeps every layer's activations until the backward pass: for SmolLM2-135M that
is about 1.2 MB per token in float32 (30 layers), so one micro-batch of two 8k-token BFCL
conversations holds ~19 GB (measured: the warm start was OOM-killed at 19.4 GB resident).
Above a token budget, the learner instead runs one sequence at a time with activation
checkpointing: each layer keeps only its input and recomputes the rest during backward,
about a third more compute for a fraction of the memory.

Checkpointed layers drop the KV cache, so this path cannot score continuations of a
shared prompt (``SharedPrefix``): every sequence is run whole.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn


def release_freed_memory() -> None:
    """Hand memory freed after a step back to the OS (glibc keeps it otherwise).

    Measured: one warm-start step on 2,048 tokens peaks at 5.9 GB resident and the process
    stays at 5.8 GB after the step's tensors are freed; ``malloc_trim`` takes it to 0.9 GB.
    Without this the learner holds its largest step's activations for the rest of the run.
    """
    gc.collect()
    if _malloc_trim is not None:
        _malloc_trim(0)


def map_large_blocks() -> bool:
    """Give every allocation of ``MMAP_THRESHOLD_BYTES`` or more its own mapping, returned
    to the OS as soon as it is freed (glibc only; False elsewhere).

    By default glibc raises its mmap threshold (up to 32 MB) each time a mapped block is
    freed; from then on a step's activation tensors come from the heap, where the holes
    they leave stay resident until the step ends. Measured on one 2,048-token pass in
    float32 (``coevolve bench learner_rss``, docs/engine.md): the peak falls by about 2 GB,
    and the pass takes 5-42% longer (every large tensor is page-faulted in afresh).
    """
    if _mallopt is None:
        return False
    return bool(_mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))


def peak_resident_gb() -> float:
    """This process's resident-memory high-water mark, in GB (None of the OS: 0)."""
    try:
        import resource
    except ImportError:  # not POSIX
        return 0.0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # kilobytes on Linux, bytes on macOS
    return peak / 1e9 if sys.platform == "darwin" else peak / 1e6


def _load_libc(function: str) -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return getattr(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6"), function)
    except (OSError, AttributeError):  # not glibc
        return None


M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter; setting it also fixes the threshold
MMAP_THRESHOLD_BYTES = 128 * 1024  # glibc's own starting value
_malloc_trim = _load_libc("malloc_trim")
_mallopt = _load_libc("mallopt")


def _base_model(model: nn.Module) -> Any:
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


@contextmanager
def activation_checkpointing(model: nn.Module) -> Iterator[None]:
    """Recompute each decoder layer's activations in backward instead of keeping them."""
    base = _base_model(model)
    if not getattr(base, "supports_gradient_checkpointing", False):
        raise ValueError(f"{type(base).__name__} does not support activation checkpointing")
    was_enabled = bool(getattr(base, "is_activation_checkpointing", False))
    if not was_enabled:
        base.activation_checkpointing_enable(
            activation_checkpointing_kwargs={"use_reentrant": False}
        )
    # transformers checkpoints a layer only in training mode; the GRPO learner scores in
    # eval mode (no dropout, so its log-probs match the rollout's). Flag the layers alone
    # as training: their submodules (dropout, attention) keep their own mode.
    layers = [m for m in base.modules() if getattr(m, "gradient_checkpointing", False)]
    modes = [layer.training for layer in layers]
    for layer in layers:
        layer.training = True
    try:
        yield
    finally:
        for layer, mode in zip(layers, modes, strict=True):
            layer.training = mode
        if not was_enabled:
            base.activation_checkpointing_disable()


@contextmanager
def saved_for_backward() -> Iterator[list[int]]:
    """Bytes of the tensors autograd saves for backward while the block runs (one counter).

    Inside a checkpointed layer the checkpoint's own hooks take over, so what the layer
    would have kept does not count: this measures what activation checkpointing saves.
    """
    counter = [0]

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        counter[0] += tensor.numel() * tensor.element_size()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        yield counter


def padded_tokens(lengths: Sequence[int]) -> int:
    """Tokens a right-padded batch of sequences of these lengths holds activations for:
    every row is as long as the longest."""
    return len(lengths) * max(lengths, default=0)


def over_budget(lengths: list[int], budget: int | None) -> bool:
    """Whether sequences of these lengths, run together, exceed the activation budget."""
    return budget is not None and sum(lengths) > budget
