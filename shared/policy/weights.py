"""Move trainable weights between processes as safetensors bytes.

Exported are the parameters with ``requires_grad`` (the LoRA adapter for a LoRA policy,
every weight for full fine-tuning) plus, after a warm start, the frozen reference adapter
(``adapters``), keyed by their ``named_parameters`` names, so a policy loaded with the
same model and settings imports them one to one (adding the reference adapter when the
blob has one). Values are copied bit for bit: the importing model gives identical logits.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from coevolve.shared.policy.adapters import add_reference_adapter, is_reference_parameter
from coevolve.shared.policy.loading import LoadedPolicy

FORMAT = "coevolve-trainable-v1"


class WeightsMismatch(ValueError):
    """The blob does not fit the model: names, shapes or the digest differ."""


def module_of(model: Any) -> Any:
    """The torch module of a ``LoadedPolicy``, or ``model`` itself."""
    return model.model if isinstance(model, LoadedPolicy) else model


def trainable_state(model: Any) -> dict[str, torch.Tensor]:
    module = module_of(model)
    return {name: p for name, p in module.named_parameters() if p.requires_grad}


def exported_state(model: Any) -> dict[str, torch.Tensor]:
    """The trainable parameters and the frozen reference adapter, if there is one."""
    module = module_of(model)
    return {
        name: p
        for name, p in module.named_parameters()
        if p.requires_grad or is_reference_parameter(name)
    }


def weights_kind(model: Any) -> str:
    """ "lora", "full" or "partial": what ``export_weights`` would carry."""
    trainable = trainable_state(model)
    total = sum(1 for _ in module_of(model).parameters())
    if trainable and all("lora_" in name for name in exported_state(model)):
        return "lora"
    return "full" if len(trainable) == total else "partial"


def export_weights(model: Any) -> bytes:
    """Safetensors bytes of the trainable parameters (CPU copies, dtypes kept).

    ``model`` is a torch module or a ``LoadedPolicy`` (the same for ``import_weights``).
    """
    state = {name: p.detach().to("cpu").contiguous() for name, p in exported_state(model).items()}
    if not state:
        raise WeightsMismatch("the model has no trainable parameters to export")
    # one metadata key: safetensors writes several in random order, and the blob's digest
    # must be a function of the weights alone
    return save_safetensors(state, metadata={"format": f"{FORMAT};{weights_kind(model)}"})


def weights_digest(blob: bytes) -> str:
    return hashlib.sha256(blob).hexdigest()


def import_weights(model: Any, blob: bytes, *, expected_sha256: str | None = None) -> None:
    """Copy exported parameters into ``model`` in place; all names must match exactly.

    Every trainable parameter of ``model`` must be in the blob and every name in the blob
    must be a parameter of ``model``: load the receiving policy with the same model,
    ``finetune`` mode and LoRA settings as the exporter (a ``finetune="none"`` copy takes
    full weights too). Nothing is copied unless everything fits.
    """
    if expected_sha256 is not None and weights_digest(blob) != expected_sha256:
        raise WeightsMismatch("weights blob does not match its sha256 (corrupted in transit?)")
    incoming = load_safetensors(blob)
    module = module_of(model)
    if any(is_reference_parameter(name) for name in incoming):
        add_reference_adapter(module)
    params = dict(module.named_parameters())
    missing = sorted(set(exported_state(model)) - set(incoming))
    unknown = sorted(set(incoming) - set(params))
    if missing or unknown:
        raise WeightsMismatch(
            f"weights do not fit the model: {len(missing)} trainable parameters missing "
            f"(e.g. {missing[:2]}), {len(unknown)} unknown (e.g. {unknown[:2]}); "
            "was it exported from the same model with the same LoRA settings?"
        )
    for name, value in incoming.items():
        if params[name].shape != value.shape:
            raise WeightsMismatch(
                f"{name}: shape {tuple(value.shape)} in the blob, "
                f"{tuple(params[name].shape)} in the model"
            )
    with torch.no_grad():
        for name, value in incoming.items():
            params[name].copy_(value.to(device=params[name].device, dtype=params[name].dtype))
