"""Where ``coevolve.cli.up`` finds the lockstep default; the data loop itself is
:mod:`coevolve.schedules.synthesis`."""

from coevolve.schedules.synthesis import DEFAULT_MAX_SIGNALS

__all__ = ["DEFAULT_MAX_SIGNALS"]
