"""Benchmarks behind ``coevolve bench NAME``: ratios measured side by side in one run."""

# pyproject.toml installs this folder as coevolve.bench; imported under its folder name
# it would be a second copy of every module (and of every message type) in one process.
if __name__ != "coevolve.bench":
    raise ImportError(
        f"import coevolve.bench, not {__name__}: bench/ is installed as coevolve.bench"
    )
