"""Inference engines: sample completions with their behaviour log-probs, swap weights.

Behaviour log-probs are ``log_softmax(logits / temperature)`` at the sampled token: the
temperature-scaled distribution, which is exactly what is sampled from when
``top_p == 1``. The learner recomputes ``log_softmax(logits / temperature)`` with the
same temperature (``Generation.temperature``), so the two agree up to float error.
With ``top_p < 1`` sampling draws from the nucleus-truncated distribution but the
recorded log-prob stays the untruncated one (the learner cannot reproduce truncation).
``temperature == 0`` is greedy decoding; its log-probs are those of the raw logits.
Entropy is that of the same temperature-scaled distribution, per generated token.
A stop string (``SamplingParams.stop``) ends a sequence once its text appears; the text
and the tokens keep it (a tool call's closing tag is part of the call).
"""

from __future__ import annotations

import inspect
import math
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
from transformers import PreTrainedTokenizerBase
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicCache, DynamicLayer

from coevolve.shared.policy.chat import decode_ids
from coevolve.shared.policy.loading import LoadedPolicy, base_model_of
from coevolve.shared.policy.merged_adapter import write_merged_adapter
from coevolve.shared.policy.weights import import_weights

FINISH_STOP = "stop"
FINISH_LENGTH = "length"
# why a sequence ended before its budget: a stop token, or a stop string in its text
_BY_TOKEN = "token"
_BY_STRING = "string"
_STOP_WINDOW = 16

DEFAULT_STOP_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|endoftext|>", "<end_of_turn>")


@dataclass
class SamplingParams:
    max_new_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    # end a sequence once one of these appears in its text (kept in the output)
    stop: tuple[str, ...] = ()


@dataclass
class Generation:
    """One sampled completion.

    ``completion_ids`` includes the stop token when ``finish_reason == "stop"``; ``text``
    is the decoded completion without that stop token (special tokens inside are kept).
    A sequence ended by a stop string keeps it in both (``finish_reason == "stop"``).
    ``logprobs[i]`` / ``entropies[i]`` belong to ``completion_ids[i]``.
    """

    text: str
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    entropies: list[float]
    finish_reason: str
    temperature: float = 1.0


@runtime_checkable
class Engine(Protocol):
    """What the rollout path needs from an inference engine."""

    @property
    def policy_version(self) -> int: ...

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase: ...

    @property
    def max_context(self) -> int: ...

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]: ...

    def load_weights(self, blob: bytes, version: int) -> None: ...


@runtime_checkable
class TokenScorer(Protocol):
    """An engine that also scores given tokens teacher-forced (the eval's likelihood)."""

    def token_logprobs(
        self, sequences: list[list[int]], positions: list[list[int]]
    ) -> list[list[float] | None]: ...


def stop_token_ids(tokenizer: PreTrainedTokenizerBase, model: Any | None = None) -> set[int]:
    """EOS ids of the tokenizer and generation config, plus known end-of-turn tokens."""
    ids: set[int] = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    config_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if isinstance(config_eos, int):
        ids.add(config_eos)
    elif isinstance(config_eos, list):
        ids.update(int(i) for i in config_eos)
    vocab = tokenizer.get_vocab()
    ids.update(vocab[token] for token in DEFAULT_STOP_TOKENS if token in vocab)
    return ids


def left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask), both [batch, longest], padded on the left."""
    longest = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), longest), pad_id, dtype=torch.long)
    attention = torch.zeros((len(prompts), longest), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        if prompt:
            input_ids[row, longest - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
            attention[row, longest - len(prompt) :] = 1
    return input_ids, attention


def nucleus_probs(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """``probs`` with everything outside the top-p nucleus zeroed (not renormalized)."""
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    before = sorted_probs.cumsum(dim=-1) - sorted_probs
    sorted_probs = sorted_probs.masked_fill(before >= top_p, 0.0)
    return torch.zeros_like(probs).scatter(-1, order, sorted_probs)


def common_prefix_length(prompts: list[list[int]]) -> int:
    first = prompts[0]
    length = min(len(p) for p in prompts)
    for other in prompts[1:]:
        index = 0
        while index < length and other[index] == first[index]:
            index += 1
        length = index
    return length


def token_budget(prompts: list[list[int]], params: SamplingParams, max_context: int) -> int:
    """New tokens every prompt may take: ``max_new_tokens`` within the context."""
    if any(not prompt for prompt in prompts):
        raise ValueError("every prompt needs at least one token")
    longest = max(len(p) for p in prompts)
    budget = min(params.max_new_tokens, max_context - longest)
    if budget <= 0:
        raise ValueError(
            f"prompt of {longest} tokens leaves no room under the context of {max_context} tokens"
        )
    return budget


def ends_with_stop_string(
    tokenizer: PreTrainedTokenizerBase, tokens: list[int], stops: tuple[str, ...]
) -> bool:
    # a stop string ends the sequence the moment it is complete, so it can only sit in
    # the last few tokens
    tail = decode_ids(tokenizer, tokens[-_STOP_WINDOW:])
    return any(stop in tail for stop in stops)


@dataclass
class EngineStats:
    """Counters since the engine was made (for benchmarks and service metrics)."""

    calls: int = 0
    generated_tokens: int = 0
    prefix_prefilled_tokens: int = 0
    prefix_reused_tokens: int = 0
    suffix_prefilled_tokens: int = 0


LayersKV = list[tuple[torch.Tensor, torch.Tensor]]
"""Each layer's (keys, values), ``[batch, heads, tokens, dim]``."""


class _SlotLayer(CacheLayerMixin):
    """One layer's keys and values in storage allocated once per call, written in place.

    The storage is ``[rows, heads, capacity, dim]``; ``update`` copies the new tokens into
    the next free slots and hands attention views of the filled part, so a generated token
    costs no copy of the cache (a dynamic cache concatenates the whole of it per token).
    """

    is_sliding = False

    def __init__(self, capacity: int) -> None:
        super().__init__()
        self.capacity = capacity
        self.filled = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self._allocate(key_states.shape[0], key_states, value_states)

    def _allocate(self, rows: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        # never read past ``filled``, so the slots need no zeroing
        self._keys = keys.new_empty((rows, keys.shape[1], self.capacity, keys.shape[-1]))
        self._values = values.new_empty((rows, values.shape[1], self.capacity, values.shape[-1]))
        self.device = keys.device
        self.is_initialized = True
        self._expose()

    def _expose(self) -> None:
        self.keys = self._keys[:, :, : self.filled]
        self.values = self._values[:, :, : self.filled]

    def seed(self, keys: torch.Tensor, values: torch.Tensor, rows: int) -> None:
        """Allocate ``rows`` rows and copy a batch-1 prefix ``[1, heads, n, dim]`` into each."""
        self._allocate(rows, keys, values)
        length = keys.shape[-2]
        self._keys[:, :, :length].copy_(keys.expand(rows, -1, -1, -1))
        self._values[:, :, :length].copy_(values.expand(rows, -1, -1, -1))
        self.filled = length
        self._expose()

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.filled + key_states.shape[-2]
        if end > self.capacity:
            raise RuntimeError(f"KV cache of {self.capacity} slots cannot take {end} tokens")
        self._keys[:, :, self.filled : end].copy_(key_states)
        self._values[:, :, self.filled : end].copy_(value_states)
        self.filled = end
        self._expose()
        return self._keys[:, :, :end], self._values[:, :, :end]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.filled + query_length, 0

    def get_seq_length(self) -> int:
        return self.filled

    def get_max_length(self) -> int:
        return self.capacity

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep the rows ``indices`` (ascending), moved down in place to rows 0..k-1."""
        if not self.is_initialized:
            return
        for target, source in enumerate(indices.tolist()):
            if target != source:  # target < source: a row is read before it is overwritten
                self._keys[target, :, : self.filled].copy_(self._keys[source, :, : self.filled])
                self._values[target, :, : self.filled].copy_(self._values[source, :, : self.filled])
        self._keys, self._values = self._keys[: len(indices)], self._values[: len(indices)]
        self._expose()


def slot_cache(layers: int, capacity: int) -> Cache:
    """A cache of ``layers`` in-place layers of ``capacity`` tokens (allocated on first use)."""
    return Cache(layers=[_SlotLayer(capacity) for _ in range(layers)])


def seeded_cache(prefix: LayersKV, rows: int, capacity: int) -> Cache:
    """A cache of ``rows`` rows that all start with the batch-1 ``prefix``'s keys and values."""
    cache = slot_cache(len(prefix), capacity)
    for layer, (keys, values) in zip(cache.layers, prefix, strict=True):
        assert isinstance(layer, _SlotLayer)
        layer.seed(keys, values, rows)
    return cache


def cached_kv(cache: Cache) -> LayersKV:
    """Each layer's (keys, values) of a slot cache."""
    kv = []
    for layer in cache.layers:
        assert isinstance(layer, _SlotLayer) and layer.keys is not None
        assert layer.values is not None
        kv.append((layer.keys, layer.values))
    return kv


def plain_attention_layers(model: Any) -> int:
    """How many layers ``model`` has when all are plain full attention, else 0.

    Only those fit ``_SlotLayer``; the library's dynamic cache knows the others (sliding
    windows, shared or linear layers), so they keep it.
    """
    layers = DynamicCache(config=base_model_of(model).config).layers
    plain = bool(layers) and all(type(layer) is DynamicLayer for layer in layers)
    return len(layers) if plain else 0


def cache_argument(model: Any) -> str:
    """The forward argument that takes the KV cache (``past_key_values`` before 5.x's ``cache``)."""
    parameters = inspect.signature(base_model_of(model).forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


@dataclass
class _PrefixCache:
    ids: tuple[int, ...]
    # per layer (keys, values) at batch size 1; read only: rows copy it into their slots
    kv: LayersKV
    weights_version: tuple[int, ...]


@dataclass
class _Batch:
    tokens: list[list[int]] = field(default_factory=list)
    logprobs: list[list[float]] = field(default_factory=list)
    entropies: list[list[float]] = field(default_factory=list)


class _PolicyEngine:
    """What an engine that samples a loaded policy knows of it."""

    policy: LoadedPolicy

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        return self.policy.tokenizer

    @property
    def max_context(self) -> int:
        config = base_model_of(self.policy.model).config
        return int(getattr(config, "max_position_embeddings", 0) or 2048)


class TransformersEngine(_PolicyEngine):
    """In-process engine over a loaded policy: batched, left-padded, KV-cached sampling.

    Prompts of one call usually share a long prefix (system prompt with the tool schemas,
    the task's first user message): the K episodes of a group start identical. That prefix
    is run through the model once at batch size 1 and its KV cache is copied to every
    row; only the rows' own suffixes are prefilled per row. The prefix cache is kept for
    the next call (the next turn of the same group) and dropped when the weights change
    (``load_weights``, or in-place training of the model, seen through the parameters'
    version counters). Finished rows leave the batch (and the KV cache) at once.

    The rows' KV cache is allocated once per call for the prompt and the whole budget and
    written in place (``_SlotLayer``): the prefix is copied into every row's first slots,
    each step writes one token, and no step copies the cache.
    """

    def __init__(
        self,
        policy: LoadedPolicy,
        *,
        stop_tokens: set[int] | None = None,
        share_prefix: bool = True,
        min_shared_prefix: int = 32,
    ) -> None:
        self.policy = policy
        self.policy_version = 0
        self.share_prefix = share_prefix
        self.min_shared_prefix = max(1, min_shared_prefix)
        self._stop_ids = stop_tokens or stop_token_ids(policy.tokenizer, policy.model)
        pad = policy.tokenizer.pad_token_id
        self._pad_id = int(pad if pad is not None else next(iter(self._stop_ids)))
        self._prefix: _PrefixCache | None = None
        self._slot_layers = plain_attention_layers(policy.model)
        self._cache_argument = cache_argument(policy.model)
        self.stats = EngineStats()

    @property
    def stop_ids(self) -> set[int]:
        return set(self._stop_ids)

    def load_weights(self, blob: bytes, version: int) -> None:
        """Hot swap: load exported trainable weights; call between episodes."""
        import_weights(self.policy.model, blob)
        self._prefix = None
        self.policy_version = version

    def clear_cache(self) -> None:
        self._prefix = None

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        if not prompts:
            return []
        budget = token_budget(prompts, params, self.max_context)
        model = self.policy.model
        was_training = model.training
        model.eval()
        try:
            with torch.inference_mode():
                batch, finished = self._sample(prompts, params, budget)
        finally:
            model.train(was_training)
        results = []
        for row, prompt in enumerate(prompts):
            tokens = batch.tokens[row]
            stopped = finished[row]
            body = tokens[:-1] if stopped == _BY_TOKEN else tokens
            text = decode_ids(self.tokenizer, body)
            results.append(
                Generation(
                    text=text,
                    prompt_ids=list(prompt),
                    completion_ids=tokens,
                    logprobs=batch.logprobs[row],
                    entropies=batch.entropies[row],
                    finish_reason=FINISH_STOP if stopped else FINISH_LENGTH,
                    temperature=params.temperature,
                )
            )
        self.stats.calls += 1
        self.stats.generated_tokens += sum(len(t) for t in batch.tokens)
        return results

    def _weights_version(self) -> tuple[int, ...]:
        params = [p for p in self.policy.model.parameters() if p.requires_grad]
        return tuple(int(p._version) for p in params)

    def _shared_prefix(self, prompts: list[list[int]]) -> tuple[int, LayersKV | None]:
        """(length, per-layer KV at batch size 1) of the prefix all prompts share, or (0, None).

        The prefix stops one token short of the shortest prompt: every row needs at least
        one token of its own to produce the logits of its first sampled token.
        """
        if not self.share_prefix or not self._slot_layers:
            return 0, None
        shared = min(common_prefix_length(prompts), min(len(p) for p in prompts) - 1)
        if shared < self.min_shared_prefix:
            return 0, None
        first = prompts[0]
        version = self._weights_version()
        start, past = 0, None
        kept = self._prefix
        if (
            kept is not None
            and kept.weights_version == version
            and len(kept.ids) <= shared
            and tuple(first[: len(kept.ids)]) == kept.ids
        ):
            start, past = len(kept.ids), kept.kv
            self.stats.prefix_reused_tokens += start
        if shared == start:
            return shared, past
        # the kept prefix is read, never written: its extension goes to a new batch-1 cache
        if past is None:
            cache = slot_cache(self._slot_layers, shared)
        else:
            cache = seeded_cache(past, 1, shared)
        device = self.policy.device
        self._forward(
            cache,
            input_ids=torch.tensor([first[start:shared]], device=device),
            attention_mask=torch.ones((1, shared), dtype=torch.long, device=device),
            position_ids=torch.arange(start, shared, device=device).unsqueeze(0),
            logits_to_keep=1,
        )
        kv = cached_kv(cache)
        self._prefix = _PrefixCache(tuple(first[:shared]), kv, version)
        self.stats.prefix_prefilled_tokens += shared - start
        return shared, kv

    def _row_cache(self, rows: int, capacity: int, prefix: LayersKV | None) -> Cache:
        if not self._slot_layers:
            return DynamicCache(config=base_model_of(self.policy.model).config)
        if prefix is None:
            return slot_cache(self._slot_layers, capacity)
        return seeded_cache(prefix, rows, capacity)

    def _forward(self, cache: Cache, **inputs: Any) -> Any:
        return self.policy.model(**inputs, **{self._cache_argument: cache}, use_cache=True)

    def _sample(
        self, prompts: list[list[int]], params: SamplingParams, budget: int
    ) -> tuple[_Batch, list[str]]:
        device = self.policy.device
        shared, prefix = self._shared_prefix(prompts)
        suffix_ids, suffix_mask = left_pad([p[shared:] for p in prompts], self._pad_id)
        suffix_ids, suffix_mask = suffix_ids.to(device), suffix_mask.to(device)
        positions = shared + (suffix_mask.cumsum(-1) - 1).clamp(min=0)
        attention = torch.cat([suffix_mask.new_ones((len(prompts), shared)), suffix_mask], dim=1)
        # every token a row will hold: its prompt and the budget (the last is never fed)
        cache = self._row_cache(len(prompts), attention.shape[1] + budget, prefix)
        self.stats.suffix_prefilled_tokens += int(suffix_mask.sum())
        generator = torch.Generator(device=device)
        generator.manual_seed(params.seed if params.seed is not None else random.getrandbits(63))
        stop = torch.tensor(sorted(self._stop_ids), device=device)
        batch = _Batch(
            tokens=[[] for _ in prompts],
            logprobs=[[] for _ in prompts],
            entropies=[[] for _ in prompts],
        )
        finished = [""] * len(prompts)  # "", _BY_TOKEN or _BY_STRING
        rows = list(range(len(prompts)))  # original index of each row still sampling

        # Only the last position's logits are needed: full prompt logits would be
        # batch x length x vocab floats (gigabytes for long tool prompts).
        out = self._forward(
            cache,
            input_ids=suffix_ids,
            attention_mask=attention,
            position_ids=positions,
            logits_to_keep=1,
        )
        position = positions[:, -1:]
        for step in range(budget):
            logits = out.logits[:, -1, :].float()
            token, logprob, entropy = self._choose(logits, params, generator)
            stopped = torch.isin(token, stop)
            for index, (row, t, lp, h, s) in enumerate(
                zip(
                    rows,
                    token.tolist(),
                    logprob.tolist(),
                    entropy.tolist(),
                    stopped.tolist(),
                    strict=True,
                )
            ):
                batch.tokens[row].append(int(t))
                batch.logprobs[row].append(float(lp))
                batch.entropies[row].append(float(h))
                if s:
                    finished[row] = _BY_TOKEN
                elif params.stop and ends_with_stop_string(
                    self.tokenizer, batch.tokens[row], params.stop
                ):
                    finished[row] = _BY_STRING
                    stopped[index] = True
            if step + 1 == budget or bool(stopped.all()):
                break
            if bool(stopped.any()):
                # Drop finished rows from the batch (and the KV cache) so the remaining
                # steps cost only what the still-running sequences need.
                keep = (~stopped).nonzero().squeeze(1)
                cache.batch_select_indices(keep)
                attention, position, token = attention[keep], position[keep], token[keep]
                rows = [rows[i] for i in keep.tolist()]
            attention = torch.cat([attention, attention.new_ones((len(rows), 1))], dim=1)
            position = position + 1
            out = self._forward(
                cache, input_ids=token.unsqueeze(1), attention_mask=attention, position_ids=position
            )
        return batch, finished

    @staticmethod
    def _choose(
        logits: torch.Tensor, params: SamplingParams, generator: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        greedy = params.temperature <= 0.0
        scaled = logits if greedy else logits / params.temperature
        logp = torch.log_softmax(scaled, dim=-1)
        probs = logp.exp()
        entropy = -(probs * logp).nan_to_num().sum(-1)
        if greedy:
            token = scaled.argmax(dim=-1)
        else:
            sample_from = probs if params.top_p >= 1.0 else nucleus_probs(probs, params.top_p)
            token = torch.multinomial(sample_from, 1, generator=generator).squeeze(1)
        logprob = logp.gather(1, token.unsqueeze(1)).squeeze(1)
        return token, logprob, entropy


class VllmEngine(_PolicyEngine):
    """vLLM engine (GPU) behind the same interface; vllm is imported only when built.

    LoRA versions are hot-swapped without reloading the model: the version's adapter stack
    (warm start + GRPO) is written as one peft adapter (``merged_adapter``) and named in a
    new ``LoRARequest``, vLLM's run-time LoRA API; full weights are pushed into the
    workers' model. The rollout service checks the weights' digest before this is called.
    Log-probs are requested in vLLM's ``processed_logprobs`` mode (after temperature), matching
    ``TransformersEngine``; entropy is estimated from the top ``entropy_top_k``
    log-probs vLLM returns (a lower bound of the true entropy).
    """

    def __init__(
        self,
        policy: LoadedPolicy,
        *,
        gpu_memory_utilization: float = 0.5,
        max_model_len: int | None = None,
        entropy_top_k: int = 20,
        adapter_dir: str | None = None,
    ) -> None:
        try:
            import vllm
        except ImportError as exc:
            raise RuntimeError("VllmEngine needs vllm (pip install 'coevolve[gpu]')") from exc
        import tempfile

        self.policy = policy
        self.policy_version = 0
        self._vllm = vllm
        self._entropy_top_k = entropy_top_k
        self._adapter_root = adapter_dir or tempfile.mkdtemp(prefix="coevolve-lora-")
        self._lora_request: Any = None
        location = str(policy.cache_dir) if policy.cache_dir is not None else policy.source
        lora = policy.finetune == "lora" and policy.lora is not None
        self._llm = vllm.LLM(
            model=location,
            tokenizer=location,
            enable_lora=lora,
            # the merged stack of the warm-start and GRPO adapters has twice their rank
            max_lora_rank=2 * policy.lora.rank if (lora and policy.lora) else 16,
            gpu_memory_utilization=gpu_memory_utilization,
            max_model_len=max_model_len or self.max_context,
            max_logprobs=max(entropy_top_k, 1),
            logprobs_mode="processed_logprobs",
        )

    def load_weights(self, blob: bytes, version: int) -> None:
        import_weights(self.policy.model, blob)
        if self.policy.finetune == "lora":
            from vllm.lora.request import LoRARequest

            target = write_merged_adapter(
                self.policy.model, Path(self._adapter_root) / f"v{version}"
            )
            self._lora_request = LoRARequest(f"policy-v{version}", version + 1, str(target))
        else:
            base = base_model_of(self.policy.model)
            state = [(n, p.detach()) for n, p in base.named_parameters()]

            def push(worker: Any) -> None:
                worker.model_runner.model.load_weights(weights=state)

            self._llm.collective_rpc(push)
        self.policy_version = version

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        sampling = self._vllm.SamplingParams(
            max_tokens=params.max_new_tokens,
            temperature=params.temperature,
            top_p=params.top_p,
            seed=params.seed,
            logprobs=self._entropy_top_k,
            stop=list(params.stop) or None,
            include_stop_str_in_output=True,
        )
        inputs = [{"prompt_token_ids": prompt} for prompt in prompts]
        outputs = self._llm.generate(inputs, sampling, lora_request=self._lora_request)
        results = []
        for prompt, output in zip(prompts, outputs, strict=True):
            sample = output.outputs[0]
            tokens = list(sample.token_ids)
            logprobs: list[float] = []
            entropies: list[float] = []
            for token, top in zip(tokens, sample.logprobs or [], strict=False):
                logprobs.append(float(top[token].logprob))
                values = [float(entry.logprob) for entry in top.values()]
                entropies.append(-sum(math.exp(v) * v for v in values))
            results.append(
                Generation(
                    text=sample.text,
                    prompt_ids=list(prompt),
                    completion_ids=tokens,
                    logprobs=logprobs,
                    entropies=entropies,
                    finish_reason=FINISH_STOP if sample.finish_reason == "stop" else FINISH_LENGTH,
                    temperature=params.temperature,
                )
            )
        return results
