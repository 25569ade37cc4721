"""What actors share: messages, subjects, bus, runtime, telemetry, config, envs, models."""

# pyproject.toml installs this folder as coevolve.shared; imported under its folder name
# it would be a second copy of every module (and of every message type) in one process.
if __name__ != "coevolve.shared":
    raise ImportError(
        f"import coevolve.shared, not {__name__}: shared/ is installed as coevolve.shared"
    )
