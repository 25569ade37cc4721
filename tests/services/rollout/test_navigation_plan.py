"""Which episodes of a rollout job carry its experiences (``rollout.navigation``)."""

from __future__ import annotations

import pytest

from coevolve.services.rollout.config import NavigationConfig, RolloutConfig
from coevolve.services.rollout.handler import navigation_plan
from coevolve.shared.experience import guidance_text
from coevolve.shared.messages import Experience, RolloutJob
from tests.support.messages import NOTES_TASK, experience


def numbered(number: int) -> Experience:
    return experience(f"When asked to create a file, call cd first ({number}).", id=f"exp-{number}")


def test_the_configured_share_of_a_job_with_experiences_is_navigated() -> None:
    job = RolloutJob(task=NOTES_TASK, group_size=8, experiences=[numbered(1), numbered(2)])
    plan = navigation_plan(job, RolloutConfig())
    assert plan is not None and len(plan) == 8
    advised = [n for n in plan if n is not None]
    assert len(advised) == 4 and plan[4:] == [None] * 4
    assert advised[0].experience_ids == ["exp-1", "exp-2"]
    assert advised[0].text == guidance_text(job.experiences)
    assert "(1)" in advised[0].text and "(2)" in advised[0].text


def test_no_episode_is_navigated_without_experiences_or_share() -> None:
    assert navigation_plan(RolloutJob(task=NOTES_TASK, group_size=8), RolloutConfig()) is None
    job = RolloutJob(task=NOTES_TASK, group_size=8, experiences=[numbered(1)])
    off = RolloutConfig(navigation=NavigationConfig(share=0.0))
    assert navigation_plan(job, off) is None


def test_a_share_outside_zero_to_one_is_refused() -> None:
    with pytest.raises(ValueError, match=r"navigation\.share"):
        NavigationConfig(share=1.5)
