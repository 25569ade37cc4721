"""ruff (lint and format) and mypy pass on the whole project, and the layout holds: one
installed package from four folders without links, each module under one name, services
that do not import each other and shared code that imports no service, and few blocks
copied between files."""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
SETUPTOOLS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
# installed package name -> folder in the checkout (coevolve -> coevolve, coevolve.shared ->
# shared, ...)
FOLDERS: dict[str, str] = SETUPTOOLS["package-dir"]
# where mypy finds the mapped folders under their installed names (see pyproject.toml)
TYPECHECK_VIEW = ROOT / "build" / "typecheck" / "coevolve"


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_ruff_lint() -> None:
    result = run(str(BIN / "ruff"), "check", ".")
    assert result.returncode == 0, result.stdout + result.stderr


def test_ruff_format() -> None:
    result = run(str(BIN / "ruff"), "format", "--check", ".")
    assert result.returncode == 0, result.stdout + result.stderr


def test_mypy() -> None:
    if not TYPECHECK_VIEW.exists():
        TYPECHECK_VIEW.parent.mkdir(parents=True, exist_ok=True)
        TYPECHECK_VIEW.symlink_to(Path("..", ".."), target_is_directory=True)
    result = run(str(BIN / "mypy"))
    assert result.returncode == 0, result.stdout + result.stderr


def package_names() -> set[str]:
    """Every folder with an ``__init__.py`` under the mapped folders, by installed name."""
    names = set()
    for package, folder in FOLDERS.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            parts = init.parent.relative_to(ROOT / folder).parts
            names.add(".".join((package, *parts)))
    return names


def test_pyproject_installs_every_package_of_the_mapped_folders() -> None:
    assert set(FOLDERS) == {"coevolve", "coevolve.shared", "coevolve.services", "coevolve.bench"}
    assert package_names() == set(SETUPTOOLS["packages"])


def test_the_source_folders_hold_no_links() -> None:
    links = [
        str(path.relative_to(ROOT))
        for folder in FOLDERS.values()
        for path in (ROOT / folder).rglob("*")
        if path.is_symlink()
    ]
    assert links == []


def imported_modules(path: Path, package: str) -> set[str]:
    """The absolute names of what ``path`` (a module of ``package``) imports, relative
    imports resolved; ``from a import b`` counts as ``a`` and ``a.b``."""
    modules: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            modules.add(base)
            modules.update(f"{base}.{alias.name}" for alias in node.names)
    return modules


def modules_of(folder: str) -> list[tuple[Path, str]]:
    """(file, its package's installed name) for every module under ``folder``."""
    package = next(name for name, path in FOLDERS.items() if path == folder)
    return [
        (file, ".".join((package, *file.parent.relative_to(ROOT / folder).parts)))
        for file in sorted((ROOT / folder).rglob("*.py"))
    ]


def test_no_service_imports_another_and_shared_imports_no_service() -> None:
    crossing = []
    for file, package in modules_of("services"):
        own = package.split(".")[2] if package.count(".") >= 2 else None
        for module in imported_modules(file, package):
            parts = module.split(".")
            if parts[:2] == ["coevolve", "services"] and len(parts) > 2 and parts[2] != own:
                crossing.append(f"{file.relative_to(ROOT)} imports {module}")
    for file, package in modules_of("shared"):
        for module in imported_modules(file, package):
            if module.split(".")[:2] == ["coevolve", "services"]:
                crossing.append(f"{file.relative_to(ROOT)} imports {module}")
    assert crossing == []


SERVICE_SHAPE = ("config.py", "handler.py", "actor.py")


def service_folders() -> list[Path]:
    return sorted(p.parent for p in (ROOT / "services").glob("*/__init__.py"))


def test_every_service_has_its_config_handler_and_actor() -> None:
    missing = [
        f"{folder.relative_to(ROOT)}/{name}"
        for folder in service_folders()
        for name in SERVICE_SHAPE
        if not (folder / name).is_file()
    ]
    assert len(service_folders()) >= 7 and missing == []


def actor_imports(files: list[tuple[Path, str]]) -> list[str]:
    """``file imports module`` for every import of a service's actor module."""
    found = []
    for file, package in files:
        for module in imported_modules(file, package):
            parts = module.split(".")
            if parts[:2] == ["coevolve", "services"] and parts[3:] == ["actor"]:
                shown = file.relative_to(ROOT) if file.is_relative_to(ROOT) else file.name
                found.append(f"{shown} imports {module}")
    return found


def test_only_the_process_that_runs_a_service_imports_its_actor() -> None:
    """Schedules, benches, handlers and the CLI use configs and handlers: an actor is
    imported only by ``coevolve serve`` (by name) and by its own package's build."""
    files = [
        (file, package)
        for folder in ("coevolve", "bench", "shared", "services")
        for file, package in modules_of(folder)
        if not (folder == "services" and file.name == "actor.py")
    ]
    assert len(files) > 100
    assert actor_imports(files) == []


# what the runtime may take from the rest of shared/: the settings and the messages it moves
RUNTIME_DEPENDENCIES = {"coevolve.shared.config", "coevolve.shared.messages"}


def test_the_runtime_imports_no_domain_code() -> None:
    found = [
        f"{file.relative_to(ROOT)} imports {module}"
        for file, package in modules_of("shared")
        if package.startswith("coevolve.shared.runtime")
        for module in imported_modules(file, package)
        if module.startswith("coevolve.")
        and not module.startswith("coevolve.shared.runtime")
        and not any(module == d or module.startswith(d + ".") for d in RUNTIME_DEPENDENCIES)
    ]
    assert found == []


def test_product_code_imports_no_benchmark() -> None:
    """``coevolve bench`` loads a benchmark by name; nothing else of the product needs one."""
    found = [
        f"{file.relative_to(ROOT)} imports {module}"
        for folder in ("coevolve", "services", "shared")
        for file, package in modules_of(folder)
        for module in imported_modules(file, package)
        if module == "coevolve.bench" or module.startswith("coevolve.bench.")
    ]
    assert found == []


def test_the_actor_import_check_finds_an_import(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text(
        "from coevolve.services.rollout.config import RolloutConfig\n"
        "def f():\n    from ..learner.actor import LearnerActor\n"
    )
    found = actor_imports([(module, "coevolve.services.rollout")])
    assert found == ["m.py imports coevolve.services.learner.actor"]


def test_the_import_check_sees_relative_and_absolute_imports(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text(
        "import coevolve.services.rollout\n"
        "from ..judge.handler import judge_candidate\n"
        "from . import prompts\n"
    )
    seen = imported_modules(module, "coevolve.services.explorer")
    assert "coevolve.services.rollout" in seen
    assert "coevolve.services.judge.handler" in seen
    assert "coevolve.services.explorer.prompts" in seen


def test_a_folder_is_importable_only_under_its_installed_name(tmp_path: Path) -> None:
    for package, folder in FOLDERS.items():
        if package == folder:
            continue
        # from the checkout's root, where the folder itself is on sys.path
        result = run(sys.executable, "-c", f"import {folder}")
        assert result.returncode != 0, f"import {folder} worked"
        assert f"ImportError: import {package}, not {folder}" in result.stderr, result.stderr
    # the installed names work from anywhere
    code = "import coevolve.shared.messages as m, coevolve.services, coevolve.bench; print(m.Task)"
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert "coevolve.shared.messages.Task" in result.stdout


# copied blocks of six or more lines across the tracked Python files, by pylint's symilar
# (`symilar -d 6 $(git ls-files '*.py')`); what remains are import lists and the one
# `chat` signature its implementations share
MIN_COPIED_LINES = 6
MAX_COPIED_PAIRS = 10


def copied_blocks(files: list[str], cwd: Path) -> list[list[str]]:
    """The places of each block symilar finds in ``files``, one list per block."""
    result = subprocess.run(
        [str(BIN / "symilar"), "-d", str(MIN_COPIED_LINES), *files],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert "TOTAL lines=" in result.stdout, result.stdout + result.stderr
    blocks: list[list[str]] = []
    for line in result.stdout.splitlines():
        if " similar lines in " in line:
            blocks.append([])
        elif line.startswith("==") and blocks:
            blocks[-1].append(line[2:])
    return blocks


def pair_count(blocks: list[list[str]]) -> int:
    return sum(len(places) * (len(places) - 1) // 2 for places in blocks)


def test_the_tree_holds_few_copied_blocks() -> None:
    tracked = run("git", "ls-files", "*.py").stdout.split()
    assert len(tracked) > 100
    blocks = copied_blocks(tracked, ROOT)
    assert pair_count(blocks) <= MAX_COPIED_PAIRS, "\n".join(" ~ ".join(b) for b in blocks)


def test_the_copy_check_counts_a_copied_block(tmp_path: Path) -> None:
    body = "".join(f"value_{n} = compute({n}, 'x{n}')\n" for n in range(8))
    for name in ("a.py", "b.py"):
        (tmp_path / name).write_text(f"# {name}\n{body}")
    (tmp_path / "c.py").write_text("".join(f"other_{n} = {n}\n" for n in range(8)))
    blocks = copied_blocks(["a.py", "b.py", "c.py"], tmp_path)
    assert pair_count(blocks) == 1
    assert [place.split(":")[0] for place in blocks[0]] == ["a.py", "b.py"]
