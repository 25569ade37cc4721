"""The learner memory benchmark's child: one setting measured in a fresh process."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from typing import Any

import pytest

from tests.support.cache import CACHE_DIR


@functools.cache  # one child per setting: two tests share the checkpointed 768-token pass
def _measure(mode: str, tokens: str, heap: str = "mapped") -> dict[str, Any]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "COEVOLVE_RUN_DIR": str(CACHE_DIR)}
    child = subprocess.run(
        [sys.executable, "-m", "coevolve.bench.learner_rss", mode, tokens, "0.05", "sdpa", heap],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    assert child.returncode == 0, child.stderr[-2000:]
    row: dict[str, Any] = json.loads(child.stdout.strip().splitlines()[-1])
    return row


def test_a_warm_start_pair_is_measured_in_its_own_process() -> None:
    row = _measure("pair", "256")

    assert (row["mode"], row["tokens"]) == ("pair", 256)
    assert row["peak_mb"] > row["loaded_mb"] > 100
    assert row["held_after_release_mb"] <= row["held_after_step_mb"] + 50


def test_a_checkpointed_pass_peaks_below_a_stored_one() -> None:
    peaks = {}
    for mode in ("train", "train-checkpointed"):
        row = _measure(mode, "768", heap="mapped")
        assert row["held_after_release_mb"] <= row["held_after_step_mb"] + 50
        peaks[mode] = row["peak_mb"] - row["loaded_mb"]

    assert peaks["train-checkpointed"] < peaks["train"] / 2


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_mapping_large_blocks_lowers_a_checkpointed_peak() -> None:
    glibc = _measure("train-checkpointed", "768", heap="glibc")
    mapped = _measure("train-checkpointed", "768", heap="mapped")

    assert (glibc["heap"], mapped["heap"]) == ("glibc", "mapped")
    assert mapped["peak_mb"] - mapped["loaded_mb"] < (glibc["peak_mb"] - glibc["loaded_mb"]) / 2
