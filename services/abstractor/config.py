"""The abstractor's settings (the ``services.abstractor`` section)."""

from __future__ import annotations

from typing import Literal

import msgspec

SimilarityBackend = Literal["auto", "embedding", "ngram"]


class AbstractorConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    # candidates per exploration: one per round with calls that replay (call_units.py)
    max_tasks: int = 4
    max_tokens: int = 300
    # a request written as code, too short, or leaving out a value its calls need is asked
    # for again this many times, with the reason; then the unit is dropped as
    # malformed_request
    rewrites: int = 2
    # add the argument values a request leaves out as a "Details:" clause (completion.py)
    # instead of asking for the request again: a template no user says, which the judge
    # refuses; kept for comparison with runs before 2026-11-29
    complete_values: bool = False
    # the request's JSON schema holds a pattern that writes every value the calls need
    # (prompts.values_pattern): constrained decoding cannot leave one out
    constrain_values: bool = True
    # the prompt shows what each call returned. The 0.5B copied those lines into requests
    # ("... returned user id USR008", runs 24-27), but without them fewer passed the
    # judge's checks on run 27's explorations (3 of 7 candidates against 5 of 7)
    show_results: bool = True
    dedup_threshold: float = 0.7
    dedup_backend: SimilarityBackend = "ngram"
    dedup_refresh_s: float = 120.0
    dedup_pool_limit: int = 2000
    leak_guard: bool = True
    leak_backend: SimilarityBackend = "auto"
    similarity_cache_dir: str | None = None
    concurrency: int = 1
