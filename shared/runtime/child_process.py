"""Child processes that die with the process that started them, however it ends, and
that may run at a lower CPU priority.

Children run in their own session (a Ctrl-C reaches ``up``, which stops them in order),
so a SIGKILLed parent would leave them running. On Linux each child asks the kernel for
SIGTERM when its parent dies (``PR_SET_PDEATHSIG``), set between fork and exec. The
niceness is set there too: Linux keeps it per thread and a thread inherits its
creator's, so set before exec it covers every thread the child starts.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import sys
from collections.abc import Callable

_PR_SET_PDEATHSIG = 1


def _load_prctl() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return libc.prctl
    except (OSError, AttributeError):
        return None


# resolved in the parent: the child between fork and exec only makes the call
_prctl = _load_prctl()


def terminate_with_parent() -> None:
    """Ask the kernel for SIGTERM when the parent dies (call it in the child; Linux only)."""
    if _prctl is not None:
        _prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)


def die_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` for ``subprocess.Popen`` (None where the platform has no such call).

    The signal follows the parent *thread* that spawned the child: spawn from a thread
    that lives as long as the child should (the main thread or a long-lived watchdog).
    """
    return terminate_with_parent if _prctl is not None else None


def child_setup(niceness: int = 0) -> Callable[[], None] | None:
    """A ``preexec_fn`` that asks for SIGTERM when the parent dies and, with ``niceness``
    above 0, lowers the child's CPU priority by that much (None when there is nothing to do)."""
    if niceness <= 0:
        return die_with_parent()

    def setup() -> None:
        terminate_with_parent()
        os.nice(niceness)

    return setup
