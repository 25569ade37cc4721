"""Actor services; each package is one actor. Services talk over the bus only."""

# pyproject.toml installs this folder as coevolve.services; imported under its folder name
# it would be a second copy of every module (and of every message type) in one process.
if __name__ != "coevolve.services":
    raise ImportError(
        f"import coevolve.services, not {__name__}: services/ is installed as coevolve.services"
    )
