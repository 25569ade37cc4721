"""What the harness's bus tally keeps beside the counts (``coevolve.bus_tally``): each
service's latest heartbeat, the groups published (once each, by message id) and the
groups the learner dropped as stale; a message that does not decode is counted, not fatal."""

from __future__ import annotations

from coevolve.bus_tally import BusTally, family_of
from coevolve.shared.messages import Metric, encode
from coevolve.shared.runtime.bus import MSG_ID_HEADER
from coevolve.shared.runtime.subjects import (
    ROLLOUT_GROUPS,
    heartbeat_subject,
    metrics_subject,
    signal_subject,
)
from tests.support.messages import heartbeat, rewarded_group


def test_the_tally_keeps_beats_groups_and_stale_drops() -> None:
    tally = BusTally(started_at=100.0)
    for phase in ("starting", "running"):
        tally.observe(heartbeat_subject("rollout"), encode(heartbeat("rollout", phase)), at=101.0)
    group = encode(rewarded_group("g1", "t", "seed", 1, 0.0, 1.0))
    tally.observe(ROLLOUT_GROUPS, group, {MSG_ID_HEADER: "g1"}, at=102.0)
    tally.observe(ROLLOUT_GROUPS, group, {MSG_ID_HEADER: "g1"}, at=103.0)  # published again
    tally.observe(ROLLOUT_GROUPS, encode(rewarded_group("g2", "t", "seed", 1, 1.0)), at=104.0)
    drops = Metric(service="learner", name="dropped_stale", value=2.0, step=7)
    tally.observe(metrics_subject("learner"), encode(drops), at=105.0)
    tally.observe(metrics_subject("rollout"), encode(drops), at=105.0)  # not the learner's
    tally.observe(signal_subject("boundary"), b"not msgpack", at=106.0)

    assert tally.beats["rollout"].phase == "running"
    assert tally.services_running_s == {"rollout": 1.0}
    assert tally.groups == {"g1", "g2"} and tally.duplicates == 1
    assert tally.counts["rollout_groups"] == 2 and tally.first_seen_s["rollout_groups"] == 2.0
    assert tally.dropped_stale == {7: 2.0}
    assert tally.counts["signals"] == 1  # counted by its subject, though it did not decode
    assert family_of("coevolve.nothing") == "other"
