"""The launcher's side of a preemption: the stop signal, the end of the sweep, the requeue.

From the launcher's `setup` (before the sweeper validates and launches its first batch) to
the sweep's end (Hydra's `on_multirun_end`, or the process's
exit), the launcher's `stop_signal` (SIGUSR2 unless configured; SLURM's
`--signal=USR2@120` sends it to every srun task, i.e. to the launcher on every node) is a
notice, not a kill: it is passed on to every running job's process (`_job.preempt`), whose
ranks stop at a step boundary; no further job starts. One that comes while jobs are
composed, or between a sweeper's batches, ends the sweep the same way at the next point
where the launcher looks. When the running jobs have ended the
launcher records the sweep, requeues the SLURM batch job when it should, and ends with one
line saying how the sweep resumes, and the signal's exit status (128 + its number).
A second notice changes nothing: the ranks are already stopping, within `stop_timeout`.
"""

import atexit
import itertools
import shutil
import signal
import sys
import threading
from contextlib import contextmanager
from types import FrameType
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from .._shared import slurm_commands
from .._shared.signals import group_signals, handled_by, signals_named


class StoppedBeforeJobs(Exception):
    """A stop signal (`signum`) came while the nodes were still agreeing on what to resume."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


class SweepStopped(BaseException):
    """Raised after a stop signal, once every running job has stopped."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


class _Handling:
    """Handlers installed until `release` (the previous ones back then)."""

    def __init__(self, handler: Callable[[int, Any], Any], signals: List[int]) -> None:
        self._handling = handled_by(handler, signals)
        self._handling.__enter__()

    def release(self) -> None:
        handling, self._handling = self._handling, None
        if handling is not None:
            handling.__exit__(None, None, None)


# never a `stop_signal`: SIGINT and SIGTERM stop a sweep at once; the others cannot be one
FORBIDDEN_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGKILL, signal.SIGSTOP, signal.SIGCHLD)


class StopRequest:
    """Ctrl-C, SIGTERM (any group signal but the stop signal) while a runner's jobs run: the
    first is passed on to every running job (`forward`: their ranks shut down gracefully, no
    job starts after it), a second one kills them (`forward(SIGKILL)`)."""

    def __init__(self, forward: Callable[[int], Any], stop_signal: Optional[int]) -> None:
        self.signum: Optional[int] = None  # the first stop, once one came
        self._forward = forward
        self._stop_signal = stop_signal  # a preemption notice, not a stop (`StopNotice`)

    def _handle(self, signum: int, frame: Optional[FrameType]) -> None:
        if self.signum is None:
            self.signum = signum
            self._forward(signum)
        else:  # a second stop: no more waiting for the ranks' graceful shutdown
            self._forward(signal.SIGKILL)

    @contextmanager
    def handling(self) -> Iterator[None]:
        """Our handler for the group signals the launcher does not ignore (main thread only)."""
        with handled_by(self._handle, [sig for sig in group_signals() if sig != self._stop_signal]):
            yield

    def raise_if_stopped(self) -> None:
        """SweepStopped, once a stop came."""
        if self.signum is not None:
            raise SweepStopped(self.signum)


class StopNotice:
    """The stop signal as the launcher receives it during one launch."""

    def __init__(self, signum: Optional[int]) -> None:
        self.signum = signum
        # the launcher got the signal, or a job of a multi-node sweep was preempted on another node
        self.received = False
        # passes the signal on to the running jobs' processes (set by the job pool)
        self.forward: Callable[[int], Any] = lambda signum: None
        # our handler of the stop signal, from `install` to `release`
        self._listening: Optional[_Handling] = None

    def _handle(self, signum: int, frame: Optional[FrameType]) -> None:
        self.received = True
        self.forward(signum)

    def _interrupt(self, signum: int, frame: Optional[FrameType]) -> None:
        self.received = self.received or signum == self.signum
        raise StoppedBeforeJobs(signum)

    @contextmanager
    def interrupting(self) -> Iterator[None]:
        """Around a wait for other nodes before any job starts: the stop signal, Ctrl-C or
        SIGTERM end it at once with StoppedBeforeJobs (nothing of the sweep has run; the
        launcher then ends). Signals the launcher ignores stay ignored."""
        if self.received:
            assert self.signum is not None
            raise StoppedBeforeJobs(self.signum)
        with handled_by(self._interrupt, group_signals()):
            yield

    def install(self) -> None:
        """Our handler for the stop signal until `release` (main thread only; a launcher
        that ignores the signal keeps ignoring it, and so do its jobs)."""
        self._listening = _Handling(self._handle, [] if self.signum is None else [self.signum])

    def release(self) -> None:
        """The launcher's own handler of the stop signal back."""
        listening, self._listening = self._listening, None
        if listening is not None:
            listening.release()


def sweep_stop_signal(config: DictConfig) -> Optional[int]:
    """The sweep's `stop_signal` before any job is composed; None when it is off, for a dry
    run, or not one signal (each job's check then refuses it, naming the job)."""
    if OmegaConf.select(config, "hydra.launcher.dry_run", throw_on_resolution_failure=False) is True:
        return None
    raw = OmegaConf.select(config, "hydra.launcher.stop_signal", throw_on_resolution_failure=False)
    named = signals_named(raw) if isinstance(raw, str) and "," not in raw else []
    return named[0] if len(named) == 1 and named[0] not in FORBIDDEN_STOP_SIGNALS else None


# the notices (and stop handlers) installed, by the token their release callback holds
_INSTALLED: Dict[int, Any] = {}
_TOKENS = itertools.count()


class StopWhileNoJobRuns:
    """Ctrl-C or SIGTERM while no job of the sweep runs: Hydra's sweeper composes a batch, the
    launcher composes its jobs or waits for its warm server, a sweeper is between batches.
    One line and the status a shell expects (128 + the signal), as when jobs run, instead
    of a traceback (Python's KeyboardInterrupt) or a silent end (SIGTERM's default). The
    record, if the sweep has one, says the run did not reach its end (it resumes). While
    jobs run, the job pool (or the SLURM submission) handles the signals and puts this back."""

    # the signal that stopped the sweep, once one has: the SystemExit raised for it may have
    # been dropped (Python drops what a finalizer raises, and a handler runs within whatever
    # Python code runs at that moment); `exit_if_stopped` ends the launch then
    stopped_by: Optional[signal.Signals] = None

    def __init__(self, launcher: Any) -> None:
        self.launcher = launcher

    def __call__(self, signum: int, frame: Optional[FrameType]) -> None:
        sig = signal.Signals(signum)
        if StopWhileNoJobRuns.stopped_by is None:
            StopWhileNoJobRuns.stopped_by = sig
            report = getattr(self.launcher, "report", None)
            if report is not None and report.all_ended_untold():
                # every job ended; the runner lets its processes go (a host's agent, the job
                # pool): the sweep ended, its table comes, then the exit (`exit_if_stopped`)
                print(
                    f"[torchrun launcher] {sig.name}: every job of the sweep had ended; "
                    "the launcher ends after its table",
                    file=sys.stderr,
                    flush=True,
                )
                return
            if report is not None:
                report.interrupted = True
                report.write()
            line = f"[torchrun launcher] {sig.name}: the sweep was stopped while no job of it was running"
            print(line, file=sys.stderr, flush=True)
        raise SystemExit(128 + sig)


def exit_if_stopped() -> None:
    """End the launch if a stop signal came while no job ran and its SystemExit did not end
    it (it was raised inside a finalizer, which Python prints and drops): no job starts after
    the line that said the sweep was stopped. After the table too: a stop that came once
    every job had ended ends the launcher there."""
    sig = StopWhileNoJobRuns.stopped_by
    if sig is not None:
        raise SystemExit(128 + sig)


def handle_stops_while_no_job_runs(launcher: Any, callbacks: Any) -> None:
    """`StopWhileNoJobRuns` for SIGINT and SIGTERM where each is at Python's default (an app's
    own handler, or a signal ignored, is left alone), from the launcher's set-up to the
    sweep's end (`on_multirun_end` of Hydra's `callbacks`; else the process's exit)."""
    defaults = {signal.SIGINT: signal.default_int_handler, signal.SIGTERM: signal.SIG_DFL}
    signals = [sig for sig, default in defaults.items() if signal.getsignal(sig) == default]
    handling = _Handling(StopWhileNoJobRuns(launcher), signals)
    _release_at_sweep_end(handling, callbacks)
    sigint_ends_the_exit()


def sigint_ends_the_exit() -> None:
    """`_at_exit` as the newest atexit callback, so that it runs first as the process exits
    (called again as each launch ends: what the launch registered runs after it)."""
    atexit.unregister(_at_exit)
    atexit.register(_at_exit)


def _at_exit() -> None:
    """The process exits: the handlers still installed (a sweep that ended by an exception,
    a failed job or a preemption's exit, has no on_multirun_end) are released, and a Ctrl-C
    from here on ends the process by SIGINT, the kernel's default (as SIGTERM's is). What
    runs now are atexit callbacks (the warm server reaped, the app's libraries' own: torch's
    take tens of ms), where Python prints and drops a KeyboardInterrupt and the process exits
    0, as if nobody had pressed Ctrl-C: a shell's `sweep && next` would go on. Ended by
    SIGINT, it exits as a Python program a KeyboardInterrupt ended does (130 to a shell)."""
    for token in list(_INSTALLED):
        _INSTALLED.pop(token).release()
    main_thread = threading.current_thread() is threading.main_thread()
    if main_thread and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, signal.SIG_DFL)


def _release_at_sweep_end(installed: Any, callbacks: Any) -> None:
    token = next(_TOKENS)
    _INSTALLED[token] = installed
    registered = getattr(callbacks, "callbacks", None)
    if isinstance(registered, list):
        registered.append(ReleaseAtSweepEnd(token))


def sweep_notice(existing: Optional[StopNotice], signum: Optional[int], callbacks: Any) -> StopNotice:
    """The sweep's stop notice: `existing` (the launcher's, from an earlier batch), else a new
    one, installed now and kept across a sweeper's batches. `callbacks`: Hydra's callbacks
    of the sweep (`HydraContext.callbacks`); the notice is released at their
    `on_multirun_end`, so the app has its own handler back after the sweep (where Hydra's
    list of callbacks is not there, at the process's exit)."""
    if existing is not None:
        return existing
    notice = StopNotice(signum)
    notice.install()
    _release_at_sweep_end(notice, callbacks)
    return notice


class ReleaseAtSweepEnd(Callback):
    """Hydra's callback that ends a sweep's stop notice (or stop handlers). It travels with the
    sweep's callbacks to every job's process, which has none: there it does nothing."""

    def __init__(self, token: int) -> None:
        self.token = token

    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:
        notice = _INSTALLED.pop(self.token, None)
        if notice is not None:
            notice.release()


def end_preempted(
    signum: int, summary: str, sweep_dir: str, resume: Any, requeue: Any, environ: Mapping[str, str]
) -> None:
    """After a preemption: requeue (node 0 of a SLURM batch job), one line, a non-zero exit.

    `sweep_dir` is the sweep dir as the user types it; `resume` and `requeue` are the
    sweep's settings of those keys.
    """
    requeued = requeue_slurm_job(environ) if requeue == "auto" else None
    how = requeued or _resume_hint(sweep_dir, resume)
    sig = signal.Signals(signum)
    line = f"[torchrun launcher] {sig.name}: the sweep was preempted: {summary}. {how}"
    print(line, file=sys.stderr, flush=True)
    raise SystemExit(128 + sig)


def _resume_hint(sweep_dir: str, resume: Any) -> str:
    """How the sweep resumes: the same command, in the same sweep dir."""
    if resume is False:
        return "hydra.launcher.resume=false: running the same command again runs every job again"
    return (
        f"To resume it, run the same command with hydra.sweep.dir={sweep_dir}: completed jobs are "
        "not run again, preempted ones continue in their job dir"
    )


def requeue_slurm_job(environ: Mapping[str, str], job_id: Optional[str] = None) -> Optional[str]:
    """Requeue the SLURM batch job this launcher runs in, from its node 0; what was done.

    None outside a SLURM job; on another node, that node 0 does it. A job SLURM will
    not requeue (submitted with --no-requeue, not a batch job) is said in one line: the
    sweep's record is written already: submitted again with the same sweep dir, it resumes.
    `job_id`: the id to give scontrol (a job of an array: `<array id>_<task id>`, since the
    raw id of an array's last job names the whole array).
    """
    job_id = job_id or environ.get("SLURM_JOB_ID") or environ.get("SLURM_JOBID")
    if not job_id:
        return None
    if environ.get("SLURM_NODEID", "0") != "0":
        return f"node 0 requeues SLURM job {job_id} (hydra.launcher.requeue=auto)"
    if shutil.which("scontrol") is None:
        return f"SLURM job {job_id} was not requeued: scontrol is not on PATH"
    try:
        fields = slurm_commands.show_job(job_id) or {}
    except slurm_commands.SlurmCommandError:
        fields = {}  # `scontrol requeue`, next, says whether it can requeue the job
    if fields.get("BatchFlag") == "0":
        return f"SLURM job {job_id} is not a batch job and cannot be requeued; run the same command again"
    if fields.get("Requeue") == "0":
        return (
            f"SLURM job {job_id} was not requeued: it was submitted with --no-requeue "
            "(hydra.launcher.requeue=auto); submit it again with the same hydra.sweep.dir to resume"
        )
    try:
        said = slurm_commands.requeue(job_id)
    except slurm_commands.SlurmCommandError as e:  # scontrol did not answer in time
        said = str(e)
    if said is not None:
        return f"SLURM job {job_id} was not requeued: scontrol requeue said {said!r}"
    return f"SLURM job {job_id} is requeued: the sweep resumes when it runs again"


def react_to_stop(stopped: SweepStopped, summary: str) -> None:
    """After a stop: what the signal would have done to the launcher without its jobs.

    The launcher's handlers are back. The app's own handler is called; Python's default
    Ctrl-C and a default SIGTERM end the launcher with one line instead of a traceback,
    with the exit status a shell expects (128 + the signal's number).
    """
    sig = signal.Signals(stopped.signum)
    handler = signal.getsignal(sig)
    if (
        callable(handler)
        and handler is not signal.default_int_handler
        and not isinstance(handler, StopWhileNoJobRuns)
    ):
        handler(sig, None)
        return
    print(f"[torchrun launcher] {sig.name}: {summary}", file=sys.stderr, flush=True)
    raise SystemExit(128 + sig)
