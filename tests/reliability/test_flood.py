"""A flood of bad messages on every consumed subject (fast variant of `coevolve bench
flood`): real NATS, real pool-store and signal-monitor processes, a stand-in for the
model services' consumers. Every bad message becomes one dead letter with its reason, no
service dies, and the good traffic sent alongside is all processed."""

from __future__ import annotations

import asyncio
from pathlib import Path

from coevolve.bench.flood import GENERIC_KINDS, bad_messages, measure
from coevolve.shared.messages import Task

BAD = 500
GOOD = 30


def test_every_bad_message_is_dead_lettered_and_good_traffic_flows(tmp_path: Path) -> None:
    result = asyncio.run(measure(BAD, GOOD, tmp_path))

    assert result["services_alive"] == {"pool_store": True, "signal_monitor": True}
    assert result["pool_answers_after_flood"]
    flood = result["during_flood"]
    assert flood["bad_messages"] == BAD
    assert flood["bad_refused_by_bus"] == 1  # the 10 MB one: over the broker's max_payload
    assert flood["bad_sent"] == BAD - 1
    # every good result and group of both phases was processed (the phase waits for them)
    assert flood["results_per_s"] > 0 and result["without_flood"]["results_per_s"] > 0

    audit = result["audit"]
    assert audit["bad_missing"] == [] and audit["bad_missing_count"] == 0
    assert audit["dead_lettered_twice"] == 0
    assert audit["good_dead_lettered"] == 0
    assert audit["dead_letters"] == BAD - 1
    sent_kinds = {b.kind for b in bad_messages(BAD, Task(id="t", environment="e", user_turns=[]))}
    assert set(audit["by_kind"]) == sent_kinds - {"oversized_10mb"}
    assert set(GENERIC_KINDS) <= set(audit["by_kind"])
    assert {
        "rejected by the handler",  # a group of a task the pool does not know
        "failed validation",  # lengths that do not match
        "non-finite number",  # NaN rewards, inf log-probs
        "value out of range",  # negative K, huge trajectory
        "unsupported schema",
        "undecodable or wrong type",
    } <= set(audit["by_reason"])
    assert "handler failed" not in audit["by_reason"]
    assert set(audit["by_service"]) == {"pool_store", "signal_monitor", "stand_in"}
