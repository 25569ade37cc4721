"""The explorer's settings (the ``services.explorer`` section)."""

from __future__ import annotations

from typing import Literal

import msgspec


class ExplorerConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    rounds: int = 1
    max_steps: int = 3
    max_request_rounds: int = 8
    summary_max_tokens: int = 400
    action_max_tokens: int = 96
    on_context_rejection: Literal["explore", "drop"] = "explore"
    history_messages: int = 12
    concurrency: int = 1
    # each published exploration as one JSON line in RUN_DIR/<record>-<pid>.jsonl: what
    # synthesis was given, to run through abstractor and judge again offline (null: none)
    record: str | None = "explorer/explorations"
