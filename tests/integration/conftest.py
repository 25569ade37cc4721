"""Fixtures for the service-level tests: small, fast settings on a real NATS server."""

from __future__ import annotations

import pytest

from coevolve.shared.config import Settings
from tests.support.cache import CACHE_DIR

MODEL_CACHE = CACHE_DIR / "models"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def loop_settings(settings: Settings) -> Settings:
    """Small, fast settings; the converted model is shared with the other model tests."""
    MODEL_CACHE.mkdir(parents=True, exist_ok=True)
    settings.run_dir.mkdir(parents=True, exist_ok=True)
    (settings.run_dir / "models").symlink_to(MODEL_CACHE, target_is_directory=True)
    settings.services = {
        "pool_store": {"group_size": 2, "job_queue_depth": 1, "feed_interval_s": 0.2},
        "rollout": {
            "max_new_tokens": 24,
            "max_steps": 2,
            "device": "cpu",
            "wait_for_policy": False,
        },
        "learner": {
            "device": "cpu",
            "warm_start": {"enabled": False},
            "max_wait_s": 1.0,
            "grpo": {"groups_per_step": 1, "micro_batch_size": 2},
        },
    }
    return settings
