"""``coevolve bench failover --quick``: a run on a 3-node cluster that loses the node leading
the rollout-groups stream, then quorum, and loses nothing (slow: about 8 minutes)."""

from __future__ import annotations

import pytest

from coevolve.bench import faults

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_services_survive_a_lost_leader_and_a_lost_quorum() -> None:
    result = faults.run_failover(quick=True)
    assert [f["kind"] for f in result["faults"]] == ["leader killed", "quorum lost"]
    assert result["failover_s"] is not None and result["recovered_s"] is not None
    assert result["quorum_loss_reported_by"], "no service said the cluster lost quorum"
    assert result["groups_lost"] == 0
    assert result["duplicate_tasks"] == 0 and result["duplicate_verdicts"] == 0
    assert result["versions_non_monotonic"] == 0
    assert set(result["services_alive_at_end"].values()) == {"running"}
