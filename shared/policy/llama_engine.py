"""The llama.cpp engine (CPU): batched sampling with hot-swapped LoRA adapters.

One model and one context hold up to ``sequences`` KV sequences. A call's prompts each
take the sequence whose cached tokens share the longest prefix with it (an episode's next
step finds its own history and prefills only the new tokens); a prefix that several
prompts share is prefilled once and copied to the others' sequences (eval's batches of
one entry's turns share their tools and conversation). All sequences then decode in one
batch per token.

The KV layout suits the calls: ``unified`` (rollout's groups) keeps every sequence in one
cache, so a copied prefix shares its cells, but each token attends over every sequence's
cells (masked); ``per_sequence`` (eval's batches of unrelated tasks) gives each sequence
its own cache, so attention covers only its own history and a copied prefix is
duplicated.

Sampling, behaviour log-probs and entropies come from each sequence's logits exactly as
in ``TransformersEngine`` (``log_softmax(logits / temperature)``), so the learner's
recomputed log-probs match them up to the two engines' float error. Each policy version
is written as a GGUF LoRA adapter and swapped in between calls (tens of milliseconds);
the KV cache is cleared with it. llama-cpp-python's low-level API is used because its
``Llama`` class and servers take adapters only when the model is loaded.
"""

from __future__ import annotations

import ctypes
import random
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
from transformers import PreTrainedTokenizerBase

from coevolve.shared.policy.chat import decode_ids
from coevolve.shared.policy.engine import (
    FINISH_LENGTH,
    FINISH_STOP,
    EngineStats,
    Generation,
    SamplingParams,
    common_prefix_length,
    ends_with_stop_string,
    stop_token_ids,
    token_budget,
)
from coevolve.shared.policy.gguf_files import llama_library, write_lora_gguf

KvLayout = Literal["unified", "per_sequence"]
KV_LAYOUTS: tuple[KvLayout, ...] = ("unified", "per_sequence")
UNIFIED_CONTEXT_TOKENS = 16384
PER_SEQUENCE_CONTEXT_TOKENS = 4096


class LlamaCppError(RuntimeError):
    """llama.cpp refused a model, an adapter or a batch."""


class GenerationInterrupted(RuntimeError):
    """``interrupt()`` was called while a generation ran; its partial output is dropped."""


@dataclass
class _Slot:
    """One KV sequence and the tokens it holds (positions 0..len-1)."""

    seq: int
    tokens: list[int]


class LlamaCppEngine:
    """``Engine`` over llama.cpp with a float GGUF base and LoRA adapters as GGUF files."""

    def __init__(
        self,
        model_path: Path,
        tokenizer: PreTrainedTokenizerBase,
        *,
        lora_alpha_per_rank: float = 2.0,
        threads: int = 1,
        sequences: int = 8,
        kv_layout: KvLayout = "unified",
        flash_attention: bool = False,
        context_tokens: int | None = None,
        batch_tokens: int = 512,
        min_shared_prefix: int = 32,
        adapter_dir: Path | None = None,
    ) -> None:
        """``context_tokens``: the KV cells of all sequences together (by default 16,384
        unified, or 4,096 per sequence)."""
        if kv_layout not in KV_LAYOUTS:
            raise ValueError(f"unknown KV layout {kv_layout!r}; choose from {KV_LAYOUTS}")
        if context_tokens is None:
            context_tokens = (
                UNIFIED_CONTEXT_TOKENS
                if kv_layout == "unified"
                else PER_SEQUENCE_CONTEXT_TOKENS * sequences
            )
        lib = llama_library()
        self._lib = lib
        self.policy_version = 0
        self._tokenizer = tokenizer
        self._alpha_per_rank = lora_alpha_per_rank
        self.sequences = sequences
        self.min_shared_prefix = max(1, min_shared_prefix)
        self._batch_tokens = batch_tokens
        self.kv_layout = kv_layout
        self._stop_ids = stop_token_ids(tokenizer)
        self._interrupt = threading.Event()
        self._adapter: Any = None
        self._adapter_dir = adapter_dir or Path(tempfile.mkdtemp(prefix="coevolve-gguf-lora-"))
        self.stats = EngineStats()
        self.model_path = model_path

        model_params = lib.llama_model_default_params()
        self._model = lib.llama_model_load_from_file(str(model_path).encode(), model_params)
        if not self._model:
            raise LlamaCppError(f"llama.cpp could not load {model_path}")
        vocab = lib.llama_model_get_vocab(self._model)
        self._n_vocab = int(lib.llama_vocab_n_tokens(vocab))
        self._n_head = int(lib.llama_model_n_head(self._model))
        self._n_head_kv = int(lib.llama_model_n_head_kv(self._model))
        sequence_tokens = context_tokens if kv_layout == "unified" else context_tokens // sequences
        self._max_context = min(int(lib.llama_model_n_ctx_train(self._model)), sequence_tokens)

        context_params = lib.llama_context_default_params()
        context_params.n_ctx = context_tokens
        context_params.n_batch = batch_tokens
        context_params.n_ubatch = batch_tokens
        context_params.n_seq_max = sequences
        context_params.n_threads = threads
        context_params.n_threads_batch = threads
        context_params.kv_unified = kv_layout == "unified"
        # off by default: on CPU it decoded groups slower (`coevolve bench kv_layout`)
        context_params.flash_attn_type = (
            lib.LLAMA_FLASH_ATTN_TYPE_ENABLED
            if flash_attention
            else lib.LLAMA_FLASH_ATTN_TYPE_DISABLED
        )
        context_params.no_perf = True
        self._ctx = lib.llama_init_from_model(self._model, context_params)
        if not self._ctx:
            lib.llama_model_free(self._model)
            raise LlamaCppError(f"llama.cpp could not make a context of {context_tokens} tokens")
        self._memory = lib.llama_get_memory(self._ctx)
        self._batch = lib.llama_batch_init(batch_tokens, 0, sequences)
        self._slots = [_Slot(seq, []) for seq in range(sequences)]

    # -- Engine interface -------------------------------------------------------------

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        return self._tokenizer

    @property
    def max_context(self) -> int:
        return self._max_context

    @property
    def stop_ids(self) -> set[int]:
        return set(self._stop_ids)

    def load_weights(self, blob: bytes, version: int) -> None:
        """Hot swap: write the exported LoRA weights as a GGUF adapter and apply it."""
        path = write_lora_gguf(
            blob,
            self._adapter_dir / f"policy-v{version}.gguf",
            alpha_per_rank=self._alpha_per_rank,
            n_head=self._n_head,
            n_head_kv=self._n_head_kv,
        )
        adapter = self._lib.llama_adapter_lora_init(self._model, str(path).encode())
        if not adapter:
            raise LlamaCppError(
                f"llama.cpp refused adapter {path.name} (does it fit {self.model_path.name}?)"
            )
        self._apply_adapter(adapter)
        self.policy_version = version
        path.unlink(missing_ok=True)

    def clear_cache(self) -> None:
        self._lib.llama_memory_clear(self._memory, True)
        for slot in self._slots:
            slot.tokens = []

    def interrupt(self) -> None:
        """Make a running ``generate`` raise ``GenerationInterrupted`` at its next token."""
        self._interrupt.set()

    def close(self) -> None:
        lib = self._lib
        if self._ctx:
            lib.llama_batch_free(self._batch)
            lib.llama_free(self._ctx)
            self._ctx = None
        if self._adapter:
            lib.llama_adapter_lora_free(self._adapter)
            self._adapter = None
        if self._model:
            lib.llama_model_free(self._model)
            self._model = None

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        if not prompts:
            return []
        budget = token_budget(prompts, params, self.max_context)
        self._interrupt.clear()
        seed = params.seed if params.seed is not None else random.getrandbits(63)
        rng = np.random.default_rng(seed)
        results: list[Generation] = []
        for start in range(0, len(prompts), self.sequences):
            results.extend(
                self._generate_chunk(prompts[start : start + self.sequences], params, budget, rng)
            )
        self.stats.calls += 1
        self.stats.generated_tokens += sum(len(g.completion_ids) for g in results)
        return results

    def token_logprobs(
        self, sequences: list[list[int]], positions: list[list[int]]
    ) -> list[list[float] | None]:
        """Teacher-forced log-probs at temperature 1 of ``sequences[i][p]`` for each ``p``
        in ``positions[i]`` (p >= 1), the sequences batched and their prefixes shared as
        in ``generate``; None for a sequence longer than a sequence's context."""
        for sequence, wanted in zip(sequences, positions, strict=True):
            if not wanted or min(wanted) < 1 or max(wanted) >= len(sequence):
                raise ValueError(f"positions must lie in 1..{len(sequence) - 1}: {wanted[:5]}")
        self._interrupt.clear()
        results: list[list[float] | None] = [None] * len(sequences)
        fitting = [
            row for row, sequence in enumerate(sequences) if len(sequence) <= self.max_context
        ]
        for start in range(0, len(fitting), self.sequences):
            rows = fitting[start : start + self.sequences]
            scores = self._score_chunk([sequences[r] for r in rows], [positions[r] for r in rows])
            for row, row_scores in zip(rows, scores, strict=True):
                results[row] = row_scores
        return results

    # -- internals --------------------------------------------------------------------

    def _apply_adapter(self, adapter: Any) -> None:
        lib = self._lib
        adapters = (lib.llama_adapter_lora_p_ctypes * 1)(adapter)
        scales = (ctypes.c_float * 1)(1.0)
        if lib.llama_set_adapters_lora(self._ctx, adapters, 1, scales) != 0:
            lib.llama_adapter_lora_free(adapter)
            raise LlamaCppError("llama.cpp could not apply the adapter")
        if self._adapter:
            lib.llama_adapter_lora_free(self._adapter)
        self._adapter = adapter
        self.clear_cache()

    def _assign_slots(self, prompts: list[list[int]]) -> list[_Slot]:
        """Each prompt's slot: the free one with the longest cached prefix of it."""
        free = list(self._slots)
        chosen: list[_Slot | None] = [None] * len(prompts)
        pairs = sorted(
            (
                (-common_prefix_length([slot.tokens, prompt]) if slot.tokens else 0, row, slot.seq)
                for row, prompt in enumerate(prompts)
                for slot in free
            )
        )
        taken: set[int] = set()
        for _, row, seq in pairs:
            if chosen[row] is None and seq not in taken:
                chosen[row] = self._slots[seq]
                taken.add(seq)
        for slot in self._slots:
            if slot.seq not in taken and slot.tokens:
                self._lib.llama_memory_seq_rm(self._memory, slot.seq, -1, -1)
                slot.tokens = []
        return [slot for slot in chosen if slot is not None]

    def _trim(self, slot: _Slot, keep: int) -> None:
        if keep < len(slot.tokens):
            self._lib.llama_memory_seq_rm(self._memory, slot.seq, keep, -1)
            slot.tokens = slot.tokens[:keep]

    def _place(self, prompts: list[list[int]], ready: list[int]) -> tuple[list[_Slot], list[int]]:
        """Each prompt's slot and how many of its tokens it holds: what its cache and the
        prefixes it shares give, never past ``ready[row]`` tokens (the rest is prefilled for
        its logits)."""
        slots = self._assign_slots(prompts)
        cached = []
        for prompt, slot, limit in zip(prompts, slots, ready, strict=True):
            keep = min(common_prefix_length([slot.tokens, prompt]) if slot.tokens else 0, limit)
            self._trim(slot, keep)
            cached.append(keep)
        self.stats.prefix_reused_tokens += sum(cached)
        self._share_prefixes(
            [prompt[: limit + 1] for prompt, limit in zip(prompts, ready, strict=True)],
            slots,
            cached,
        )
        return slots, cached

    def _share_prefixes(
        self, prompts: list[list[int]], slots: list[_Slot], cached: list[int]
    ) -> None:
        """Prefill each prefix that prompts share once and copy it to the prompts sharing it.

        In sorted order a prompt shares its longest prefix with an earlier prompt with its
        predecessor, so each prompt copies that much of its predecessor's cache, and first
        prefills alone the part its successor will copy from it. The rest of every prompt
        is left to the batched prefill.
        """
        if len(prompts) < 2:
            return
        order = sorted(range(len(prompts)), key=lambda row: prompts[row])
        # shared[i]: what order[i] can copy from order[i - 1], never a whole prompt (the
        # last token is prefilled in the batch, for its logits)
        shared = [0] * (len(order) + 1)
        for i in range(1, len(order)):
            a, b = prompts[order[i - 1]], prompts[order[i]]
            shared[i] = min(common_prefix_length([a, b]), len(a) - 1, len(b) - 1)

        def worth_copying(i: int) -> bool:
            return i < len(order) and shared[i] - cached[order[i]] >= self.min_shared_prefix

        for i, row in enumerate(order):
            if i > 0 and worth_copying(i):  # the predecessor prefilled this much
                self._copy_prefix(slots[order[i - 1]], slots[row], shared[i])
                slots[row].tokens = list(prompts[row][: shared[i]])
                cached[row] = shared[i]
            if worth_copying(i + 1) and cached[row] < shared[i + 1]:
                self._prefill({row: prompts[row][cached[row] : shared[i + 1]]}, slots)
                self.stats.prefix_prefilled_tokens += shared[i + 1] - cached[row]
                cached[row] = shared[i + 1]

    def _copy_prefix(self, source: _Slot, target: _Slot, tokens: int) -> None:
        lib, memory = self._lib, self._memory
        lib.llama_memory_seq_rm(memory, target.seq, -1, -1)
        if self.kv_layout == "unified":
            lib.llama_memory_seq_cp(memory, source.seq, target.seq, 0, tokens)
        else:
            # llama.cpp copies between separate caches only whole: copy, then cut the tail
            lib.llama_memory_seq_cp(memory, source.seq, target.seq, -1, -1)
            lib.llama_memory_seq_rm(memory, target.seq, tokens, -1)

    def _prefill(
        self,
        pending: dict[int, list[int]],
        slots: list[_Slot],
        logits_at: dict[int, set[int]] | None = None,
        on_logits: Callable[[int, int, np.ndarray], None] | None = None,
    ) -> None:
        """Decode each row's pending tokens into its slot; ``on_logits(row, position,
        logits)`` for each position in ``logits_at[row]`` (positions in the sequence)."""
        logits_at = logits_at or {}
        queue = [(row, token) for row, tokens in pending.items() for token in tokens]
        for start in range(0, len(queue), self._batch_tokens):
            self._check_interrupt()
            chunk = queue[start : start + self._batch_tokens]
            outputs: list[tuple[int, int, int]] = []
            for index, (row, token) in enumerate(chunk):
                slot = slots[row]
                position = len(slot.tokens)
                wanted = position in logits_at.get(row, ())
                self._put(index, token, position, slot.seq, wanted)
                slot.tokens.append(token)
                if wanted:
                    outputs.append((index, row, position))
            self._decode(len(chunk))
            if on_logits is not None:
                for index, row, position in outputs:
                    on_logits(row, position, self._logits(index))

    def _put(self, index: int, token: int, position: int, seq: int, logits: bool) -> None:
        batch = self._batch
        batch.token[index] = token
        batch.pos[index] = position
        batch.n_seq_id[index] = 1
        batch.seq_id[index][0] = seq
        batch.logits[index] = 1 if logits else 0

    def _decode(self, n_tokens: int) -> None:
        self._batch.n_tokens = n_tokens
        status = self._lib.llama_decode(self._ctx, self._batch)
        if status != 0:
            self.clear_cache()
            raise LlamaCppError(
                f"llama_decode failed ({status}): the KV cache is full or the batch is invalid"
            )

    def _logits(self, index: int) -> np.ndarray:
        pointer = self._lib.llama_get_logits_ith(self._ctx, index)
        return np.ctypeslib.as_array(pointer, shape=(self._n_vocab,)).astype(np.float64)

    def _check_interrupt(self) -> None:
        if self._interrupt.is_set():
            self.clear_cache()
            raise GenerationInterrupted("generation interrupted")

    def _generate_chunk(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        budget: int,
        rng: np.random.Generator,
    ) -> list[Generation]:
        slots, cached = self._place(prompts, [len(prompt) - 1 for prompt in prompts])
        pending = {row: prompt[cached[row] :] for row, prompt in enumerate(prompts)}
        self.stats.suffix_prefilled_tokens += sum(len(t) for t in pending.values())
        logits: dict[int, np.ndarray] = {}
        self._prefill(
            pending,
            slots,
            {row: {len(prompt) - 1} for row, prompt in enumerate(prompts)},
            lambda row, _, row_logits: logits.__setitem__(row, row_logits),
        )

        tokens: list[list[int]] = [[] for _ in prompts]
        logprobs: list[list[float]] = [[] for _ in prompts]
        entropies: list[list[float]] = [[] for _ in prompts]
        finished = [""] * len(prompts)
        running = list(range(len(prompts)))
        for step in range(budget):
            self._check_interrupt()
            next_running = []
            for row in running:
                token, logprob, entropy = choose(logits[row], params, rng)
                tokens[row].append(token)
                logprobs[row].append(logprob)
                entropies[row].append(entropy)
                if token in self._stop_ids:
                    finished[row] = "token"
                elif params.stop and ends_with_stop_string(
                    self._tokenizer, tokens[row], params.stop
                ):
                    finished[row] = "string"
                else:
                    next_running.append(row)
            running = next_running
            if not running or step + 1 == budget:
                break
            for index, row in enumerate(running):
                slot = slots[row]
                self._put(index, tokens[row][-1], len(slot.tokens), slot.seq, True)
                slot.tokens.append(tokens[row][-1])
            self._decode(len(running))
            logits = {row: self._logits(index) for index, row in enumerate(running)}

        results = []
        for row, prompt in enumerate(prompts):
            body = tokens[row][:-1] if finished[row] == "token" else tokens[row]
            results.append(
                Generation(
                    text=decode_ids(self._tokenizer, body),
                    prompt_ids=list(prompt),
                    completion_ids=tokens[row],
                    logprobs=logprobs[row],
                    entropies=entropies[row],
                    finish_reason=FINISH_STOP if finished[row] else FINISH_LENGTH,
                    temperature=params.temperature,
                )
            )
        return results

    def _score_chunk(
        self, sequences: list[list[int]], positions: list[list[int]]
    ) -> list[list[float]]:
        slots, cached = self._place(sequences, [min(wanted) - 1 for wanted in positions])
        pending = {row: sequence[cached[row] :] for row, sequence in enumerate(sequences)}
        self.stats.suffix_prefilled_tokens += sum(len(t) for t in pending.values())
        scores: list[dict[int, float]] = [{} for _ in sequences]

        def take(row: int, position: int, logits: np.ndarray) -> None:
            token = sequences[row][position + 1]
            scores[row][position + 1] = float(log_softmax(logits)[token])

        self._prefill(
            pending,
            slots,
            {row: {p - 1 for p in wanted} for row, wanted in enumerate(positions)},
            take,
        )
        return [[scores[row][p] for p in wanted] for row, wanted in enumerate(positions)]


def log_softmax(values: np.ndarray) -> np.ndarray:
    shifted = values - values.max()
    return shifted - np.log(np.exp(shifted).sum())


def choose(
    logits: np.ndarray, params: SamplingParams, rng: np.random.Generator
) -> tuple[int, float, float]:
    """(token, its log-prob, entropy) under ``log_softmax(logits / temperature)``."""
    greedy = params.temperature <= 0.0
    scaled = logits if greedy else logits / params.temperature
    logp = log_softmax(scaled)
    probs = np.exp(logp)
    entropy = float(-(probs * logp).sum())
    if greedy:
        token = int(np.argmax(scaled))
    else:
        weights = probs if params.top_p >= 1.0 else _nucleus(probs, params.top_p)
        cumulative = np.cumsum(weights)
        token = int(np.searchsorted(cumulative, rng.random() * cumulative[-1], side="right"))
        token = min(token, len(weights) - 1)
    return token, float(logp[token]), entropy


def _nucleus(probs: np.ndarray, top_p: float) -> np.ndarray:
    order = np.argsort(-probs, kind="stable")
    sorted_probs = probs[order]
    before = np.cumsum(sorted_probs) - sorted_probs
    kept = np.where(before < top_p, sorted_probs, 0.0)
    out = np.zeros_like(probs)
    out[order] = kept
    return out
