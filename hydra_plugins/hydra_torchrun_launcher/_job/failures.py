"""Turn a torch elastic failure into the error a user reads: one story per failed job.

The console already showed the failed rank's own lines (its traceback included, prefixed
with its rank). The job's error then says, in a few lines, which rank failed, how (its
exception, signal or exit code) and where its full logs are. A rank that raised hands back
its own exception (`job_error`); one that failed without a Python exception (a signal, an
exit code, a training script) has no traceback to show, so its error ends with the last
lines of the rank's stderr, which Hydra prints at the end of the sweep as it prints a task's
traceback: the job's line, the table and `sweep_summary.json` keep the short account.
"""

import os
import signal
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, List, Optional

from hydra.errors import CompactHydraException
from torch.distributed.elastic.multiprocessing import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from .._rank.error import SUMMARY_ATTR, read_rank_exception, with_summary
from .._shared.paths import shown_path
from .._shared.signals import group_signals

_STDERR_TAIL_LINES = 20
# what torch puts in ProcessFailure.error_file when the rank left none
_NO_ERROR_FILE = "<N/A>"


class RankTraceback(Exception):
    """What a failed rank left: its traceback, or the last lines of its stderr."""


class JobFailedError(CompactHydraException, RuntimeError):
    """A sweep job that failed: its message names the rank first; the details are its cause.

    A `CompactHydraException`, so Hydra prints the message alone at the end of a sweep
    instead of the launcher's frames. It is rebuilt from `args` when unpickled, so the
    cause survives the trip from the job's process to the launcher. `tail`, the last lines
    of a rank that left no traceback, follows the message in `str()` (what Hydra prints);
    the launcher's own lines take the message alone (`_rank.error.failure_summary`).
    """

    def __init__(self, message: str, details: str = "", tail: str = "") -> None:
        super().__init__(message, details, tail)
        self.message = message
        self.details = details
        self.tail = tail
        setattr(self, SUMMARY_ATTR, message)
        if details:
            self.__cause__ = RankTraceback(details)

    def __str__(self) -> str:
        return f"{self.message}\n{self.tail}" if self.tail else self.message


class _Stop:
    """The stop signal this job's process received, and whether it interrupts what runs.

    It interrupts only while torch's agent runs (`stops_interrupt`), as the agent's own
    handler does; elsewhere the signal is recorded and acted on at the next safe point,
    because an exception raised at an arbitrary instruction can leave a lock of `logging`
    or of a fork handler held.
    """

    received: Optional[signal.Signals] = None
    interrupting = False


def _raise_stop() -> None:
    raise SignalException(f"Process {os.getpid()} got signal: {_Stop.received}", sigval=_Stop.received)


def stop_requested(signum: int, frame: Any) -> None:
    """The job process's handler of a stop signal, installed for the whole job.

    It records the signal; while torch's agent runs it also raises, as the agent's own
    handler does, so a stop that comes before the agent has ranks to watch (its rendezvous
    waiting for other nodes) ends the job the same way, with its JobReturn.
    """
    _Stop.received = signal.Signals(signum)
    if _Stop.interrupting:
        _raise_stop()


@contextmanager
def stops_interrupt() -> Iterator[None]:
    """Around torch's agent: a stop raises there, and one that came before raises at once.

    Afterwards the job process's handlers are back where the agent put its own.
    """
    saved = {sig: signal.getsignal(sig) for sig in group_signals()}
    _Stop.interrupting = True
    try:
        if _Stop.received is not None:
            _raise_stop()
        yield
    finally:
        _Stop.interrupting = False
        for sig, handler in saved.items():
            if signal.getsignal(sig) is not handler and handler is not None:
                signal.signal(sig, handler)


def _cause(failure: ProcessFailure) -> str:
    if failure.exitcode < 0:
        return f"was killed by signal {failure.signal_name()}"
    return f"exited with code {failure.exitcode}"


def _left_error_file(failure: ProcessFailure) -> bool:
    """Whether the rank wrote its error file (a Python exception in the rank).

    Without one torch sets `error_file` to "<N/A>", fills `message` with a placeholder
    ("Signal 9 (SIGKILL) received by PID ...", "To enable traceback see: <url>") and
    `error_file_data` with a shared dummy whose "message" is never empty, so neither of
    those tells whether the rank said anything.
    """
    return bool(failure.error_file) and failure.error_file != _NO_ERROR_FILE


def _exception_line(failure: ProcessFailure) -> str:
    """ "ValueError: bad lr" for a rank that raised; "" otherwise."""
    if not _left_error_file(failure):
        return ""
    message: Any = failure.message
    if isinstance(message, dict):
        message = message.get("message", "")
    lines = str(message).strip().splitlines()
    return lines[0] if lines else ""


def _traceback(failure: ProcessFailure) -> str:
    """The traceback the rank left in its error file ("" when it left none)."""
    message: Any = failure.message
    if not _left_error_file(failure):
        return ""
    if isinstance(message, dict):
        callstack = message.get("extraInfo", {}).get("py_callstack")
        return str(callstack or message.get("message", "")).rstrip()
    return str(message).rstrip()


def _tail(stderr_log: Optional[Path]) -> str:
    """The last lines of a rank's stderr file, for a rank that left no traceback."""
    if stderr_log is None or not stderr_log.is_file():
        return ""  # tee=0 and redirects=0: the rank wrote to the console, no file
    lines = stderr_log.read_text(errors="replace").splitlines()[-_STDERR_TAIL_LINES:]
    return "its last lines:\n" + "\n".join(lines) if lines else ""


def describe(
    error: ChildFailedError, stderr_logs: Optional[List[Path]] = None, launch_dir: Optional[str] = None
) -> JobFailedError:
    """The root-cause rank first (what failed, how), any other failed rank, where the logs are.

    `stderr_logs[local_rank]` is that rank's stderr file, read when the rank left no
    traceback (a script, a native crash); it is named relative to `launch_dir`, where the
    user launched the sweep and reads its console, when it lies below it.
    """
    root_rank, root = error.get_first_failure()

    def stderr_of(failure: ProcessFailure) -> Optional[Path]:
        if stderr_logs and 0 <= failure.local_rank < len(stderr_logs):
            return stderr_logs[failure.local_rank]
        return None

    first = f"rank {root_rank} (local_rank {root.local_rank}, pid {root.pid}) {_cause(root)}"
    exception = _exception_line(root)
    lines = [f"{first}: {exception}" if exception else first]
    for rank in sorted(rank for rank in error.failures if rank != root_rank):
        failure = error.failures[rank]
        lines.append(f"also failed: rank {rank} (local_rank {failure.local_rank}) {_cause(failure)}")
    log = stderr_of(root)
    if log is not None and log.is_file():
        lines.append(f"its output: {shown_path(str(log), launch_dir)}")
    if _left_error_file(root):
        return JobFailedError("\n".join(lines), _traceback(root))
    return JobFailedError("\n".join(lines), tail=_tail(log))


def job_error(
    error: ChildFailedError, stderr_logs: Optional[List[Path]] = None, launch_dir: Optional[str] = None
) -> Exception:
    """The job's error: the root-cause rank's own exception when it left one, else `describe`'s.

    The rank's exception comes with its frames and chain (`_rank.error`), as Hydra's own
    launchers hand back a task's; it keeps `describe`'s account (rank first) for the
    launcher's lines and table, and as its first note, without repeating its own message.
    """
    failed = describe(error, stderr_logs, launch_dir)
    _, root = error.get_first_failure()
    rank_error = read_rank_exception(str(root.error_file)) if _left_error_file(root) else None
    if not isinstance(rank_error, Exception):
        return failed
    first, *rest = failed.message.splitlines()
    said = f": {_exception_line(root)}"
    headline = first[: -len(said)] if first.endswith(said) else first
    return with_summary(rank_error, failed.message, "\n".join([headline, *rest]))
