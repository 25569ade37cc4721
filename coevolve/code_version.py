"""Which code made a result: what experiments, sweeps and D0 files record."""

from __future__ import annotations

import hashlib
import subprocess
from pathlib import Path

CODE_DIRS = ("coevolve", "services", "shared", "bench")
ROOT = Path(__file__).resolve().parents[1]


def _git(*args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(ROOT), *args], capture_output=True, text=True, check=True, timeout=10
    ).stdout.strip()


def git_commit() -> str | None:
    """The checkout's HEAD commit, short, ``+dirty`` when tracked files have uncommitted
    changes anywhere in it; None outside a git checkout."""
    try:
        commit = _git("rev-parse", "--short", "HEAD")
        dirty = bool(_git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.SubprocessError):
        return None
    return f"{commit}+dirty" if dirty else commit


def code_version(commit: str = "HEAD") -> str | None:
    """The code an arm ran: git's tree ids of the package directories at ``commit``
    (shortened, ``+dirty`` when they have uncommitted changes), so a report can tell arms
    that ran on different code apart, and a commit that changes only docs changes nothing
    (an experiment may be resumed days later). None outside a git checkout."""
    try:
        trees = [_git("rev-parse", f"{commit}:{name}") for name in CODE_DIRS]
        dirty = commit == "HEAD" and bool(
            _git("status", "--porcelain", "--untracked-files=no", "--", *CODE_DIRS)
        )
    except (OSError, subprocess.SubprocessError):
        return None
    version = hashlib.sha256(" ".join(trees).encode()).hexdigest()[:12]
    return f"{version}+dirty" if dirty else version
