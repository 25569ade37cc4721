"""Which code made a result: what experiments, sweeps and D0 files record."""

from __future__ import annotations

import hashlib
import subprocess
from pathlib import Path

CODE_DIRS = ("coevolve", "services", "shared", "bench")


def code_version(commit: str = "HEAD") -> str | None:
    """The code an arm ran: git's tree ids of the package directories at ``commit``
    (shortened, ``+dirty`` when they have uncommitted changes), so a report can tell arms
    that ran on different code apart, and a commit that changes only docs changes nothing
    (an experiment may be resumed days later). None outside a git checkout."""
    root = Path(__file__).resolve().parents[1]

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", "-C", str(root), *args], capture_output=True, text=True, check=True, timeout=10
        ).stdout.strip()

    try:
        trees = [git("rev-parse", f"{commit}:{name}") for name in CODE_DIRS]
        dirty = commit == "HEAD" and bool(
            git("status", "--porcelain", "--untracked-files=no", "--", *CODE_DIRS)
        )
    except (OSError, subprocess.SubprocessError):
        return None
    version = hashlib.sha256(" ".join(trees).encode()).hexdigest()[:12]
    return f"{version}+dirty" if dirty else version
