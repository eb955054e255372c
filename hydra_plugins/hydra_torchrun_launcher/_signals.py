"""Signal handling around one job's elastic agent.

The agent installs its own handlers (SIGTERM, SIGINT, ... raise `SignalException`) and
never restores the old ones; a launcher that runs many jobs in one process must put its
own back after every job. A job's deadline is a SIGALRM timer in the main thread, so that
the agent stops its ranks through the same path it uses for any other signal.
"""

import signal
import threading
from contextlib import contextmanager
from types import FrameType
from typing import Any, Dict, Iterator, Optional


class JobDeadline(BaseException):
    """Raised in the main thread when a job outlives `job_timeout`.

    A BaseException so that no `except Exception` inside torch's agent takes it for a
    worker error; the agent's `finally` still stops the ranks (graceful signal, then kill).
    """


def _signals_named(names: str) -> Dict[str, signal.Signals]:
    found = {}
    for name in names.split(","):
        sig = getattr(signal, name.strip(), None)
        if isinstance(sig, signal.Signals):
            found[sig.name] = sig
    return found


@contextmanager
def preserved_handlers(signal_names: str) -> Iterator[None]:
    """Restore, on the way out, the handlers of the named signals and of SIGALRM."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    watched = set(_signals_named(signal_names).values()) | {signal.SIGALRM}
    saved: Dict[signal.Signals, Any] = {sig: signal.getsignal(sig) for sig in watched}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)


@contextmanager
def deadline(seconds: Optional[float]) -> Iterator[None]:
    """Raise `JobDeadline` in the main thread after `seconds` (no limit when None)."""
    if seconds is None:
        yield
        return

    def _expired(signum: int, frame: Optional[FrameType]) -> None:
        raise JobDeadline(f"the job ran past hydra.launcher.job_timeout={seconds:g}s")

    previous = signal.signal(signal.SIGALRM, _expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def redeliver(sig: int) -> None:
    """Hand a signal the agent caught (and acted on) back to the launcher's own handler.

    With the launcher's handlers restored this does what the signal would have done
    without us: KeyboardInterrupt for SIGINT, termination for a default SIGTERM, or the
    app's own handler.
    """
    signal.raise_signal(sig)
