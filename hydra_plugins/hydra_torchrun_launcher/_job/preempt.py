"""The stop signal (a preemption notice) as a job's process receives it.

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
"""

import os
import signal
import time
from typing import Any, Optional

from hydra.errors import CompactHydraException
from torch.distributed.elastic.multiprocessing import SignalException

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
