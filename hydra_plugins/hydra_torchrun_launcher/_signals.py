"""The launcher's own signal handlers around the elastic agents it runs.

The agent installs its own handlers (SIGTERM, SIGINT, ... raise `SignalException`) and
never restores the old ones (nor the environment variable that names them); a launcher
that runs many jobs in one process must put its own back after every job, then let them
react to the signal the agent caught.
"""

import os
import signal
import threading
from contextlib import contextmanager
from typing import Any, Dict, Iterator, List


def signals_named(names: str) -> List[signal.Signals]:
    """The signals of a `signals_to_handle` list such as "SIGTERM,SIGINT" that exist here."""
    found = []
    for name in names.split(","):
        sig = getattr(signal, name.strip(), None)
        if isinstance(sig, signal.Signals) and sig not in found:
            found.append(sig)
    return found


def not_ignored(names: str) -> str:
    """The signals of `names` that the launcher does not ignore, as torch's comma list.

    The agent would install a handler for every listed signal, so a sweep started under
    `nohup` (SIGHUP ignored) or as a background job (SIGINT ignored) would still be
    stopped by it; a signal the launcher ignores stays ignored while its jobs run.
    """
    if threading.current_thread() is not threading.main_thread():
        return names  # the agent installs no handler outside the main thread
    return ",".join(sig.name for sig in signals_named(names) if signal.getsignal(sig) != signal.SIG_IGN)


# torch's launch_agent tells its process context which signals to handle through this
# variable of the launcher's own environment, and leaves it there
_AGENT_SIGNALS_VAR = "TORCHELASTIC_SIGNALS_TO_HANDLE"


@contextmanager
def preserved_handlers(signal_names: str) -> Iterator[None]:
    """Restore, on the way out, the handlers of the named signals (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    saved: Dict[signal.Signals, Any] = {sig: signal.getsignal(sig) for sig in signals_named(signal_names)}
    saved_var = os.environ.get(_AGENT_SIGNALS_VAR)
    try:
        yield
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
        if saved_var is None:
            os.environ.pop(_AGENT_SIGNALS_VAR, None)
        else:
            os.environ[_AGENT_SIGNALS_VAR] = saved_var


def redeliver(sig: int) -> None:
    """Hand a signal the agent caught (and acted on) back to the launcher's own handler.

    With the launcher's handlers restored this does what the signal would have done
    without us: KeyboardInterrupt for SIGINT, termination for a default SIGTERM, or the
    app's own handler.
    """
    signal.raise_signal(sig)
