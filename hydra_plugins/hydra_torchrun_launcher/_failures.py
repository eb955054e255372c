"""Turn a torch elastic failure into the error a user reads in the sweep's output."""

from pathlib import Path
from typing import Any, List, Optional

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

_STDERR_TAIL_LINES = 20
# what torch puts in ProcessFailure.error_file when the rank left none
_NO_ERROR_FILE = "<N/A>"


class JobFailedError(RuntimeError):
    """A sweep job in which a rank failed. Its message names the rank and carries its error."""


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


def _detail(failure: ProcessFailure, stderr_log: Optional[Path]) -> str:
    message: Any = failure.message
    if _left_error_file(failure):
        if isinstance(message, dict):
            callstack = message.get("extraInfo", {}).get("py_callstack")
            return str(callstack or message.get("message", "")).rstrip()
        return str(message).rstrip()
    if stderr_log is not None and stderr_log.is_file():
        lines = stderr_log.read_text(errors="replace").splitlines()[-_STDERR_TAIL_LINES:]
        if lines:
            return f"last lines of {stderr_log}:\n" + "\n".join(lines)
    return ""


def describe(error: ChildFailedError, stderr_logs: Optional[List[Path]] = None) -> JobFailedError:
    """The root-cause rank first (what failed, how, its traceback), then any other failed rank.

    `stderr_logs[local_rank]` is that rank's stderr file, read when the rank left no
    traceback (a script, a native crash).
    """
    root_rank, root = error.get_first_failure()

    def stderr_of(failure: ProcessFailure) -> Optional[Path]:
        if stderr_logs and 0 <= failure.local_rank < len(stderr_logs):
            return stderr_logs[failure.local_rank]
        return None

    lines = [
        f"rank {root_rank} (local_rank {root.local_rank}, pid {root.pid}) {_cause(root)}",
    ]
    detail = _detail(root, stderr_of(root))
    if detail:
        lines.append(detail)
    others = sorted(rank for rank in error.failures if rank != root_rank)
    for rank in others:
        failure = error.failures[rank]
        lines.append(f"also failed: rank {rank} (local_rank {failure.local_rank}) {_cause(failure)}")
    return JobFailedError("\n".join(lines))
