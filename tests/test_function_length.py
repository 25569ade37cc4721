"""No function of the product (coevolve/, services/, shared/) runs past ``MAX_LINES``: a
longer one is a sequence of steps that should have names."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("coevolve", "services", "shared")
MAX_LINES = 120


def long_functions(files: list[Path], limit: int = MAX_LINES) -> list[str]:
    """``file:line name (span lines)`` for each function or method, nested ones included,
    whose span from ``def`` to its last line (decorators left out) is over ``limit``."""
    found = []
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                span = (node.end_lineno or node.lineno) - node.lineno + 1
                if span > limit:
                    shown = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name
                    found.append(f"{shown}:{node.lineno} {node.name} ({span} lines)")
    return found


def test_no_function_is_longer_than_the_limit() -> None:
    files = sorted(path for folder in FOLDERS for path in (ROOT / folder).rglob("*.py"))
    assert len(files) > 150
    assert long_functions(files) == []


def test_the_check_counts_every_line_of_a_function_and_its_nested_ones(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    inner = "".join(f"        x{n} = {n}\n" for n in range(4))
    module.write_text(
        f"@decorated\ndef outer():\n    def inner():\n{inner}    return inner\n\ndef short(): ...\n"
    )
    assert long_functions([module], limit=5) == ["m.py:2 outer (7 lines)"]
    assert long_functions([module], limit=4) == ["m.py:2 outer (7 lines)", "m.py:3 inner (5 lines)"]
