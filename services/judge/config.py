"""The judge's settings (the ``services.judge`` section)."""

from __future__ import annotations

from typing import Literal

import msgspec


class JudgeConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    max_tokens: int = 200
    concurrency: int = 1
    # deterministic checks after the replay (checks.py): no redundant state-changing call
    minimality: bool = True
    # the request names the calls' key values, uses what it quotes, and is about the
    # functions called (similarity: all-MiniLM-L6-v2, or n-grams without it)
    relevance: bool = True
    relevance_backend: Literal["auto", "embedding", "ngram"] = "auto"
    # an LLM solver given only the requests must reach the same result (roundtrip.py):
    # one LLM call per turn; off, as with the default 0.5B model it rejects most sound
    # tasks (docs/judge.md)
    round_trip: bool = False
    round_trip_max_tokens: int = 300
    # the judge role's rating last. Off by default: with the default 0.5B model it rejected
    # all 7 sound turns that reached it (docs/judge.md), so a candidate that passes every
    # check above is accepted; turn it on with a stronger judge endpoint
    llm_judge: bool = False
