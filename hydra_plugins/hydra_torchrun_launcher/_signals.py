"""Signal names as torchrun's `signals_to_handle` spells them, and the ones the launcher ignores."""

import signal
import threading
from typing import List


def signals_named(names: str) -> List[signal.Signals]:
    """The signals of a `signals_to_handle` list such as "SIGTERM,SIGINT" that exist here."""
    found = []
    for name in names.split(","):
        sig = getattr(signal, name.strip(), None)
        if isinstance(sig, signal.Signals) and sig not in found:
            found.append(sig)
    return found


def not_ignored(names: str) -> str:
    """The signals of `names` that this process does not ignore, as torch's comma list.

    The agent would install a handler for every listed signal, so a sweep started under
    `nohup` (SIGHUP ignored) or as a background job (SIGINT ignored) would still be
    stopped by it; a signal the launcher ignores stays ignored while its jobs run (the job
    process takes the launcher's dispositions before its agent starts).
    """
    if threading.current_thread() is not threading.main_thread():
        return names  # the agent installs no handler outside the main thread
    return ",".join(sig.name for sig in signals_named(names) if signal.getsignal(sig) != signal.SIG_IGN)
