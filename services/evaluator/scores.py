"""Where the evaluator keeps what it measured, and its latest score as one line.

Under the run directory:

- ``eval/latest.json``: the newest version scored (``HeldOutScore``), what ``coevolve
  status`` shows;
- ``evaluator/sample.json``: the held-out turns every version is scored on;
- ``evaluator/reports/v<N>.json``: each version's full report, as ``coevolve eval --out``
  writes it (so ``coevolve eval --compare A.json B.json`` pairs two versions);
- ``tensorboard/evaluator``: scalars ``eval/<measure>`` with step = policy version.
"""

from __future__ import annotations

from pathlib import Path

import msgspec

LATEST_FILE = Path("eval/latest.json")
SAMPLE_FILE = Path("evaluator/sample.json")
REPORTS_DIR = Path("evaluator/reports")
WORK_DIR = Path("evaluator/work")
TENSORBOARD_DIR = Path("tensorboard/evaluator")
# the report's measures written as TensorBoard scalars ``eval/<name>``, by their names in
# ``SuiteReport.summary()`` (a measure the report lacks, e.g. no likelihood, is left out)
MEASURES: tuple[str, ...] = (
    "accuracy",
    "ci95_low",
    "ci95_high",
    "partial_credit_mean",
    "gt_logprob_per_token",
    "seconds_per_entry",
)


class HeldOutScore(msgspec.Struct, kw_only=True, frozen=True):
    """One policy version's score on the run's held-out sample."""

    version: int
    accuracy: float
    n: int
    time: float  # when it was scored (unix seconds)
    ci95_low: float
    ci95_high: float
    partial_credit_mean: float | None = None
    gt_logprob_per_token: float | None = None
    seconds: float = 0.0  # wall time of the evaluation
    errors: int = 0  # turns that raised instead of being played
    source: str = ""  # where the held-out turns come from (HeldOutSample.source)


def read_latest(run_dir: Path) -> HeldOutScore | None:
    """The newest score recorded in ``run_dir``, or None (none yet, or unreadable)."""
    try:
        return msgspec.json.decode((run_dir / LATEST_FILE).read_bytes(), type=HeldOutScore)
    except (OSError, msgspec.DecodeError):
        return None


def write_latest(run_dir: Path, score: HeldOutScore) -> Path:
    """Replace ``eval/latest.json`` whole (a reader never sees half a file)."""
    path = run_dir / LATEST_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".json.tmp")
    partial.write_bytes(msgspec.json.format(msgspec.json.encode(score)) + b"\n")
    partial.replace(path)
    return path


def held_out_line(score: HeldOutScore) -> str:
    """What ``coevolve status`` shows of it."""
    source = f" of the {score.source}" if score.source else ""
    return f"held-out accuracy: {score.accuracy:.2f} at v{score.version} ({score.n} turns{source})"
