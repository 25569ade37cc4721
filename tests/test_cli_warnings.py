"""The command line hides the ML libraries' deprecation notices, never the project's."""

from __future__ import annotations

import os
import subprocess
import sys

# Each warning as the named module would raise it; the variable is printed last.
SCRIPT = """
import os, sys, warnings
import coevolve.cli
for module, category in [
    ("transformers.modeling_utils", FutureWarning),
    ("torch.nn.modules.module", FutureWarning),
    ("peft.tuners.lora", FutureWarning),
    ("trl.trainer", DeprecationWarning),
    ("accelerate.utils", FutureWarning),
    (sys.argv[1], FutureWarning),
]:
    warnings.warn_explicit(f"from {module}", category, "f.py", 1, module=module)
print(os.environ.get("TRANSFORMERS_VERBOSITY"))
"""


def run(module: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """The script in a fresh interpreter, with no warning or verbosity settings inherited."""
    base = {
        k: v for k, v in os.environ.items() if k not in {"PYTHONWARNINGS", "TRANSFORMERS_VERBOSITY"}
    }
    return subprocess.run(
        [sys.executable, "-c", SCRIPT, module],
        env={**base, **(env or {})},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )


def test_library_warnings_are_hidden_and_the_projects_shown() -> None:
    result = run("coevolve.services.learner.trainer")
    assert result.stderr == "f.py:1: FutureWarning: from coevolve.services.learner.trainer\n"
    assert result.stdout.strip() == "error"


def test_a_users_own_settings_are_kept() -> None:
    result = run("transformers.generation", {"TRANSFORMERS_VERBOSITY": "info"})
    assert result.stdout.strip() == "info"
    result = run("coevolve.x", {"PYTHONWARNINGS": "default"})
    assert "from transformers.modeling_utils" in result.stderr
    assert "from coevolve.x" in result.stderr
