"""The warm-started policy as a frozen LoRA adapter under the one GRPO trains.

After the SFT warm start its adapter is copied into a second adapter, ``REFERENCE_ADAPTER``,
which is frozen, and the trained adapter (``default``) is re-initialised (LoRA's B = 0, so
the network's output is unchanged). Both stay active: the policy is base + warm start +
GRPO adapter, and the KL reference is base + warm start, computed by switching the GRPO
adapter off for one no-grad forward pass. The exported weights carry both adapters, so
a rollout worker or an evaluation that imports them rebuilds the same stack.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import Any

from peft import PeftModel
from peft.tuners.lora import LoraLayer

TRAINED_ADAPTER = "default"
REFERENCE_ADAPTER = "warm_start"
_MARKER = f".{REFERENCE_ADAPTER}."


def is_reference_parameter(name: str) -> bool:
    return _MARKER in name


def has_reference_adapter(model: Any) -> bool:
    return isinstance(model, PeftModel) and REFERENCE_ADAPTER in model.peft_config


def add_reference_adapter(model: Any) -> None:
    """Add the (frozen, active) reference adapter if the model lacks it; values are not set."""
    if not isinstance(model, PeftModel) or has_reference_adapter(model):
        return
    config = copy.deepcopy(model.peft_config[TRAINED_ADAPTER])
    was_training = model.training
    model.add_adapter(REFERENCE_ADAPTER, config)
    model.train(was_training)  # new adapters come with their dropout in training mode
    activate_stack(model)


def activate_stack(model: Any) -> None:
    """Both adapters active; only the trained one requires grad."""
    model.base_model.set_adapter([TRAINED_ADAPTER, REFERENCE_ADAPTER])
    for name, param in model.named_parameters():
        if is_reference_parameter(name):
            param.requires_grad_(False)


def freeze_trained_as_reference(model: Any) -> None:
    """Copy the trained adapter into the reference adapter and start a fresh trained one."""
    add_reference_adapter(model)
    params = dict(model.named_parameters())
    with_reference = {
        name: name.replace(f".{TRAINED_ADAPTER}.", _MARKER)
        for name in params
        if f".{TRAINED_ADAPTER}." in name and "lora_" in name
    }
    for source, target in with_reference.items():
        params[target].data.copy_(params[source].data)
    for module in model.modules():
        if isinstance(module, LoraLayer) and TRAINED_ADAPTER in module.lora_A:
            module.reset_lora_parameters(TRAINED_ADAPTER, True)
    activate_stack(model)


@contextlib.contextmanager
def reference_only(model: Any) -> Iterator[Any]:
    """Inside, only the reference adapter is active (use under ``torch.no_grad``)."""
    flags = {name: param.requires_grad for name, param in model.named_parameters()}
    model.base_model.set_adapter([REFERENCE_ADAPTER])
    try:
        yield model
    finally:
        activate_stack(model)
        for name, param in model.named_parameters():
            param.requires_grad_(flags[name])
