"""The policy's adapter stack as one LoRA adapter in peft's file format, for vLLM.

After the warm start the policy is base + warm-start adapter + GRPO adapter
(``adapters``). vLLM applies one LoRA per request, so the stack is written as one adapter
whose rank is the sum of theirs: A is the adapters' A matrices stacked, B their B matrices
side by side, each scaled by its adapter's scaling, and the merged scaling is 1
(``lora_alpha == r``). The product B·A is then the sum of the adapters' updates, exactly.
vLLM loads such a directory through ``LoRARequest(name, int_id, path)``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from peft import PeftModel
from peft.tuners.lora import LoraLayer
from safetensors.torch import save_file

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"


def stacked_update(layer: Any) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(A, B) of the layer's active adapters merged, or None where none is active."""
    names = [n for n in layer.active_adapters if n in layer.lora_A]
    if not names:
        return None
    a = torch.cat([layer.lora_A[n].weight.detach().float() for n in names], dim=0)
    b = torch.cat(
        [layer.lora_B[n].weight.detach().float() * float(layer.scaling[n]) for n in names], dim=1
    )
    return a, b


def write_merged_adapter(model: Any, target: Path) -> Path:
    """Write ``model``'s active LoRA adapters as one peft adapter directory at ``target``."""
    if not isinstance(model, PeftModel):
        raise ValueError("the model has no LoRA adapter to write (finetune is not 'lora')")
    tensors: dict[str, torch.Tensor] = {}
    modules: set[str] = set()
    rank = 0
    network: Any = model.base_model.model
    for name, module in network.named_modules():
        if not isinstance(module, LoraLayer):
            continue
        merged = stacked_update(module)
        if merged is None:
            continue
        a, b = merged
        rank = max(rank, a.shape[0])
        modules.add(name.rsplit(".", 1)[-1])
        prefix = f"base_model.model.{name}"
        tensors[f"{prefix}.lora_A.weight"] = a.contiguous()
        tensors[f"{prefix}.lora_B.weight"] = b.contiguous()
    if not tensors:
        raise ValueError("the model has no active LoRA adapter to write")
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": rank,  # scaling 1: each adapter's own scaling is inside B
        "lora_dropout": 0.0,
        "bias": "none",
        "target_modules": sorted(modules),
        "fan_in_fan_out": False,
        "use_rslora": False,
        "base_model_name_or_path": None,
    }
    target.mkdir(parents=True, exist_ok=True)
    (target / CONFIG_FILE).write_text(json.dumps(config, indent=2))
    save_file(tensors, str(target / WEIGHTS_FILE))
    return target
