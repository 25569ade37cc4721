"""Which number a learner announces its weights under, after a start or a restart."""

from __future__ import annotations

import pytest

from coevolve.services.learner.handler import version_to_announce
from coevolve.shared.messages import PolicyVersion
from tests.support.messages import policy_version


def never() -> str:
    raise AssertionError("the digest is only needed when the bus knows this number")


@pytest.mark.parametrize(
    ("version", "latest", "expected"),
    [
        (0, None, 0),  # no warm start, nothing on the bus: rollout starts from v0
        (0, policy_version(3, sha256="x"), None),  # a newer policy is out already
        (1, None, 1),
        (4, policy_version(3, sha256="x"), 4),
    ],
)
def test_a_number_the_bus_does_not_know_is_announced(
    version: int, latest: PolicyVersion | None, expected: int | None
) -> None:
    assert version_to_announce(version, latest, never) == expected


def test_the_same_weights_under_the_same_number_are_not_announced_again() -> None:
    assert version_to_announce(3, policy_version(3, sha256="abc"), lambda: "abc") is None


def test_a_known_number_with_other_weights_moves_past_the_newest() -> None:
    # a restored older checkpoint: v3 (or later) is out with other weights
    assert version_to_announce(3, policy_version(3, sha256="abc"), lambda: "def") == 4
    assert version_to_announce(2, policy_version(5, sha256="abc"), lambda: "def") == 6
