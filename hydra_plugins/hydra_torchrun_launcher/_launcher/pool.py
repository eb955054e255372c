"""Run a sweep's jobs, each in a process of its own, up to `parallel_jobs` at a time.

One code path for `parallel_jobs: 1` and `> 1`: the launcher's main thread starts job
processes through the warm server (in job order, as devices free up), waits for their
results, and hands back one `JobReturn` per job in job order. Concurrent jobs share no
process, so they share no process-global state.

Signals: while jobs run, a stop signal the launcher receives (Ctrl-C, SIGTERM, ...) is
passed on to every running job process, whose elastic agent stops its ranks through
torch's own shutdown path; no further job starts. When they have all ended, the
launcher's own handlers are back and the signal does what it would have done: the app's
handler runs, or the launcher ends with one line and the signal's exit status. A signal
the launcher ignores stays ignored by every job. A second signal during the stop kills
the job processes at once (their ranks die with them) and never leaves a handler of ours
behind. Job processes run in a process group of their own, so a terminal's Ctrl-C reaches
them once, through the launcher.
"""

import logging
import os
import selectors
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Set

import cloudpickle
from hydra.core.utils import JobReturn

from .._job.agent import job_log_dir
from .._job.failure_report import failed_return, process_end
from .._server.server import PreparedJob, WarmServer
from .._shared.paths import shown_path
from .._shared.plan import JobPlan
from .._shared.signals import send_signal
from .preempt import StopNotice, StopRequest
from .runner import hard_limit_s

log = logging.getLogger(__name__)


class DevicePool:
    """Device ids shared out to running jobs, each id to one job at a time."""

    def __init__(self, devices: Optional[List[str]]) -> None:
        self._free = list(devices) if devices is not None else None

    def take(self, count: int) -> "tuple[bool, Optional[List[str]]]":
        """(True, the lowest free ids) when `count` are free; (True, None) without devices."""
        if self._free is None:
            return True, None
        if len(self._free) < count:
            return False, None
        taken, self._free = self._free[:count], self._free[count:]
        return True, taken

    def give_back(self, devices: Optional[List[str]]) -> None:
        if self._free is not None and devices:
            self._free = sorted(self._free + devices, key=_device_order)


def _device_order(device: str) -> Any:
    return (0, int(device)) if device.isdigit() else (1, device)


@dataclass
class RunningJob:
    idx: int
    pid: int
    result_r: int
    devices: Optional[List[str]]
    kill_after: Optional[float]  # monotonic time after which the job process is killed
    data: List[bytes] = field(default_factory=list)


def run_jobs(
    server: WarmServer,
    jobs: Any,
    parallel_jobs: int,
    devices: Optional[List[str]],
    request_for: Callable[[Any, Optional[List[str]]], "tuple[bytes, Callable[[], None]]"],
    on_start: Callable[[Any, Optional[List[str]]], None],
    on_end: Callable[[Any, JobReturn, bool], None],
    notice: StopNotice,
) -> Dict[int, JobReturn]:
    """Run the jobs of `jobs` (a `JobFeed` of plans with `.idx` and `.nproc`), each asked for
    when a slot is free for it; the JobReturns of those that ran, by number.

    `request_for(job, devices)` is the encoded request for the job's process, made when it
    starts or, for a job whose process is forked ahead, before (on no devices), and what
    to do in its job dir as it starts. Past `hard_limit_s(job)` a job's process is killed
    outright.
    `on_start(job, devices)` and `on_end(job, job_return, stopped)` are called as each job
    starts and ends (`stopped`: it ended after a stop signal). Once `notice` is received (the
    stop signal, or a job preempted), it is passed on to the running jobs and no job starts.
    """
    by_idx: Dict[int, Any] = {}  # the running jobs' plans
    pool = DevicePool(devices)
    waiting = jobs.next()  # the next job to start, composed ahead of its slot
    running: Dict[int, RunningJob] = {}
    # job processes whose result has come, still exiting: reaped as the server reports them
    exiting: Set[int] = set()
    # the process of the next job to start (`waiting`), forked and given its request while
    # the jobs before it run: it reads it and takes the launcher's state meanwhile, and starts
    # at its go. Only where no devices are shared out (its request names none).
    ahead: Optional[tuple[PreparedJob, Callable[[], None]]] = None
    returns: Dict[int, JobReturn] = {}
    selector = selectors.DefaultSelector()

    def forward(sig: int) -> None:
        for job in running.values():
            send_signal(job.pid, sig)

    stop = StopRequest(forward, notice.signum)
    notice.forward = forward
    try:
        with stop.handling():
            while waiting is not None or running:
                starting = stop.signum is None and not notice.received
                while waiting is not None and len(running) < parallel_jobs and starting:
                    ok, taken = pool.take(waiting.nproc)
                    if not ok:
                        break
                    job = by_idx[waiting.idx] = waiting
                    on_start(job, taken)
                    running[job.idx] = _start(server, job, taken, request_for, ahead)
                    ahead = None
                    # a signal that came as it started, after the checks above, reaches it too
                    if stop.signum is not None:
                        send_signal(running[job.idx].pid, stop.signum)
                    elif notice.received and notice.signum is not None:
                        send_signal(running[job.idx].pid, notice.signum)
                    selector.register(running[job.idx].result_r, selectors.EVENT_READ, job.idx)
                    # composed while the job just started comes up: ready for the next free slot
                    waiting = jobs.next()
                if ahead is None and waiting is not None and devices is None and starting:
                    request, write_job_files = request_for(waiting, None)
                    ahead = server.prepare_job(request), write_job_files
                if not running:
                    break
                for key, _ in selector.select(timeout=_next_timeout(running)):
                    finished = running[key.data]
                    chunk = os.read(finished.result_r, 1 << 20)
                    if chunk:
                        finished.data.append(chunk)
                        continue
                    selector.unregister(finished.result_r)
                    os.close(finished.result_r)
                    del running[finished.idx]
                    pool.give_back(finished.devices)
                    returns[finished.idx] = _job_return(server, finished, by_idx[finished.idx], exiting)
                    on_end(by_idx.pop(finished.idx), returns[finished.idx], stop.signum is not None)
                _kill_overdue(running)
            stop.raise_if_stopped()
    finally:
        _end_job_processes(server, running, ahead[0] if ahead is not None else None, exiting)
        selector.close()
    return returns


def _end_job_processes(
    server: WarmServer, running: Dict[int, RunningJob], ahead: Optional[PreparedJob], exiting: Set[int]
) -> None:
    """As a launch returns or fails, every job process it started has ended: running ones
    (the launcher itself failed) are killed, the one forked ahead for a job that will not
    start now ends unused, and each is reaped. A server that died (killed outright) took
    them with it: there is nothing left to reap, and its death is the error already raised."""
    for job in running.values():
        send_signal(job.pid, signal.SIGKILL)
        os.close(job.result_r)
    if ahead is not None:
        ahead.cancel()
        os.close(ahead.result_r)
    if not server.alive():
        return
    started = [job.pid for job in running.values()] + ([ahead.pid] if ahead is not None else [])
    for pid in [*started, *exiting]:
        server.wait_exit(pid)


def _start(
    server: WarmServer,
    job: Any,
    devices: Optional[List[str]],
    request_for: Callable[[Any, Optional[List[str]]], "tuple[bytes, Callable[[], None]]"],
    ahead: Optional["tuple[PreparedJob, Callable[[], None]]"],
) -> RunningJob:
    """Start `job`: its process prepared `ahead` is told to go, or one is forked now."""
    if ahead is None:
        request, write_job_files = request_for(job, devices)
        ahead = server.prepare_job(request), write_job_files
    prepared, write_job_files = ahead
    write_job_files()
    prepared.go()
    pid, result_r = prepared.pid, prepared.result_r
    limit = hard_limit_s(job)
    return RunningJob(job.idx, pid, result_r, devices, None if limit is None else time.monotonic() + limit)


def _job_return(server: WarmServer, job: RunningJob, plan: JobPlan, exiting: Set[int]) -> JobReturn:
    """The job's JobReturn. A job ends when its result comes: its process, which has only its
    exit left to do, is reaped later (`exiting`), not waited for; one that ended without a
    result is waited for, to say how it ended."""
    server.forget_exited(exiting)
    if job.data:
        exiting.add(job.pid)
        return cloudpickle.loads(b"".join(job.data))
    how = process_end(server.wait_exit(job.pid))
    lines = [f"the job's process (pid {job.pid}) {how} before reporting a result", *_ranks_output(plan)]
    return failed_return("\n".join(lines))


def _ranks_output(plan: JobPlan) -> List[str]:
    """Where the ranks of a job whose process died wrote (its last attempt's dir of torch's
    logs, a dir per local rank), for a job's error that can say nothing else of them: what
    they printed up to their end (their parent-death signal) is there. [] before they ran."""
    attempts = Path(job_log_dir(plan)).glob(f"{plan.rendezvous.run_id}_*/attempt_*")
    latest = max(attempts, key=_modified, default=None)
    if latest is None:
        return []
    return [f"its ranks' output: {shown_path(str(latest), plan.launch_dir)} (stdout.log, stderr.log of each)"]


def _modified(path: Path) -> float:
    return path.stat().st_mtime


def _next_timeout(running: Dict[int, RunningJob]) -> Optional[float]:
    limits = [job.kill_after for job in running.values() if job.kill_after is not None]
    return max(0.0, min(limits) - time.monotonic()) if limits else None


def _kill_overdue(running: Dict[int, RunningJob]) -> None:
    """The backstop for a job process that outlived its deadline and its ranks' shutdown."""
    now = time.monotonic()
    for job in running.values():
        if job.kill_after is not None and now >= job.kill_after:
            log.warning(f"job #{job.idx}: its process did not end after its job_timeout; killing it")
            send_signal(job.pid, signal.SIGKILL)
            job.kill_after = None
