"""An in-process transformers model as an LLM backend, with grammar-constrained JSON.

With a schema, decoding goes through xgrammar's logits processor: every sampled token
keeps the text a prefix of a document the schema accepts, so the output always parses
unless ``max_tokens`` cuts it off (finish_reason ``"length"``). Schemas are compiled
without free whitespace, or a small model pads the JSON with spaces until it runs out of
tokens. Generation runs in a worker thread, one call at a time per backend, so the event
loop of the service stays responsive.
"""

from __future__ import annotations

import asyncio
import json
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from coevolve.shared.llm.client import (
    ChatMessages,
    LLMOutputError,
    LLMResponse,
    parse_json_or_none,
)


@dataclass
class LoadedModel:
    model: Any
    tokenizer: Any
    name: str
    device: str


def load_model(
    model: str | None = None, device: str | None = None, run_dir: Path | None = None
) -> LoadedModel:
    """The model through the policy loader (frozen, no adapters), so the roles' default
    model is the policy's base model and shares its converted-weights cache in
    ``run_dir``."""
    from coevolve.shared.policy import load_policy

    policy = load_policy(model, device=device, finetune="none", run_dir=run_dir)
    return LoadedModel(policy.model, policy.tokenizer, policy.name, str(policy.device))


class LocalBackend:
    """An :class:`~coevolve.shared.llm.client.LLMClient` running a model in this process.

    The model loads on first use (in the worker thread) unless ``loaded`` is given.
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        device: str | None = None,
        run_dir: Path | None = None,
        loaded: LoadedModel | None = None,
        grammar_threads: int = 1,
    ) -> None:
        self.model_ref = model
        self.device = device
        self.run_dir = run_dir
        self.name = f"local:{model or 'default'}"
        self._loaded = loaded
        self._grammar_threads = grammar_threads
        self._compiler: Any = None
        self._grammars: dict[str, Any] = {}
        self._load_lock = threading.Lock()
        self._call_lock = asyncio.Lock()

    async def chat(
        self,
        messages: ChatMessages,
        *,
        schema: dict[str, Any] | None = None,
        max_tokens: int,
        temperature: float,
    ) -> LLMResponse:
        async with self._call_lock:
            return await asyncio.to_thread(self.generate, messages, schema, max_tokens, temperature)

    async def aclose(self) -> None:
        self._grammars.clear()

    def loaded(self) -> LoadedModel:
        with self._load_lock:
            if self._loaded is None:
                self._loaded = load_model(self.model_ref, self.device, self.run_dir)
                self.name = f"local:{self._loaded.name}"
            return self._loaded

    def generate(
        self,
        messages: ChatMessages,
        schema: dict[str, Any] | None,
        max_tokens: int,
        temperature: float,
    ) -> LLMResponse:
        """Blocking generation (what :meth:`chat` runs in a thread)."""
        import torch

        loaded = self.loaded()
        tokenizer, net = loaded.tokenizer, loaded.model
        prompt = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
        )
        input_ids = prompt["input_ids"].to(net.device)
        limit = int(getattr(net.config, "max_position_embeddings", 0) or 0)
        if limit and input_ids.shape[1] + max_tokens > limit:
            raise LLMOutputError(
                f"prompt of {input_ids.shape[1]} tokens + {max_tokens} new exceeds the "
                f"model's {limit}-token context",
                "prompt_too_long",
            )
        processors = [self._logits_processor(schema)] if schema is not None else []
        stops = self._stop_ids(net, tokenizer)
        sampling: dict[str, Any] = (
            {"do_sample": True, "temperature": temperature, "top_p": 1.0, "top_k": 0}
            if temperature > 0
            else {"do_sample": False}
        )
        with torch.inference_mode():
            output = net.generate(
                input_ids=input_ids,
                attention_mask=prompt["attention_mask"].to(net.device),
                max_new_tokens=max_tokens,
                logits_processor=processors,
                eos_token_id=sorted(stops),
                pad_token_id=tokenizer.pad_token_id,
                **sampling,
            )
        completion = output[0, input_ids.shape[1] :].tolist()
        stopped = bool(completion) and completion[-1] in stops
        text = tokenizer.decode(completion, skip_special_tokens=True)
        return LLMResponse(
            text=text,
            parsed=parse_json_or_none(text) if schema is not None else None,
            finish_reason="stop" if stopped or len(completion) < max_tokens else "length",
            model=loaded.name,
            prompt_tokens=int(input_ids.shape[1]),
            completion_tokens=len(completion),
        )

    def _logits_processor(self, schema: dict[str, Any]) -> Any:
        from xgrammar.contrib.hf import LogitsProcessor

        # A processor keeps per-call matcher state, so each generate gets a fresh one;
        # the compiled grammar is what is worth caching.
        return LogitsProcessor(self._compiled(schema))

    def _compiled(self, schema: dict[str, Any]) -> Any:
        import xgrammar as xgr

        # Property order is the order the model must write fields in: keep it.
        key = json.dumps(schema)
        grammar = self._grammars.get(key)
        if grammar is None:
            if self._compiler is None:
                loaded = self.loaded()
                info = xgr.TokenizerInfo.from_huggingface(
                    loaded.tokenizer,
                    vocab_size=_logits_width(loaded.model),
                    stop_token_ids=sorted(self._stop_ids(loaded.model, loaded.tokenizer)),
                )
                self._compiler = xgr.GrammarCompiler(info, max_threads=self._grammar_threads)
            grammar = self._compiler.compile_json_schema(
                key, any_whitespace=False, separators=(",", ":")
            )
            self._grammars[key] = grammar
        return grammar

    @staticmethod
    def _stop_ids(net: Any, tokenizer: Any) -> set[int]:
        from coevolve.shared.policy import stop_token_ids

        return stop_token_ids(tokenizer, net)


def _logits_width(net: Any) -> int:
    head = net.get_output_embeddings()
    if head is not None and hasattr(head, "weight"):
        return int(head.weight.shape[0])
    return int(net.config.vocab_size)
