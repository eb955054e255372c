"""Ranks never outlive the launcher: the kernel's parent-death signal, set in every rank."""

import ctypes
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when the process that started it dies.

    The agent stops ranks itself; this is the backstop for when the launcher is killed
    outright (SIGKILL, OOM) or a second Ctrl-C interrupts the agent's own shutdown, so a
    rank never outlives its sweep holding GPU memory. It survives exec, so a script or a
    wrapper started by `_rank.main` keeps it.
    """
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_SET_PDEATHSIG) failed: {os.strerror(err)}")
    if os.getppid() == 1:
        # the parent died before the request above was in place
        os._exit(1)
