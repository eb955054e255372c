"""Signal names as torchrun's `signals_to_handle` spells them, and the signals a sweep's
processes hand on: those a terminal, `kill -- -PGID` or srun/scancel deliver to a whole
process group."""

import os
import signal
import threading
from contextlib import contextmanager
from typing import Any, Callable, Iterable, Iterator, List, Optional

GROUP_SIGNALS = "SIGINT,SIGTERM,SIGHUP,SIGQUIT,SIGUSR1,SIGUSR2"


def send_signal(pid: int, signum: int) -> None:
    """`signum` to the process `pid`, unless it is gone already."""
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass


def signals_named(names: str) -> List[signal.Signals]:
    """The signals of a `signals_to_handle` list such as "SIGTERM,SIGINT" that exist here."""
    found = []
    for name in names.split(","):
        sig = getattr(signal, name.strip(), None)
        if isinstance(sig, signal.Signals) and sig not in found:
            found.append(sig)
    return found


def group_signals() -> List[signal.Signals]:
    """The signals of GROUP_SIGNALS that exist here: the launcher decides what they mean."""
    return signals_named(GROUP_SIGNALS)


def ignored_group_signals() -> List[signal.Signals]:
    """The group signals this process ignores (`nohup`, a background job): they stay ignored."""
    return [sig for sig in group_signals() if signal.getsignal(sig) == signal.SIG_IGN]


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


def take_dispositions(ignored: Iterable[int], stop: Optional[Callable[[int, Any], None]] = None) -> None:
    """The group signals as a Python process the launcher started would have them.

    An ignored one stays ignored; the others get `stop`, or Python's own defaults
    (Ctrl-C raises KeyboardInterrupt, the rest end the process). Every one of `ignored`:
    `take_dispositions(group_signals())` ignores them all.
    """
    ignored = set(ignored)
    for sig in group_signals():
        if sig in ignored:
            signal.signal(sig, signal.SIG_IGN)
        elif stop is not None:
            signal.signal(sig, stop)
        else:
            signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)


@contextmanager
def handled_by(handler: Callable[[int, Any], Any], signals: Iterable[int]) -> Iterator[None]:
    """`handler` for each of `signals` this process does not ignore, the previous handlers
    back afterwards. In the main thread only: Python installs handlers nowhere else."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    saved = {sig: signal.getsignal(sig) for sig in signals}
    try:
        for sig, previous in saved.items():
            if previous != signal.SIG_IGN:
                signal.signal(sig, handler)
        yield
    finally:
        for sig, previous in saved.items():
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
