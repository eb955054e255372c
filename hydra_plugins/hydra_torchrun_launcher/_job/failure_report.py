"""Turn a torch elastic failure into the error a user reads: one story per failed job.

The console already showed the failed rank's own lines (its traceback included, prefixed
with its rank). The job's error then says, in a few lines, which rank failed first, how
(its exception, signal or exit code), every other rank that failed on its own, and where
their full logs are. A rank that raised hands back its own exception (`job_error`); one that
failed without a Python exception (a signal, an exit code, a training script) has no
traceback to show, so its error ends with the last lines of the rank's stderr, which Hydra
prints at the end of the sweep as it prints a task's traceback: the job's line, the table
and `sweep_summary.json` keep the short account, which travels beside the error
(`_rank.carried_exception.FailureAccount`).

The first cause wins (`_job.preempt`): a stop signal that comes while the job's ranks shut
down after a failure is said after it, and the job stays FAILED. A job past its `job_timeout` names the
ranks still running, with their last lines and where each one was (`deadline_report`).
"""

import json
import os
import re
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from hydra.core.utils import JobReturn, JobStatus
from hydra.errors import CompactHydraException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from .._rank.carried_exception import (
    EXCEPTION_FILE,
    SUMMARY_ATTR,
    FailureAccount,
    message_of,
    read_rank_exception,
    with_summary,
)
from .._shared.paths import shown_path
from .._shared.stop_files import LiveRank
from .preempt import failed_first, rank_exits, stop_after, stop_came_at

_STDERR_TAIL_LINES = 20
# a live rank's last lines of output, of each stream, in the error of a job past its job_timeout
_LIVE_TAIL_LINES = 10
# a live rank's stack as faulthandler dumped it: at most this many lines of it
_STACK_LINES = 60
# what torch puts in ProcessFailure.error_file when the rank left none
_NO_ERROR_FILE = "<N/A>"
_ERROR_FILE = "error.json"
# the signals by which the agent itself stops a rank: a rank they ended did not fail
_STOPPING = (-signal.SIGTERM, -signal.SIGKILL)
# a rank's exception in the account (the job's line, the table, sweep_summary.json): at
# most this many characters of it, its head and tail; the rank's output holds it whole
_EXCEPTION_HEAD = 600
_EXCEPTION_TAIL = 300


class RankTraceback(Exception):
    """What a failed rank left: its traceback, or the last lines of its stderr."""


class JobFailedError(CompactHydraException, RuntimeError):
    """A sweep job that failed: its message names the rank first; the details are its cause.

    A `CompactHydraException`, so Hydra prints the message alone at the end of a sweep
    instead of the launcher's frames. It is rebuilt from `args` when unpickled, so the
    cause survives the trip from the job's process to the launcher. `tail`, the last lines
    of a rank that left no traceback, follows the message in `str()` (what Hydra prints);
    the launcher's own lines take the message alone (`_rank.carried_exception.failure_summary`).
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


class JobPastDeadline(JobFailedError):
    """A job stopped at its `job_timeout`: its message names the ranks still running then
    (`deadline_report`), and the reports of a job's nodes make one (`merged_deadline`)."""


class JobStopped(JobFailedError):
    """A job ended by a stop signal (Ctrl-C, SIGTERM) before anything of its own failed:
    the launcher records it STOPPED (it runs again when the sweep resumes)."""


def failed_return(message: str) -> JobReturn:
    """A FAILED JobReturn whose error says `message` (a job that left no result of its own)."""
    failed = JobReturn(status=JobStatus.FAILED)
    failed.return_value = JobFailedError(message)
    return failed


def process_end(status: int) -> str:
    """How a job's process ended, from its wait status: "was killed by signal SIGKILL"."""
    if os.WIFSIGNALED(status):
        return f"was killed by signal {signal.Signals(os.WTERMSIG(status)).name}"
    return f"exited with code {os.waitstatus_to_exitcode(status)}"


def failed_before_stop(
    error_dirs: Dict[int, Path], ranks: Dict[int, LiveRank], name: str
) -> Optional[ChildFailedError]:
    """After a stop ended the agent: the ranks that had failed on their own before the stop
    came (the agent had not seen them yet: their exception, left before the signal), as the
    agent reports failed ranks; None if none had. `ranks`: the ranks' processes by local rank."""
    came_at = stop_came_at()
    if came_at is None:
        return None
    exits = rank_exits()
    failed = {}
    for local_rank, directory in error_dirs.items():
        try:
            if (directory / EXCEPTION_FILE).stat().st_mtime >= came_at:
                continue
        except OSError:
            continue
        pid, code = exits.get(local_rank, (None, None))
        known = ranks.get(local_rank)
        # (torch's error file is written as the rank exits: the stop's signal ends its wait)
        failure = ProcessFailure(
            local_rank, pid or (known.pid if known else 0), code or 1, str(directory / _ERROR_FILE)
        )
        failed[known.rank if known else local_rank] = failure
    return ChildFailedError(name, failed) if failed else None


# ------------------------------------------------------------------ the account


class _Account:
    """The account of this job's error, as the job's process made it (one job per process)."""

    error: Optional[BaseException] = None
    account: Optional[FailureAccount] = None


def told(error: BaseException, summary: str, stopped: bool = False) -> BaseException:
    """`error` is the job's, with this account (what the launcher shows); returns it."""
    _Account.error = error
    _Account.account = FailureAccount(summary, stopped)
    return error


def account_for(error: Any) -> Optional[FailureAccount]:
    """The account made for `error` in this process, if it is the job's error."""
    if _Account.error is not None and error is _Account.error:
        return _Account.account
    return None


# ------------------------------------------------------------------ a failed rank


def _cause(failure: ProcessFailure) -> str:
    return _exit_cause(failure.exitcode)


def _exit_cause(exitcode: int) -> str:
    if exitcode < 0:
        try:
            return f"was killed by signal {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"was killed by signal {-exitcode}"
    if exitcode == 0:  # a function rank's process that ended before torch took its value
        return "exited with code 0 before its task returned (os._exit?): its value is lost"
    return f"exited with code {exitcode}"


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


def error_dirs_of(error: ChildFailedError, nproc: int) -> Dict[int, Path]:
    """Each local rank's dir of torch's error file, in the attempt that failed (where a rank
    that raised left it, and its exception beside it); {} where torch keeps them elsewhere."""
    _, root = error.get_first_failure()
    if not _left_error_file(root):
        root = next((f for f in error.failures.values() if _left_error_file(f)), root)
    if not _left_error_file(root):
        return {}
    own = Path(str(root.error_file)).parent
    if own.name != str(root.local_rank):
        return {}
    return {local_rank: own.parent / str(local_rank) for local_rank in range(nproc)}


def _raised(directory: Optional[Path]) -> str:
    """ "ValueError: bad lr" when the rank whose error file lives in `directory` raised."""
    if directory is None:
        return ""
    try:
        data = json.loads((directory / _ERROR_FILE).read_text())
        message = data.get("message", {})
        message = message.get("message", "") if isinstance(message, dict) else message
        lines = str(message).strip().splitlines()
        if lines:
            return lines[0]
    except (OSError, ValueError, AttributeError):
        pass
    if not (directory / EXCEPTION_FILE).is_file():
        return ""
    error = read_rank_exception(str(directory / _ERROR_FILE))
    return f"{type(error).__name__}: {message_of(error)}".splitlines()[0] if error is not None else ""


def _bounded(exception: str, has_output: bool) -> str:
    """An exception's line as the account says it: whole up to a few hundred characters, else
    its head and tail, with how much was cut and where it is whole. A message of megabytes (a
    tensor's repr, a whole config) would otherwise fill the console and the sweep's record."""
    if len(exception) <= _EXCEPTION_HEAD + _EXCEPTION_TAIL:
        return exception
    cut = len(exception) - _EXCEPTION_HEAD - _EXCEPTION_TAIL
    where = "the whole is in its output" if has_output else "the whole was on the rank's console"
    head, tail = exception[:_EXCEPTION_HEAD], exception[-_EXCEPTION_TAIL:]
    return f"{head} ... [{cut} characters cut: {where}] ... {tail}"


@dataclass
class _Failed:
    rank: int
    local_rank: int
    pid: Optional[int]
    cause: str  # "exited with code 1", or "" when its exit is not known
    exception: str  # "ValueError: ...", or ""

    def said(self, detail: bool = True) -> str:
        who = f"rank {self.rank} (local_rank {self.local_rank}" + (f", pid {self.pid})" if self.pid else ")")
        line = f"{who} {self.cause}" if self.cause else who
        return f"{line}: {self.exception}" if self.exception else line


def _other_failures(error: ChildFailedError, error_dirs: Dict[int, Path], nproc: int) -> List[_Failed]:
    """Every rank but the first cause that failed on its own, by rank: those torch's agent
    reports (less the survivors its shutdown ended), those it found ended with a failure
    when it acted, and those that raised while the job shut down (their exception left)."""
    root_rank, root = error.get_first_failure()
    base = root_rank - root.local_rank  # global rank of local rank 0 on this node
    exits = rank_exits()
    found: Dict[int, _Failed] = {}
    for rank, failure in error.failures.items():
        if rank == root_rank:
            continue
        exception = _exception_line(failure) or _raised(error_dirs.get(failure.local_rank))
        if failure.exitcode in _STOPPING and not exception and failure.local_rank not in failed_first():
            continue  # a survivor the agent stopped
        # one that raised and was then stopped on its way out: its exception says what it did
        cause = "" if exception and failure.exitcode in _STOPPING else _cause(failure)
        found[failure.local_rank] = _Failed(rank, failure.local_rank, failure.pid, cause, exception)
    for local_rank in range(nproc):
        if local_rank == root.local_rank or local_rank in found:
            continue
        exception = _raised(error_dirs.get(local_rank))
        seen = failed_first().get(local_rank)
        if not exception and seen is None:
            continue
        pid, code = exits.get(local_rank, (None, None))
        if seen is not None:
            pid, code = seen
        # a rank that raised, then was stopped with the others while it was on its way out
        cause = _exit_cause(code) if code is not None and (seen is not None or code > 0) else ""
        found[local_rank] = _Failed(base + local_rank, local_rank, pid, cause, exception)
    return [found[local_rank] for local_rank in sorted(found)]


def describe(
    error: ChildFailedError,
    stderr_logs: Optional[List[Path]] = None,
    launch_dir: Optional[str] = None,
    nproc: int = 0,
) -> JobFailedError:
    """The first cause's rank first (what failed, how), then every other rank that failed,
    each followed by where its output is.

    `stderr_logs[local_rank]` is that rank's stderr file, read when the first rank left no
    traceback (a script, a native crash); it is named relative to `launch_dir`, where the
    user launched the sweep and reads its console, when it lies below it.
    """
    root_rank, root = error.get_first_failure()
    nproc = max(nproc, len(stderr_logs or []), root.local_rank + 1)
    error_dirs = error_dirs_of(error, nproc)

    def output(local_rank: int) -> List[str]:
        log = stderr_logs[local_rank] if stderr_logs and 0 <= local_rank < len(stderr_logs) else None
        if log is None or not log.is_file():
            return []
        return [f"its output: {shown_path(str(log), launch_dir)}"]

    def exception(line: str, local_rank: int) -> str:
        return _bounded(line, bool(output(local_rank)))

    first = _Failed(
        root_rank, root.local_rank, root.pid, _cause(root), exception(_exception_line(root), root.local_rank)
    )
    lines = [first.said(), *output(root.local_rank)]
    for other in _other_failures(error, error_dirs, nproc):
        other.exception = exception(other.exception, other.local_rank)
        lines += [f"also failed: {other.said()}", *output(other.local_rank)]
    log = stderr_logs[root.local_rank] if stderr_logs and root.local_rank < len(stderr_logs) else None
    if _left_error_file(root):
        return JobFailedError("\n".join(lines), _traceback(root))
    return JobFailedError("\n".join(lines), tail=_tail(log))


def job_error(
    error: ChildFailedError,
    stderr_logs: Optional[List[Path]] = None,
    launch_dir: Optional[str] = None,
    nproc: int = 0,
) -> BaseException:
    """The job's error: the root-cause rank's own exception when it left one, else `describe`'s.

    The rank's exception comes with its frames and chain (`_rank.carried_exception`), as Hydra's own
    launchers hand back a task's; `describe`'s account (rank first) is what the launcher
    shows (`told`), and the exception's first note, without repeating its own message. A
    stop that came during the shutdown is said after it.
    """
    failed = describe(error, stderr_logs, launch_dir, nproc)
    after = stop_after()
    summary = "\n".join([failed.message, after]) if after else failed.message
    _, root = error.get_first_failure()
    rank_error = read_rank_exception(str(root.error_file)) if _left_error_file(root) else None
    if not isinstance(rank_error, Exception):
        if after:
            failed = JobFailedError(summary, failed.details, failed.tail)
        return told(failed, summary)
    first, *rest = summary.splitlines()
    # the note says the rank and its exit: the exception's own line is printed above it
    headline = first.split(": ", 1)[0] if _exception_line(root) else first
    return told(with_summary(rank_error, summary, "\n".join([headline, *rest])), summary)


def job_failed(
    message: str, stopped: bool = False, details: str = "", tail: str = "", kind: type = JobFailedError
) -> JobFailedError:
    """A failure of the job itself (its deadline, its rendezvous; a stop: `stopped`), told;
    a stop that came after a first cause of the job's own is said after it."""
    after = None if stopped else stop_after()
    if after:
        message = f"{message}\n{after}"
    error = (JobStopped if stopped else kind)(message, details, tail)
    told(error, message, stopped)
    return error


# ------------------------------------------------------------------ past job_timeout


def _read_tail(path: Optional[Path], lines: int, start: int = 0, end: Optional[int] = None) -> List[str]:
    """The last `lines` lines of `path` between byte `start` and `end` (the end of the file)."""
    if path is None:
        return []
    try:
        with path.open("rb") as f:
            f.seek(start)
            data = f.read() if end is None else f.read(max(0, end - start))
    except OSError:
        return []
    text = data.decode(errors="replace").rstrip("\n")
    return text.splitlines()[-lines:] if text else []


# a frame of faulthandler's dump: `  File "/path/app.py", line 12 in train`
_DUMPED_FRAME = re.compile(r'^\s*File "(?P<file>.*)", line (?P<line>\d+) in (?P<name>.*)$')
# the launcher's own frames below a rank's task (`run_rank` and the `_run_rank` it calls):
# the frames under the first of them are plumbing
_RANK_ENTRY = (("run_rank", "_run_rank"), os.path.join("_rank", "worker.py"))


def _is_rank_entry(match: "re.Match[str]") -> bool:
    return match["name"] in _RANK_ENTRY[0] and match["file"].endswith(_RANK_ENTRY[1])


def _threads(dump: List[str]) -> List[List[str]]:
    """faulthandler's dump, a list of lines per thread (its header first)."""
    threads: List[List[str]] = []
    for line in dump:
        if not _DUMPED_FRAME.match(line) and line.strip():
            threads.append([line])
        elif threads and line.strip():
            threads[-1].append(line)
    return threads


def _entered(thread: List[str]) -> bool:
    """Whether the thread runs the launcher's rank entry (`run_rank`): a task's main thread."""
    matches = [_DUMPED_FRAME.match(line) for line in thread[1:]]
    return any(match is not None and _is_rank_entry(match) for match in matches)


def _task_frames(thread: List[str]) -> List["re.Match[str]"]:
    """The frames of a thread above the rank's entry point (most recent first)."""
    frames = []
    for line in thread[1:]:
        match = _DUMPED_FRAME.match(line)
        if match is None:
            continue
        if _is_rank_entry(match):
            break
        frames.append(match)
    return frames


def _stack(dump: List[str]) -> "Tuple[List[str], str]":
    """The dump without the launcher's frames below the task, and where the rank's main
    thread (the one that runs the task) was: "in barrier (distributed_c10d.py:5356), called
    from train (train.py:42)" (the innermost frame, then the innermost of the app's own, a
    file outside Python's and its packages' dirs)."""
    threads = _threads(dump)
    shown: List[str] = []
    where = ""
    entered = [_entered(thread) for thread in threads]
    for thread, entry in zip(threads, entered):
        frames = _task_frames(thread)
        # the thread that runs the task; in a training script's rank (no entry of the
        # launcher's), the one that runs the script's body
        main = entry or (not any(entered) and any(m["name"] == "<module>" for m in frames))
        shown += [thread[0], *(f'  File "{m["file"]}", line {m["line"]} in {m["name"]}' for m in frames)]
        if main and frames:
            first = frames[0]
            where = f"in {first['name']} ({os.path.basename(first['file'])}:{first['line']})"
            own = next((m for m in frames if _apps_own(m["file"])), None)
            if own is not None and own is not first:
                where += f", called from {own['name']} ({os.path.basename(own['file'])}:{own['line']})"
    return shown, where


def _apps_own(path: str) -> bool:
    """Whether a file is the app's own: not in Python's library, an installed package or this
    launcher (installed editable, outside site-packages: `preemption.should_stop()`'s
    collective is where a rank is, the app's loop that called it where the user looks)."""
    return (
        "site-packages" not in path
        and "dist-packages" not in path
        and not path.startswith(_STDLIB)
        and not path.startswith(_LAUNCHER_DIR)
    )


_STDLIB = os.path.dirname(os.__file__)
_LAUNCHER_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


@dataclass
class LiveRankReport:
    """A rank still running at the job's deadline, and what it left: its last lines, its stack."""

    rank: LiveRank
    stdout: Optional[Path]
    stderr: Optional[Path]
    stderr_size: int  # before its stack was asked for
    dumped: bool  # its stack was asked for (it registered faulthandler)
    dump_end: int = 0  # the size of its stderr once its stack was written


def deadline_report(
    timeout: float,
    live: List[LiveRankReport],
    launch_dir: Optional[str],
    host: Optional[str] = None,
    returned: Sequence[LiveRank] = (),
) -> JobFailedError:
    """The job's error past `job_timeout`: the ranks still running then and where each one was
    (the account), and, for Hydra's last word, each one's last lines and its stack. On a host
    of its own (`torchrun_ssh`), a rank's pid says which host it is a pid of. A node of a
    multi-node job none of whose ranks still ran names those that had `returned`: it was
    waiting for the other nodes, whose reports name theirs (`merged_deadline`)."""
    lines = [f"the job ran past hydra.launcher.job_timeout={timeout:g}s; its ranks were stopped"]
    on = f" on {host}" if host else ""
    if not live and returned:
        ended = ", ".join(f"rank {rank.rank} (local_rank {rank.local_rank}{on})" for rank in returned)
        lines.append(f"had returned: {ended}; its node was waiting for the job's other nodes")
    tail: List[str] = []
    for report in live:
        rank = report.rank
        dump = (
            _read_tail(report.stderr, 10 * _STACK_LINES, report.stderr_size, report.dump_end)
            if report.dumped
            else []
        )
        stack, where = _stack(dump)
        said = f"still running: rank {rank.rank} (local_rank {rank.local_rank}, pid {rank.pid}{on})"
        lines.append(f"{said} {where}" if where else said)
        if report.stderr is not None and report.stderr.is_file():
            lines.append(f"its output: {shown_path(str(report.stderr), launch_dir)}")
        before = _read_tail(report.stderr, _LIVE_TAIL_LINES, 0, report.stderr_size)
        printed = _read_tail(report.stdout, _LIVE_TAIL_LINES)
        name = f"rank {rank.rank}"
        if printed:
            tail += [f"{name}'s last lines of stdout:", *printed]
        if before:
            tail += [f"{name}'s last lines of stderr:", *before]
        if stack:
            tail += [f"{name}'s stack when it was stopped:", *stack[:_STACK_LINES]]
        elif not report.dumped:
            unknown = "not known (a launch prefix or a program not Python runs there)"
            tail.append(f"{name}'s stack: {unknown}")
    return job_failed("\n".join(lines), tail="\n".join(tail), kind=JobPastDeadline)


def merged_deadline(reports: List[JobPastDeadline]) -> JobPastDeadline:
    """One error for a multi-node job past its `job_timeout`, from each node's report (each
    names only its own node's ranks): the first's heading, then every node's ranks and their
    lines, node by node, as the local launcher names every rank of its one node."""
    first, *_ = [report.message.splitlines() for report in reports]
    lines = first[:1] + [line for report in reports for line in report.message.splitlines()[1:]]
    tails = [report.tail for report in reports if report.tail]
    return JobPastDeadline("\n".join(lines), tail="\n".join(tails))
