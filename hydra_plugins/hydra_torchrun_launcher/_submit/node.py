"""What each node of a submitted job runs: `srun` starts it once per node.

    python -m hydra_plugins.hydra_torchrun_launcher._submit.node <sweep dir>/.slurm \
        SIGNAL_DELAY_S MAX_NUM_TIMEOUT

It reads the job's request (its number is the array task's, `SLURM_ARRAY_TASK_ID`), puts
this node in it (node rank `SLURM_NODEID`; the rendezvous on the job's first node, on a
port derived from the job's id, under an id that changes with every requeue), and runs the
job's process in this one (`_job.process.run_request`: the same path as a job of the local
launcher). Node 0 does Hydra's bookkeeping (run_job writes `.hydra/`, fires the
callbacks) and writes the job's result for the launcher; the other nodes run their agent
under the same job config without either. A node whose job failed (a rank of its own
failed) records the failure, unless another node did first, and exits non-zero (node 0
once it has written the job's result): srun
(`--kill-on-bad-exit`) then stops the job's other nodes, whose ranks would otherwise wait
in a collective for the failed rank, and the job's error is the rank's own.

A stop signal (SLURM's `--signal=USR2@...` or a preemption notice) reaches this process on
every node: the job's ranks stop at a step boundary together (`preemption.should_stop()`),
then node 0 requeues the job (`scontrol requeue`), unless it reached its time limit more
often than `max_num_timeout` allows; when SLURM runs it again, its ranks see
`preemption.resumed()` True in the same job dir.
"""

# ruff: noqa: E402 (the stop notice is held before any import: see below)
import signal
import time

# when this node's run began, before its imports: its time as SLURM counts it, near enough
_STARTED = time.time()

# SLURM's stop notice (USR2: a preemption, `signal_delay_s` before the time limit) may come
# in this process's first second, before its imports are done, where its default action
# would end the node: it is held from here, and delivered once the job process listens for
# it (`run_request` unblocks the group signals), to stop the job as any notice does
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR2})

import dataclasses
import logging
import os
import socket
import subprocess
import sys
import traceback
from multiprocessing import resource_tracker
from pathlib import Path
from typing import Any, Mapping, Optional

from hydra.core.utils import JobReturn, JobStatus

from .._job.failure_report import JobFailedError
from .._job.preempt import JobPreempted
from .._job.process import decode_request, pickled_return, run_request
from .._launcher.cluster_layout import derived_port
from .._launcher.cluster_slurm import expand
from .._launcher.preempt import requeue_slurm_job
from .._rank.carried_exception import ACCOUNT_ATTR, account_of, failure_summary
from .._shared import slurm_commands
from .._shared.plan import Rendezvous
from .._shared.private import remove_dead_private_dirs
from .._shared.slurm_commands import duration_s
from .._shared.stop_files import RANKS_STARTED_FILE
from .files import (
    RUN_TIME_ATTR,
    error_file,
    failure_file,
    read_private,
    replace_private,
    request_file,
    requeued_file,
    result_file,
    timeouts_file,
    write_first,
)

log = logging.getLogger(__name__)

# what the launcher says of a job that SLURM's preemption stopped (with SIGTERM, in its grace time)
_PREEMPTED_BY_SLURM = "was preempted by SLURM (which stopped its ranks)"
# a stop this close to the time limit (beyond signal_delay_s) is the time limit's, not a preemption
_TIME_LIMIT_MARGIN_S = 60


class _NoCallbacks:
    """Hydra's callbacks as the nodes other than node 0 see them: none (they fire once per
    job, on node 0). Duck-typed: run_job calls `on_job_start` and `on_job_end`."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("on_"):
            return lambda *args, **kwargs: None
        raise AttributeError(name)


def main(directory: Path, time_limit: "tuple[int, int]", environ: Mapping[str, str]) -> int:
    """Run this node's part of the job; `time_limit`: (signal_delay_s, max_num_timeout)."""
    # what an earlier job's process on this node left when it was killed outright (the OOM
    # killer, a second scancel): this node's process outlives it
    try:
        remove_dead_private_dirs()
    except Exception:
        pass  # never a reason to fail a job
    idx = int(environ["SLURM_ARRAY_TASK_ID"])
    node = int(environ.get("SLURM_NODEID", "0"))
    request = decode_request(read_private(request_file(directory, idx)))
    plan = request.plan
    plan.host = environ.get("SLURMD_NODENAME") or socket.gethostname()  # named in a refusal here
    job_id = environ["SLURM_JOB_ID"]
    array_id = environ.get("SLURM_ARRAY_JOB_ID") or job_id
    restarts = int(environ.get("SLURM_RESTART_COUNT") or 0)
    if plan.settings.max_nodes > 1:
        run = job_id + (f".restart{restarts}" if restarts else "")
        host = expand(environ, "SLURM_JOB_NODELIST")[0]
        endpoint = f"{host}:{derived_port(run)}"
        conf = dataclasses.replace(plan.settings.conf, node_rank=node, rdzv_endpoint=endpoint)
        plan.settings = dataclasses.replace(plan.settings, conf=conf)
        plan.rendezvous = Rendezvous("c10d", endpoint, f"slurm-{run}_{idx}", plan.rendezvous.configs)
        plan.node_slot = node
    # continuing where an earlier submission's ranks ran (the launcher said so), or where this
    # one's ran before the job was requeued (by its node 0 after a stop, or by SLURM itself:
    # a node failure, `scontrol requeue`, a preemption): the ranks' own mark in the job dir,
    # which the launcher removes before it submits a job that starts afresh
    plan.resumed = plan.resumed or (restarts > 0 and (plan.output_dir / RANKS_STARTED_FILE).exists())
    # this node's environment, as sbatch exported the submitting one (SLURM's variables added)
    request.environ = dict(environ)
    request.ignored_signals = []
    if node != 0:
        request.bookkeeping = False
        request.hydra_context = dataclasses.replace(request.hydra_context, callbacks=_NoCallbacks())
    # multiprocessing's resource tracker (the ranks' shared memory), started while USR2 is held:
    # it keeps it held, so SLURM's notice, which reaches every process of the job, does not
    # kill it (the ranks would start another, and unlinking their memory would fail there)
    resource_tracker.ensure_running()
    try:
        job_return = run_request(request)
    except Exception as e:  # outside the task (Hydra's bookkeeping): still the job's error
        traceback.print_exc()
        job_return = _failed(
            JobReturn(), f"node {node} of SLURM job {job_id} failed: {type(e).__name__}: {e}"
        )
    value = job_return._return_value
    if job_return.status == JobStatus.FAILED and not isinstance(value, JobPreempted):
        if slurm_commands.preempting(own_job_id(environ)):
            # SLURM's SIGTERM of a preemption (PreemptMode=REQUEUE, GraceTime) stopped the
            # ranks: the job is preempted, not failed. SLURM would requeue it only if it still
            # ran when its grace time ends; node 0 requeues it now, as after a stop notice
            if node != 0:
                return 0
            value = JobPreempted(_PREEMPTED_BY_SLURM, ranks_ran=True)
            job_return = dataclasses.replace(job_return)
            job_return.return_value = value
    if job_return.status == JobStatus.FAILED and not isinstance(value, JobPreempted):
        # the first node to fail names the cause; srun then stops the others (--kill-on-bad-exit)
        failed_first = failure_file(directory, idx, array_id, restarts)
        first = write_first(failed_first, pickled_return(job_return))
        if node != 0:
            return 1
        if not first:
            job_return = _with_error_of(job_return, read_private(failed_first))
    if node != 0:
        return 0
    if isinstance(value, JobPreempted):
        refused = _timeout_refusal(timeouts_file(directory, idx, array_id), time_limit, environ)
        if refused is None:
            how = value.message if value.message == _PREEMPTED_BY_SLURM else "stopped at a step boundary"
            replace_private(requeued_file(directory, idx, array_id), f"{restarts + 1}\n{how}".encode())
            said = requeue_slurm_job(environ, own_job_id(environ))
            print(f"[torchrun launcher] job #{idx}: {said}", file=sys.stderr, flush=True)
            if said is not None and "is requeued" in said:
                return 0  # SLURM ends this run; the job's result comes from the next
        else:
            job_return = _failed(job_return, refused)
    setattr(job_return, RUN_TIME_ATTR, round(time.time() - _STARTED, 3))
    if job_return.status == JobStatus.FAILED:  # before the result: a reader of one finds both
        replace_private(error_file(directory, idx, array_id, restarts), failure_summary(job_return).encode())
    replace_private(result_file(directory, idx, array_id, restarts), pickled_return(job_return))
    # a failed job's other nodes are stopped by srun (--kill-on-bad-exit), not left waiting
    return 1 if job_return.status == JobStatus.FAILED else 0


def _with_error_of(job_return: JobReturn, pickled: bytes) -> JobReturn:
    """Node 0's JobReturn with the error another node failed with first (a rank's own
    exception), and that node's account of it (`_rank.carried_exception.FailureAccount`), which travels
    beside the error."""
    import cloudpickle

    first = cloudpickle.loads(pickled)
    failed = dataclasses.replace(job_return, status=JobStatus.FAILED)
    failed.return_value = first._return_value
    account = account_of(first)
    if account is not None:
        setattr(failed, ACCOUNT_ATTR, account)
    return failed


def _failed(job_return: JobReturn, why: str) -> JobReturn:
    failed = dataclasses.replace(job_return, status=JobStatus.FAILED)
    failed.return_value = JobFailedError(why)
    return failed


def _timeout_refusal(path: Path, time_limit: "tuple[int, int]", environ: Mapping[str, str]) -> Optional[str]:
    """Why the job is not requeued after reaching its time limit (max_num_timeout), or None:
    a preemption, or a time limit with requeues left (then counted)."""
    left = _time_left_s(own_job_id(environ))
    delay, allowed = time_limit
    if left is None or left > delay + _TIME_LIMIT_MARGIN_S:
        return None
    count = int(path.read_text() or 0) if path.exists() else 0
    if count >= allowed:
        return (
            f"SLURM job {own_job_id(environ)} reached its time limit (timeout_min) with no requeue "
            f"left: it was requeued at its time limit {count} time(s) already "
            f"(hydra.launcher.max_num_timeout={allowed})"
        )
    replace_private(path, str(count + 1).encode())
    return None


def own_job_id(environ: Mapping[str, str]) -> str:
    """This job's id as SLURM's commands take it: `<array id>_<task id>` for a job of an array.
    The raw SLURM_JOB_ID of an array's last job is the array's own id, which squeue, scontrol
    and scancel read as every job of the array."""
    array, task = environ.get("SLURM_ARRAY_JOB_ID"), environ.get("SLURM_ARRAY_TASK_ID")
    return f"{array}_{task}" if array and task else environ["SLURM_JOB_ID"]


def _time_left_s(job_id: str) -> Optional[float]:
    """Seconds until the job's time limit, as squeue shows it (`%L`); None when unknown."""
    try:
        shown = subprocess.run(
            ["squeue", "--noheader", f"--jobs={job_id}", "--format=%L"],
            capture_output=True,
            text=True,
            timeout=60,
        ).stdout.split()
    except (OSError, subprocess.SubprocessError):
        return None
    return duration_s(shown[0]) if shown else None


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), (int(sys.argv[2]), int(sys.argv[3])), os.environ))
