"""Build the inference engine a config names: llama_cpp (CPU default), transformers, vllm."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from coevolve.shared.config import ENGINE_KINDS, EngineKind

if TYPE_CHECKING:
    from coevolve.shared.policy.gguf_files import BaseType
    from coevolve.shared.policy.llama_engine import KvLayout
    from coevolve.shared.policy.loading import LoadedPolicy


def gguf_source(model: str | Path | None) -> Path:
    """The GGUF file the llama.cpp engine starts from (the shipped policy by default)."""
    from coevolve.shared.policy.loading import PolicyLoadError, default_gguf_path

    source = Path(model) if model is not None else default_gguf_path()
    if source.suffix != ".gguf" or not source.is_file():
        raise PolicyLoadError(
            f"the llama_cpp engine runs a GGUF policy, and {source} is not a GGUF file: "
            "set rollout.engine to transformers for a Hugging Face model"
        )
    return source


def learner_base_type() -> BaseType:
    """The llama.cpp base in the learner's dtype: bf16 where the CPU has it, f16 elsewhere."""
    import torch

    from coevolve.shared.policy.loading import pick_dtype

    return "bf16" if pick_dtype(torch.device("cpu")) == torch.bfloat16 else "f16"


def llama_cpp_engine(
    model: str | Path | None,
    *,
    run_dir: Path,
    threads: int | None = None,
    sequences: int = 8,
    tokenizer: Any = None,
    kv_layout: KvLayout = "unified",
    flash_attention: bool = False,
    base_type: BaseType | None = None,
    context_tokens: int | None = None,
) -> Any:
    """A llama.cpp engine on the float base the learner trains (bf16 where the CPU has it,
    f16 elsewhere), or on ``base_type``; ``context_tokens``: KV cells of all sequences."""
    import torch

    from coevolve.shared.policy.gguf_files import base_gguf
    from coevolve.shared.policy.llama_engine import LlamaCppEngine
    from coevolve.shared.policy.loading import LoraSettings, load_tokenizer

    source = gguf_source(model)
    lora = LoraSettings()
    return LlamaCppEngine(
        base_gguf(source, run_dir / "models", base_type or learner_base_type()),
        tokenizer if tokenizer is not None else load_tokenizer(source, run_dir=run_dir),
        lora_alpha_per_rank=lora.alpha / lora.rank,
        threads=threads or torch.get_num_threads(),
        sequences=sequences,
        kv_layout=kv_layout,
        flash_attention=flash_attention,
        context_tokens=context_tokens,
    )


def build_engine(
    kind: EngineKind,
    *,
    model: str | None = None,
    run_dir: Path,
    device: str | None = None,
    threads: int | None = None,
    sequences: int = 8,
) -> Any:
    """A fresh engine of ``kind`` on the base policy (adapters come by ``load_weights``)."""
    from coevolve.shared.policy.loading import load_policy

    if kind == "llama_cpp":
        return llama_cpp_engine(model, run_dir=run_dir, threads=threads, sequences=sequences)
    policy = load_policy(model, run_dir=run_dir, device=device)
    return engine_for_policy(kind, policy, run_dir=run_dir, threads=threads, sequences=sequences)


def engine_for_policy(
    kind: EngineKind,
    policy: LoadedPolicy,
    *,
    run_dir: Path,
    threads: int | None = None,
    sequences: int = 8,
    kv_layout: KvLayout = "unified",
    flash_attention: bool = False,
    base_type: BaseType | None = None,
    context_tokens: int | None = None,
) -> Any:
    """An engine of ``kind`` sampling what ``policy`` holds now (its adapters included);
    ``kv_layout``, ``flash_attention``, ``base_type`` and ``context_tokens`` are
    llama.cpp's (``per_sequence`` for batches of unrelated prompts)."""
    from coevolve.shared.policy.engine import TransformersEngine, VllmEngine
    from coevolve.shared.policy.loading import PolicyLoadError
    from coevolve.shared.policy.weights import export_weights, weights_kind

    if kind == "transformers":
        return TransformersEngine(policy)
    if kind == "vllm":
        return VllmEngine(policy)
    if kind != "llama_cpp":
        raise ValueError(f"unknown engine {kind!r}; choose from {', '.join(ENGINE_KINDS)}")
    engine = llama_cpp_engine(
        policy.source,
        run_dir=run_dir,
        threads=threads,
        sequences=sequences,
        tokenizer=policy.tokenizer,
        kv_layout=kv_layout,
        flash_attention=flash_attention,
        base_type=base_type,
        context_tokens=context_tokens,
    )
    if policy.finetune == "lora" and weights_kind(policy.model) == "lora":
        engine.load_weights(export_weights(policy.model), 1)
        engine.policy_version = 0
    elif policy.finetune == "full":
        raise PolicyLoadError(
            "the llama_cpp engine takes LoRA adapters, not fully fine-tuned weights: "
            "use the transformers engine"
        )
    return engine
