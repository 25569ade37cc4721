"""Near-duplicate index and leak guard on BFCL's real eval and train queries."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from coevolve.shared.envs.bfcl.tasks import (
    MULTI_TURN_CATEGORIES,
    eval_queries,
    load_tasks,
    split_tasks,
)
from coevolve.shared.similarity import LeakGuard, NearDuplicateIndex, embedding_available


def _train_queries(min_words: int = 6) -> list[str]:
    queries = {
        turn.strip()
        for category in MULTI_TURN_CATEGORIES
        for task in split_tasks(load_tasks(category))[0]
        for turn in task.user_turns
        if len(turn.split()) >= min_words
    }
    return sorted(queries)


def _drop_words(text: str, rng: random.Random) -> str:
    words = text.split()
    for _ in range(max(1, len(words) // 5)):
        if len(words) > 3:
            words.pop(rng.randrange(len(words)))
    return " ".join(words)


@pytest.fixture(scope="module")
def ngram_guard() -> LeakGuard:
    return LeakGuard(backend="ngram")


def test_ngram_index_finds_the_exact_text() -> None:
    texts = ["list all hidden files", "book a flight to Boston", "sell 10 shares of AAPL"]
    index = NearDuplicateIndex(texts, backend="ngram")
    assert index.backend == "ngram"
    score, position = index.nearest("book a flight to Boston")
    assert position == 1 and score == pytest.approx(1.0)
    assert NearDuplicateIndex([], backend="ngram").nearest("anything") == (0.0, -1)


def test_rewrites_of_eval_queries_are_flagged(ngram_guard: LeakGuard) -> None:
    rng = random.Random(7)
    candidates = [q for q in eval_queries() if len(q.split()) >= 8]
    sample = rng.sample(candidates, 60)
    for query in sample:
        for rewrite in (
            _drop_words(query, rng),
            "Hi! " + query.lower() + " Thanks so much.",
            query.replace(".", "").replace(",", ""),
        ):
            flagged, score, matched = ngram_guard.flags(rewrite)
            assert flagged, (rewrite, score, matched)


def test_train_queries_are_rarely_flagged(ngram_guard: LeakGuard) -> None:
    train = _train_queries()
    flagged = [q for q in train if ngram_guard.flags(q)[0]]
    assert len(flagged) / len(train) <= 0.03


def test_short_turns_are_neither_indexed_nor_flagged(ngram_guard: LeakGuard) -> None:
    assert ngram_guard.flags("The stock is TSLA.") == (False, 0.0, None)
    assert ngram_guard.flags("") == (False, 0.0, None)


def test_unrelated_query_is_not_flagged(ngram_guard: LeakGuard) -> None:
    flagged, score, _ = ngram_guard.flags(
        "Summarize the quarterly revenue of the bakery chain in three bullet points."
    )
    assert not flagged and score < 0.5


EVAL_QUERIES = [
    "Perform a detailed search using grep to identify sections in the file pertaining to "
    "'budget analysis'.",
    "Could you kindly show me the list of files in tmp directory in my file system "
    "including the hidden one?",
    "There is a report in my current directory. I have noticed the report appears somewhat "
    "cluttered; it could benefit from having its lines sorted.",
]


def test_embedding_check_catches_paraphrases(tmp_path: Path) -> None:
    if not embedding_available():
        pytest.skip("the embedding model cannot be loaded here")
    guard = LeakGuard(EVAL_QUERIES, backend="embedding", cache_dir=tmp_path)
    assert guard.backend == "ngram+embedding"
    for paraphrase in (
        "Use grep to find the parts of the file that talk about budget analysis.",
        "The report in this directory looks messy; sort its lines please.",
    ):
        flagged, _, matched = guard.flags(paraphrase)
        scores = guard.scores(paraphrase)
        assert flagged and matched in EVAL_QUERIES, scores
        assert scores["ngram"][0] < guard.ngram_threshold  # only the embedding catches it
    flagged, _, _ = guard.flags("Book a flight from LAX to JFK in economy class next Tuesday.")
    assert not flagged
    # the matrix was cached and a second guard reads it back
    assert list(tmp_path.glob("embeddings-*.pt"))
    again = LeakGuard(EVAL_QUERIES, backend="embedding", cache_dir=tmp_path)
    assert again.scores(EVAL_QUERIES[0])["embedding"][0] == pytest.approx(1.0, abs=1e-4)
