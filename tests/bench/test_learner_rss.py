"""The learner memory benchmark's child: one setting measured in a fresh process."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.support.cache import CACHE_DIR


def test_a_warm_start_pair_is_measured_in_its_own_process() -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "COEVOLVE_RUN_DIR": str(CACHE_DIR)}
    child = subprocess.run(
        [sys.executable, "-m", "coevolve.bench.learner_rss", "pair", "256", "0.05", "sdpa"],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    assert child.returncode == 0, child.stderr[-2000:]
    row = json.loads(child.stdout.strip().splitlines()[-1])

    assert (row["mode"], row["tokens"]) == ("pair", 256)
    assert row["peak_mb"] > row["loaded_mb"] > 100
    assert row["held_after_release_mb"] <= row["held_after_step_mb"] + 50
