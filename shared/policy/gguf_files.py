"""GGUF files for the llama.cpp engine: the float base model and LoRA adapters.

The base is made once from the shipped GGUF (de-quantized by llama.cpp itself, the same
values transformers reads) in the dtype the learner trains in: bf16 where the CPU has
native bf16, f16 elsewhere (f32 and q8_0 on request, for benchmarks). Each policy
version's adapters are written from the exported safetensors blob: the GRPO adapter and
the frozen warm-start adapter are concatenated into one adapter of twice the rank (their
deltas add, with the same alpha/rank scale).
"""

from __future__ import annotations

import ctypes
import logging
import os
import re
import threading
from collections import defaultdict
from pathlib import Path
from typing import Any, Literal, get_args

import numpy as np

BaseType = Literal["f16", "bf16", "f32", "q8_0"]
BASE_TYPES: tuple[BaseType, ...] = get_args(BaseType)

# transformers' module names -> llama.cpp's tensor names (Llama architecture)
GGUF_MODULE_NAMES = {
    "q_proj": "attn_q",
    "k_proj": "attn_k",
    "v_proj": "attn_v",
    "o_proj": "attn_output",
    "gate_proj": "ffn_gate",
    "up_proj": "ffn_up",
    "down_proj": "ffn_down",
}
_LORA_NAME = re.compile(
    r"layers\.(?P<layer>\d+)\.[a-z_]+\.(?P<module>[a-z_]+)\.lora_(?P<part>[AB])\.(?P<adapter>[A-Za-z0-9_]+)\.weight$"
)


class AdapterExportError(ValueError):
    """The exported weights cannot be written as a llama.cpp LoRA adapter."""


_backend_lock = threading.Lock()
_quiet_log: Any = None


def llama_library() -> Any:
    """``llama_cpp``, its backend started once per process and its log silenced."""
    global _quiet_log
    import llama_cpp

    with _backend_lock:
        if _quiet_log is None:
            llama_cpp.llama_backend_init()
            # kept referenced: llama.cpp calls it for as long as the process runs
            _quiet_log = llama_cpp.llama_log_callback(lambda level, text, data: None)
            llama_cpp.llama_log_set(_quiet_log, ctypes.c_void_p(0))
    return llama_cpp


def base_gguf(source: Path, models_dir: Path, base_type: BaseType) -> Path:
    """``source`` re-encoded as an all-``base_type`` GGUF under ``models_dir`` (made once)."""
    if base_type not in BASE_TYPES:
        raise ValueError(f"unknown base type {base_type!r}; choose from {BASE_TYPES}")
    target = models_dir / f"{source.stem}.{base_type}.gguf"
    if target.is_file() and target.stat().st_mtime_ns >= source.stat().st_mtime_ns:
        return target
    llama_cpp = llama_library()
    models_dir.mkdir(parents=True, exist_ok=True)
    staging = target.with_name(f"{target.name}.partial-{os.getpid()}")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = {
        "f16": llama_cpp.LLAMA_FTYPE_MOSTLY_F16,
        "bf16": llama_cpp.LLAMA_FTYPE_MOSTLY_BF16,
        "f32": llama_cpp.LLAMA_FTYPE_ALL_F32,
        "q8_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0,
    }[base_type]
    params.allow_requantize = True
    params.pure = True  # every tensor, embeddings and output included
    params.nthread = 1
    status = llama_cpp.llama_model_quantize(
        str(source).encode(), str(staging).encode(), ctypes.byref(params)
    )
    if status != 0 or not staging.is_file():
        staging.unlink(missing_ok=True)
        raise AdapterExportError(f"llama.cpp could not re-encode {source} as {base_type}")
    staging.replace(target)
    return target


def permute_rows(weight: np.ndarray, n_head: int) -> np.ndarray:
    """Reorder q/k output rows from transformers' rotary layout to llama.cpp's.

    transformers rotates the two halves of each head; llama.cpp rotates interleaved
    pairs, so its converter stores q and k with each head's rows interleaved.
    """
    rows = weight.shape[0]
    return (
        weight.reshape(n_head, 2, rows // n_head // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def lora_tensors(
    state: dict[str, np.ndarray], *, n_head: int, n_head_kv: int
) -> dict[str, np.ndarray]:
    """GGUF adapter tensors (``blk.N.<module>.weight.lora_a/_b``) from peft's LoRA weights.

    Every adapter in ``state`` (``default`` and ``warm_start``) is concatenated along the
    rank: A stacks rows, B stacks columns, so the product is the sum of their deltas.
    """
    parts: dict[tuple[int, str], dict[str, dict[str, np.ndarray]]] = defaultdict(
        lambda: {"A": {}, "B": {}}
    )
    for name, value in state.items():
        match = _LORA_NAME.search(name)
        if match is None or match["module"] not in GGUF_MODULE_NAMES:
            raise AdapterExportError(
                f"{name!r} is not a LoRA weight of a Llama projection: llama.cpp takes "
                "LoRA adapters on q/k/v/o/gate/up/down only (use the transformers engine)"
            )
        key = (int(match["layer"]), match["module"])
        parts[key][match["part"]][match["adapter"]] = value.astype(np.float32)
    tensors: dict[str, np.ndarray] = {}
    for (layer, module), by_part in sorted(parts.items()):
        adapters = sorted(by_part["A"])
        if adapters != sorted(by_part["B"]):
            raise AdapterExportError(f"layer {layer} {module}: lora_A and lora_B adapters differ")
        lora_a = np.concatenate([by_part["A"][a] for a in adapters], axis=0)
        lora_b = np.concatenate([by_part["B"][a] for a in adapters], axis=1)
        if module == "q_proj":
            lora_b = permute_rows(lora_b, n_head)
        elif module == "k_proj":
            lora_b = permute_rows(lora_b, n_head_kv)
        name = f"blk.{layer}.{GGUF_MODULE_NAMES[module]}.weight"
        tensors[f"{name}.lora_a"] = np.ascontiguousarray(lora_a)
        tensors[f"{name}.lora_b"] = np.ascontiguousarray(lora_b)
    if not tensors:
        raise AdapterExportError("the weights hold no LoRA tensors")
    return tensors


def adapter_rank(tensors: dict[str, np.ndarray]) -> int:
    ranks = {value.shape[0] for name, value in tensors.items() if name.endswith(".lora_a")}
    if len(ranks) != 1:
        raise AdapterExportError(f"adapter tensors have several ranks: {sorted(ranks)}")
    return ranks.pop()


def exported_arrays(blob: bytes) -> dict[str, np.ndarray]:
    """The blob's tensors as float32 arrays (numpy has no bfloat16, so through torch)."""
    import torch
    from safetensors.torch import load

    return {name: value.to(torch.float32).numpy() for name, value in load(blob).items()}


def write_lora_gguf(
    blob: bytes,
    path: Path,
    *,
    alpha_per_rank: float,
    n_head: int,
    n_head_kv: int,
) -> Path:
    """Write exported LoRA weights (``export_weights`` bytes) as a llama.cpp adapter file.

    ``alpha_per_rank`` is peft's scale (``lora_alpha / r``); llama.cpp scales by
    ``alpha / rank`` of the file, so alpha is written for the concatenated rank.
    """
    import gguf

    logging.getLogger("gguf").setLevel(logging.WARNING)  # a line per file written, otherwise
    tensors = lora_tensors(exported_arrays(blob), n_head=n_head, n_head_kv=n_head_kv)
    alpha = alpha_per_rank * adapter_rank(tensors)
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_name(f"{path.name}.partial")
    writer = gguf.GGUFWriter(str(staging), "llama")
    writer.add_type(gguf.GGUFType.ADAPTER)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(alpha))
    for name, value in tensors.items():
        writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    staging.replace(path)
    return path
