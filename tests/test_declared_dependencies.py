"""Every third-party module the code imports comes from a distribution pyproject.toml declares,
and the installed environment is consistent (``pip check``)."""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import re
import subprocess
import sys
import tomllib
from collections.abc import Mapping
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CODE_DIRS = ("coevolve", "services", "shared", "bench")
OWN_PACKAGE = "coevolve"


def normalise(name: str) -> str:
    """A distribution name as PEP 503 compares it."""
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(requirement: str) -> str:
    """The distribution a requirement string names, without extras, versions or markers."""
    match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
    assert match, f"cannot read a distribution name from {requirement!r}"
    return normalise(match.group(1))


def declared() -> tuple[set[str], set[str]]:
    """The normalised names in ``[project] dependencies`` and in the optional groups."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    required = {requirement_name(r) for r in project.get("dependencies", [])}
    optional = {
        requirement_name(r)
        for group in project.get("optional-dependencies", {}).values()
        for r in group
    }
    return required, optional


def imported_modules() -> dict[str, set[str]]:
    """Each absolute import's dotted name (``from a import b`` gives ``a.b``: b may be a
    module) and the files that import it, wherever in the file the import is."""
    found: dict[str, set[str]] = {}
    for folder in CODE_DIRS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            where = str(path.relative_to(ROOT))
            for node in ast.walk(ast.parse(path.read_text(), filename=where)):
                names: list[str] = []
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [
                        node.module if alias.name == "*" else f"{node.module}.{alias.name}"
                        for alias in node.names
                    ]
                for name in names:
                    top = name.partition(".")[0]
                    if top != OWN_PACKAGE and top not in sys.stdlib_module_names:
                        found.setdefault(name, set()).add(where)
    return found


@cache
def _packages() -> Mapping[str, list[str]]:
    return importlib.metadata.packages_distributions()


@cache
def _files(distribution: str) -> frozenset[str]:
    return frozenset(str(f) for f in importlib.metadata.files(distribution) or ())


def distributions(module: str) -> set[str]:
    """The installed distributions that provide ``module``, normalised; empty if none is
    installed. A namespace package (``opentelemetry``) spans several distributions: the one
    whose files hold the longest prefix of the dotted name is the one that provides it."""
    candidates = _packages().get(module.partition(".")[0], [])
    if len(candidates) > 1:
        parts = module.split(".")
        for end in range(len(parts), 0, -1):
            prefix = "/".join(parts[:end])
            holders = [
                dist
                for dist in candidates
                if any(f == f"{prefix}.py" or f.startswith(f"{prefix}/") for f in _files(dist))
            ]
            if holders:
                candidates = holders
                break
    return {normalise(dist) for dist in candidates}


def test_every_imported_distribution_is_declared() -> None:
    required, optional = declared()
    undeclared: dict[str, set[str]] = {}
    not_optional: dict[str, set[str]] = {}
    for module, files in imported_modules().items():
        providers = distributions(module)
        if providers:
            if not providers & (required | optional):
                undeclared.setdefault(" or ".join(sorted(providers)), set()).update(files)
        # not installed here, so it can only be an optional extra (vllm on GPU machines)
        elif (name := normalise(module.partition(".")[0])) not in optional:
            not_optional.setdefault(name, set()).update(files)
    problems = [
        f"{name} (imported by {', '.join(sorted(files))}) is not declared in pyproject.toml"
        for name, files in sorted(undeclared.items())
    ] + [
        f"{name} (imported by {', '.join(sorted(files))}) is not installed and in no"
        " [project.optional-dependencies] group"
        for name, files in sorted(not_optional.items())
    ]
    assert not problems, "\n".join(problems)


def test_the_installed_distributions_are_consistent() -> None:
    if importlib.util.find_spec("pip") is None:
        pytest.skip(f"pip is not installed in {sys.executable}")
    checked = subprocess.run(
        [sys.executable, "-m", "pip", "check", "--disable-pip-version-check"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
