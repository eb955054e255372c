"""The stops of a job's process: the stop signal (a preemption notice), and Ctrl-C, SIGTERM
or another group signal against the job's first cause (a rank's failure, its deadline).

The stop signal.

The launcher passes its `stop_signal` on to every running job's process (under SLURM the
signal reaches each of them directly as well). Here it asks the job to end at a step
boundary instead of killing it:
- before the job's agent starts (Hydra's bookkeeping), it is recorded and the agent never
  starts;
- while the agent has no rank running yet (a multi-node rendezvous waiting for a node), it
  interrupts the agent as torch's own handler would;
- once ranks run, it creates the job's stop file, which their `preemption.should_stop()`
  reads, and gives them `stop_timeout` seconds to return; then they are stopped as on a
  failure (torch's shutdown path: the graceful signal, `shutdown_timeout`, SIGKILL).
The ranks themselves ignore the signal: under SLURM it reaches every process of the step.

The first cause wins: once a rank has failed (or the job has run past `job_timeout`), a
Ctrl-C or SIGTERM that comes while the job's ranks shut down does not interrupt that
shutdown; it is recorded, said after the failure (`_job.failure_report`), and the job stays
FAILED. Before that, such a signal interrupts torch's agent as the agent's own handler does.
"""

import os
import signal
import time
from contextlib import contextmanager
from typing import Any, Callable, Dict, Iterator, Optional, Tuple

from hydra.errors import CompactHydraException
from torch.distributed.elastic.multiprocessing import SignalException

from .._shared.signals import group_signals
from .._shared.stop_files import SEEN, STARTED, touch


class JobPreempted(CompactHydraException, RuntimeError):
    """The job ended because of a stop request: it runs again when the sweep resumes.

    `ranks_ran`: whether its ranks had started (and may have checkpointed); a job stopped
    before (in its rendezvous, in `on_job_start`) is not resumed but simply runs. Rebuilt
    from `args` when unpickled, so the flag survives the trip to the launcher.
    """

    def __init__(self, message: str, ranks_ran: bool = False) -> None:
        super().__init__(message, ranks_ran)
        self.message = message
        self.ranks_ran = ranks_ran

    def __str__(self) -> str:
        return self.message


class StopTimeout(BaseException):
    """The ranks did not return within `stop_timeout` after the stop request.

    BaseException, so no `except Exception` inside torch's agent takes it for a worker
    error; the agent's own shutdown path stops the ranks on the way out.
    """


class _Notice:
    """What this job's process knows of the stop request."""

    signum: Optional[int] = None  # the stop signal (None: preemption is off)
    received = False
    stop_file: Optional[str] = None  # made once the job's private dir exists
    timeout_s = 0.0
    agent_running = False
    deadline: Optional[float] = None  # monotonic time after which the ranks are stopped


# ------------------------------------------------------------------ the stop signal


def listen(signum: Optional[int], timeout_s: float) -> None:
    """From the job process's first instruction: the stop signal asks for a preemption."""
    _Notice.signum = signum
    _Notice.timeout_s = timeout_s
    if signum is not None and signal.getsignal(signum) != signal.SIG_IGN:
        signal.signal(signum, _stop_requested)


def _stop_requested(signum: int, frame: Any) -> None:
    _Notice.received = True
    if _Notice.stop_file is None or not _Notice.agent_running:
        return  # acted on when the agent starts: it does not
    touch(_Notice.stop_file)
    if os.path.exists(_Notice.stop_file + STARTED):
        _arm_deadline()
    else:  # no rank runs yet: nothing to checkpoint, no reason to wait
        raise SignalException(f"Process {os.getpid()} got signal: {signum}", sigval=signal.Signals(signum))


def _arm_deadline() -> None:
    """SIGALRM after `stop_timeout`, unless the job's own timeout comes first."""
    if _Notice.deadline is not None:
        return  # a second notice does not move the first's deadline
    _Notice.deadline = time.monotonic() + _Notice.timeout_s
    remaining, _ = signal.getitimer(signal.ITIMER_REAL)
    if remaining == 0 or _Notice.timeout_s < remaining:
        signal.signal(signal.SIGALRM, _raise_stop_timeout)
        signal.setitimer(signal.ITIMER_REAL, max(_Notice.timeout_s, 1e-3))


def _raise_stop_timeout(signum: int, frame: Any) -> None:
    raise StopTimeout()


def agent_starting(stop_file: str) -> None:
    """The agent is about to start with `stop_file` for its ranks: a notice that came
    earlier stops the job now."""
    _Notice.stop_file = stop_file
    if _Notice.received:
        raise JobPreempted("the job was preempted before its ranks started")
    _Notice.agent_running = True


def agent_ended() -> None:
    _Notice.agent_running = False


def outcome(interrupted_by: Optional[int] = None) -> Optional[JobPreempted]:
    """Whether the job, whose agent has returned, was preempted; None if it was not.

    `interrupted_by`: the signal whose SignalException ended the agent, if one did.
    """
    if interrupted_by is not None and interrupted_by == _Notice.signum:
        return JobPreempted("the job was preempted before its ranks started")
    if _Notice.stop_file is not None and os.path.exists(_Notice.stop_file + SEEN):
        # on a node that got no signal too: its ranks agreed with the others'
        return JobPreempted("the job stopped at a step boundary (preemption.should_stop())", ranks_ran=True)
    return None


def timed_out() -> JobPreempted:
    return JobPreempted(
        f"the job's ranks did not return within hydra.launcher.stop_timeout={_Notice.timeout_s:g}s "
        "after the stop request; they were stopped",
        ranks_ran=True,
    )


# ------------------------------------------------------------------ Ctrl-C, SIGTERM and the first cause


class _Stop:
    """The stop signal this job's process received, and whether it interrupts what runs.

    It interrupts only while torch's agent runs (`stops_interrupt`), as the agent's own
    handler does; elsewhere the signal is recorded and acted on at the next safe point,
    because an exception raised at an arbitrary instruction can leave a lock of `logging`
    or of a fork handler held.
    """

    received: Optional[signal.Signals] = None
    at: Optional[float] = None  # time.time() of the first one
    interrupting = False


class _FirstCause:
    """What ended the job first, as this process saw it: a rank's failure (seen by torch's
    agent, `_job.torch_adjustments`), the job's deadline, or a stop signal (`_Stop`)."""

    failure_seen_at: Optional[float] = None
    # local rank -> (pid, exit code) of the ranks found ended with a failure when the agent acted
    failed: Dict[int, Tuple[int, int]] = {}
    deadline_at: Optional[float] = None
    # local rank -> (pid, exit code) of every rank now, from torch's process context
    rank_exits: Optional[Callable[[], Dict[int, Tuple[int, Optional[int]]]]] = None


def ranks_failed(failed: Dict[int, Tuple[int, int]]) -> None:
    """torch's agent found these local ranks ended with a failure ((pid, exit code)) and now
    stops the others: from here on the failure is the job's first cause (unless the agent
    then restarts the ranks: `attempt_starting`)."""
    if not failed:
        return
    if _FirstCause.failure_seen_at is None and _FirstCause.deadline_at is None and _Stop.received is None:
        _FirstCause.failure_seen_at = time.time()
        _take_over_stops()
    for local_rank, exit in failed.items():
        _FirstCause.failed.setdefault(local_rank, exit)


def attempt_starting() -> None:
    """torch's agent starts (or restarts, `max_restarts`) the ranks: a failure seen before is
    not the job's outcome any more; a stop that came meanwhile stops the job now."""
    _FirstCause.failure_seen_at = None
    _FirstCause.failed = {}
    if _Stop.received is not None and _Stop.interrupting:
        _raise_stop()


def _take_over_stops() -> None:
    """The stop signals are this process's to handle again, not torch's agent's (whose handler
    would interrupt the shutdown of the job's first cause): they are recorded, and said after it."""
    for sig in group_signals():
        handler = signal.getsignal(sig)
        if callable(handler) and handler is not stop_requested:
            signal.signal(sig, stop_requested)


def rank_exits_from(source: Callable[[], Dict[int, Tuple[int, Optional[int]]]]) -> None:
    """Where the ranks' pids and exit codes are read once the agent is done."""
    _FirstCause.rank_exits = source


def forget_ranks() -> None:
    """The agent is done and its failure told: torch's process context (its ranks' pipes)
    goes with the agent, not held here."""
    _FirstCause.rank_exits = None


def rank_exits() -> Dict[int, Tuple[int, Optional[int]]]:
    """Every rank's (pid, exit code) by local rank, as torch's process context has them."""
    try:
        return _FirstCause.rank_exits() if _FirstCause.rank_exits is not None else {}
    except Exception:
        return {}


def deadline_first() -> bool:
    """The job's deadline came: it is the first cause unless a failure or a stop came before."""
    if _FirstCause.failure_seen_at is not None or _Stop.received is not None:
        return False
    _FirstCause.deadline_at = time.time()
    _take_over_stops()
    return True


def _first_cause_came() -> bool:
    return _FirstCause.failure_seen_at is not None or _FirstCause.deadline_at is not None


def _raise_stop() -> None:
    raise SignalException(f"Process {os.getpid()} got signal: {_Stop.received}", sigval=_Stop.received)


def stop_requested(signum: int, frame: Any) -> None:
    """The job process's handler of a stop signal, installed for the whole job.

    It records the signal; while torch's agent runs it also raises, as the agent's own
    handler does, so a stop that comes before the agent has ranks to watch (its rendezvous
    waiting for other nodes) ends the job the same way, with its JobReturn. It does not
    raise once a rank has failed or the job's deadline has come: the agent is stopping the
    ranks for that first cause already (within `shutdown_timeout`), and the failure stays
    the job's outcome; the stop is said after it.
    """
    if _Stop.received is None:
        _Stop.at = time.time()
    _Stop.received = signal.Signals(signum)
    if _Stop.interrupting and not _first_cause_came():
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


def stop_after() -> Optional[str]:
    """The line that says a stop came after the job's first cause (None if none came)."""
    if _Stop.received is None:
        return None
    return f"then {_Stop.received.name} stopped the sweep while the job's ranks were shutting down"


def stop_came_at() -> Optional[float]:
    """When (time.time()) the first of Ctrl-C, SIGTERM or another group signal came; None if none did."""
    return _Stop.at


def failed_first() -> Dict[int, Tuple[int, int]]:
    """The ranks torch's agent found failed when it acted ((pid, exit code) by local rank)."""
    return _FirstCause.failed
