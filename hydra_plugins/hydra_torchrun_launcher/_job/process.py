"""One sweep job's own process: Hydra's bookkeeping and torch's elastic agent, as torchrun's.

Forked from the warm server (`_server.server`), so it starts with torch imported, but with
nothing of any other job: it takes the launcher's environment, working directory and
signal dispositions as they were when the job started, then lets Hydra's `run_job` do the
job's bookkeeping here (job dir, `.hydra/`, `env_set`, logging, `on_job_start`/
`on_job_end`), and runs the job's elastic agent in its main thread, where torch's own
signal handling and shutdown path are in force. Its ranks inherit this process's state,
so they see, from their first line, what torchrun's ranks would see.

The `JobReturn` goes back to the launcher through a pipe, a failed one with the account of
its failure beside its error (`_rank.carried_exception.FailureAccount`); the process then exits, and
whatever it started goes with it.
"""

import copy
import os
import pickle
import signal
import struct
import sys
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional

import cloudpickle
from hydra.core.hydra_config import HydraConfig
from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus, run_job, setup_globals
from hydra.types import HydraContext
from omegaconf import DictConfig, open_dict, read_write

from .._rank.carried_exception import ACCOUNT_ATTR, dumps_job_return
from .._shared.lifetime import die_with_parent
from .._shared.plan import JobPlan, stop_signal_of
from .._shared.private import flush_loggers as _flush_loggers
from .._shared.signals import group_signals, take_dispositions
from . import preempt
from .agent import run_agent_job
from .failure_report import account_for, failed_return

_FRAME = struct.Struct("=q")


@dataclass
class JobRequest:
    """Everything a job process needs, captured by the launcher when the job starts."""

    plan: JobPlan
    config: DictConfig
    hydra_context: HydraContext
    environ: Dict[str, str]  # the launcher's os.environ now
    cwd: str  # the launcher's working dir now
    ignored_signals: List[int]  # signals the launcher ignores: they stay ignored
    devices: Optional[List[str]]
    task_error: Optional[str]  # why the task function cannot travel to the ranks
    # whether this node's run_job writes the job's `.hydra/` files (its first node's does;
    # the others run it with `hydra.output_subdir: null`)
    bookkeeping: bool = True


class PickledOnce:
    """A value cloudpickled once and carried by many requests (a launch's HydraContext):
    pickled, it is its bytes; unpickled, the value again."""

    def __init__(self, value: Any) -> None:
        self.data = cloudpickle.dumps(value)

    def __reduce__(self) -> Any:
        return (cloudpickle.loads, (self.data,))


def encode_request(request: JobRequest) -> bytes:
    """sys.path first, in plain pickle: unpickling the rest may import the app's modules."""
    head = pickle.dumps(list(sys.path))
    body = cloudpickle.dumps(request)
    return _FRAME.pack(len(head)) + head + body


def decode_request(data: bytes) -> JobRequest:
    """The request `encode_request` made; this process takes its sys.path first."""
    (head_size,) = _FRAME.unpack(data[: _FRAME.size])
    sys.path[:] = pickle.loads(data[_FRAME.size : _FRAME.size + head_size])
    return cloudpickle.loads(data[_FRAME.size + head_size :])


def job_process_main(pipe: Any, result_w: int) -> None:
    """The job process forked by the warm server: its request from `pipe` (`_server.server.
    RequestPipe`), the launcher's state taken, then the job once the launcher says go; a
    job the launcher cancels instead ends here, with no result."""
    die_with_parent()
    try:
        request = decode_request(pipe.request())
    except Exception as e:  # the job's own failure, told as such: see _unreadable_request
        job_return: Optional[JobReturn] = _unreadable_request(e) if pipe.go() else None
    else:
        job_return = run_request(request, pipe.go)
    if job_return is None:
        return
    with os.fdopen(result_w, "wb") as out:
        out.write(pickled_return(job_return))


def _unreadable_request(error: Exception) -> JobReturn:
    """The job's request could not be unpickled here: it names the app's modules (its task,
    its callbacks, its config's classes), which this process imports from the launcher's
    working dir. On a host of `torchrun_ssh` whose copy of the project is missing or
    differs, that is the job's failure, with the reason and the host, not a traceback of
    the launcher's own."""
    import socket

    return failed_return(
        f"the job could not start on {socket.gethostname()}: its request names the app's code, which "
        f"could not be loaded there from {os.getcwd()} ({type(error).__name__}: {error}); "
        "the app's files must be at the same path on every host"
    )


def run_request(request: JobRequest, go: Callable[[], bool] = lambda: True) -> Optional[JobReturn]:
    """Run the job in this process as `request` says: the one path of every job's process,
    whether forked by the warm server or started on a SLURM node (`_submit.node`). `go`: asked
    once the launcher's state is taken; the job runs if it says so, else None."""
    _take_launcher_state(request)
    if not go():
        return None
    try:
        # a stop the launcher sent while this process started was held (the warm server
        # blocks the group signals for its children): it is delivered now
        signal.pthread_sigmask(signal.SIG_UNBLOCK, group_signals())
        return _run(request)
    except Exception as e:
        # Hydra's run_job failed outside the task (its own bookkeeping: a value of
        # `hydra.job.env_set` that does not resolve, a callback's error): that error is the
        # job's, as Hydra's basic launcher raises it, not "exited before reporting a result"
        traceback.print_exc()
        return failed_return(f"Hydra's run_job failed outside the task: {type(e).__name__}: {e}")
    finally:
        _flush_loggers()


def _without_bookkeeping(config: DictConfig) -> DictConfig:
    """The job's config for a node other than the one that writes the job's `.hydra/` files:
    Hydra's run_job writes none here (`hydra.output_subdir: null`)."""
    config = copy.deepcopy(config)
    with read_write(config.hydra), open_dict(config.hydra):
        config.hydra.output_subdir = None
    return config


def _take_launcher_state(request: JobRequest) -> None:
    os.environ.clear()
    os.environ.update(request.environ)
    os.chdir(request.cwd)
    take_dispositions(request.ignored_signals, preempt.stop_requested)
    conf = request.plan.settings.conf
    preempt.listen(stop_signal_of(conf), conf.stop_timeout)
    setup_globals()
    # Hydra's Singleton state (ConfigStore, resolvers, HydraConfig), as the ranks get it
    from .._rank.worker import hydra_state

    Singleton.set_state(hydra_state(request.plan.payload))


def _run(request: JobRequest) -> JobReturn:
    payload = request.plan.payload
    # the ranks check instantiate() targets as run_job does here (Hydra 1.4)
    payload.execution_whitelist = getattr(request.hydra_context, "execution_whitelist", None)
    config = request.config
    if not request.bookkeeping:
        # the ranks see the job's HydraConfig as they do on its first node
        payload.pickled_hydra_config = _pickled_hydra_config(config)
        config = _without_bookkeeping(config)

    def distributed_task(task_cfg: DictConfig) -> Any:
        # run_job has entered the job dir (hydra.job.chdir), applied env_set, fired on_job_start,
        # set HydraConfig to the job's config: the ranks get its task config and HydraConfig
        # (made here, not by the launcher: a sweep's launcher would pay for them every job)
        payload.task_cfg = task_cfg
        return run_agent_job(request.plan, request.devices, request.task_error)

    job_return = run_job(
        hydra_context=request.hydra_context,
        task_function=distributed_task,
        config=config,
        job_dir_key="hydra.sweep.dir",
        job_subdir_key="hydra.sweep.subdir",
    )
    if job_return.status == JobStatus.FAILED:
        account = account_for(job_return._return_value)
        if account is not None:
            setattr(job_return, ACCOUNT_ATTR, account)
    return job_return


def _pickled_hydra_config(config: DictConfig) -> bytes:
    """HydraConfig set to `config`, cloudpickled, as run_job sets it (its output dir was set
    by the launcher already)."""
    HydraConfig.instance().set_config(config)
    return cloudpickle.dumps(HydraConfig.instance())


def pickled_return(job_return: JobReturn) -> bytes:
    """The JobReturn as bytes for the launcher; one that cannot be pickled becomes a failure that says so."""
    try:
        return dumps_job_return(job_return)
    except Exception as e:  # the value or error cannot travel back: say so, as a failed job
        failed = JobReturn(
            overrides=job_return.overrides,
            cfg=job_return.cfg,
            hydra_cfg=job_return.hydra_cfg,
            working_dir=job_return.working_dir,
            task_name=job_return.task_name,
            status=JobStatus.FAILED,
        )
        failed.return_value = TypeError(
            f"the job's result ({type(job_return._return_value).__name__}) cannot be pickled "
            f"to send it back to the launcher: {e}"
        )
        return cloudpickle.dumps(failed)
