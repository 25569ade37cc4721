"""The build fails if eval/exec could be applied to anything derived from model text.

Two checks: a scan of the project's own source for eval/exec/compile calls (there must be
none at all), and a run-time tripwire around a full set of episodes (hostile corpus,
ground-truth episodes played through ``step``, scoring) asserting that neither eval,
exec nor compile ever sees text from the agent, and that BFCL's eval-based executor is
never entered.
"""

from __future__ import annotations

import ast
import builtins
import importlib.util
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from bfcl_eval.eval_checker.multi_turn_eval import multi_turn_checker, multi_turn_utils

from coevolve.shared.envs.bfcl import BfclEnvironment, load_tasks
from coevolve.shared.messages import ToolCall
from coevolve.shared.toolcalls import format_tool_calls
from tests.envs.test_hostile_calls import CANARY, hostile_corpus

PROJECT_ROOT = Path(__file__).resolve().parents[2]
SKIPPED_DIRS = {".venv", "venv", "runs", "node_modules", "build", "dist", "__pycache__"}
DYNAMIC_CODE = {"eval", "exec", "compile"}
BUILTIN_MODULES = {"builtins", "__builtins__"}


def project_sources() -> Iterator[Path]:
    for path in sorted(PROJECT_ROOT.rglob("*.py")):
        relative = path.relative_to(PROJECT_ROOT)
        if any(part in SKIPPED_DIRS or part.startswith(".") for part in relative.parts):
            continue
        # coevolve/shared and coevolve/services are symlinks to the root directories
        if relative.parts[:2] in {("coevolve", "shared"), ("coevolve", "services")}:
            continue
        yield path


def dynamic_code_calls(source: str) -> list[tuple[int, str]]:
    """(line, description) of every reference to eval/exec/compile in ``source``.

    Any reference counts, not only a call, so ``run = eval; run(text)`` is caught too.
    ``model.eval()`` (a method of another object) and ``ast.literal_eval`` are fine.
    """
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Name) and node.id in DYNAMIC_CODE:
            found.append((node.lineno, node.id))
        elif (
            isinstance(node, ast.Attribute)
            and node.attr in DYNAMIC_CODE
            and isinstance(node.value, ast.Name)
            and node.value.id in BUILTIN_MODULES
        ):
            found.append((node.lineno, f"{node.value.id}.{node.attr}"))
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "getattr"
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and node.args[1].value in DYNAMIC_CODE
        ):
            found.append((node.lineno, f"getattr(..., {node.args[1].value!r})"))
        elif (
            isinstance(node, ast.Subscript)
            and isinstance(node.value, ast.Name)
            and node.value.id in BUILTIN_MODULES
            and isinstance(node.slice, ast.Constant)
            and node.slice.value in DYNAMIC_CODE
        ):
            found.append((node.lineno, f"{node.value.id}[{node.slice.value!r}]"))
    return found


def test_the_scanner_finds_every_form() -> None:
    sample = (
        "eval(x)\nexec(y)\ncompile(z, 'f', 'exec')\nbuiltins.eval(x)\n"
        "getattr(builtins, 'exec')(y)\n__builtins__['eval'](x)\nrun = eval\n"
        "model.eval()\nast.literal_eval(x)\nre.compile(p)\n"
    )
    assert sorted({line for line, _ in dynamic_code_calls(sample)}) == [1, 2, 3, 4, 5, 6, 7]


def test_project_source_has_no_eval_exec_or_compile() -> None:
    sources = list(project_sources())
    assert any(p.name == "environment.py" for p in sources)  # the scan does see our code
    offenders = [
        f"{path.relative_to(PROJECT_ROOT)}:{line}: {what}"
        for path in sources
        for line, what in dynamic_code_calls(path.read_text(encoding="utf-8"))
    ]
    assert not offenders, "dynamic code execution in project source:\n" + "\n".join(offenders)


class Tripwire:
    """Wraps eval/exec/compile, recording the source text each one is given."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.sources: list[str] = []
        for name in sorted(DYNAMIC_CODE):
            original = getattr(builtins, name)
            monkeypatch.setattr(builtins, name, self._wrap(original))

    def _wrap(self, original: Any) -> Any:
        def recording(source: Any, *args: Any, **kwargs: Any) -> Any:
            self.sources.append(source if isinstance(source, str) else repr(source))
            return original(source, *args, **kwargs)

        return recording


def _forbid_bfcl_executor(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*_: Any, **__: Any) -> None:
        raise AssertionError("BFCL's eval-based executor was entered")

    monkeypatch.setattr(multi_turn_utils, "execute_multi_turn_func_call", refuse)
    monkeypatch.setattr(multi_turn_checker, "execute_multi_turn_func_call", refuse)


def test_no_agent_text_reaches_eval_exec_or_compile_at_run_time(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    tasks = load_tasks("multi_turn_base")[:12] + load_tasks("multi_turn_miss_func")[:4]
    corpus = list(hostile_corpus(tmp_path / CANARY).values())
    _forbid_bfcl_executor(monkeypatch)
    tripwire = Tripwire(monkeypatch)

    for task in tasks:
        env = BfclEnvironment()
        env.reset(task)
        env.step("\n".join(corpus[:8]) + f" {CANARY}")
        for turn_calls in task.ground_truth:
            marked = [ToolCall(name=c.name, arguments=c.arguments) for c in turn_calls]
            if marked:
                env.step(f"{CANARY} " + format_tool_calls(marked))
            env.step(f"Finished this part. {CANARY}")
        assert env.done
        assert env.score() == 1.0
        env.close()
    for text in corpus:
        env = BfclEnvironment()
        env.reset(tasks[0])
        env.step(text)
        env.score()

    # The tripwire is live: importing a fresh module compiles and executes its code.
    module_file = tmp_path / "tripwire_probe.py"
    module_file.write_text("VALUE = 1\n")
    spec = importlib.util.spec_from_file_location("tripwire_probe", module_file)
    assert spec is not None and spec.loader is not None
    spec.loader.exec_module(importlib.util.module_from_spec(spec))
    assert any("VALUE" in source or "code object" in source for source in tripwire.sources)

    leaked = [source for source in tripwire.sources if CANARY in source or "__import__" in source]
    assert not leaked
    assert not (tmp_path / CANARY).exists()
