"""One sweep job's torch elastic agent, run in the job's own process (`_job.process`).

A job's ranks run one of three things:
- the task function, in-process (`_rank.worker.run_rank` through the forkserver): the default;
- the task function under a `launch_prefix` (`numactl ...`, `nsys profile ...`): each rank
  is a real process, prefix + python + `_rank.main task`;
- a training script (`training_script`): each rank runs it as torchrun would.
Real-process ranks get their settings through files in a private directory (0700, files
0600), removed when the job ends; nothing is ever put into a shell string.
"""

import json
import logging
import os
import shutil
import signal
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Union

import cloudpickle
from torch.distributed.elastic.multiprocessing import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous import RendezvousError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from .._rank.forkserver import start_rank_forkserver
from .._rank.worker import run_rank
from .._shared.plan import JobPlan, stop_signal_of
from .._shared.private import private_dir as new_private_dir
from .._shared.stop_files import RANKS_STARTED_ENV, RANKS_STARTED_FILE, RESUMED_ENV, STOP_FILE_ENV
from . import preempt
from .console import RankConsole
from .failures import JobFailedError, job_error, stops_interrupt
from .launch_config import agent_environment, build_launch_config, launch_config_fields
from .node_exit import keep_rendezvous_handlers, leave_together
from .torch_adjustments import adjust_torch_for_this_job

log = logging.getLogger(__name__)

RANK_MAIN = "hydra_plugins.hydra_torchrun_launcher._rank.main"
# torch's account of its ranks' exits, in the job's dir (made when there is one)
AGENT_LOG = "torchrun_agent.log"


@dataclass
class AgentJob:
    plan: JobPlan
    launch_config: LaunchConfig
    entrypoint: Union[Callable[..., Any], str]
    args: List[Any]
    # the job process's private directory (0700): the stop file; a rank's payload and
    # return value when ranks are real processes
    private_dir: Path
    console: RankConsole
    # the run dirs of torch's logs already in the log dir (an earlier run in this sweep dir)
    earlier_logs: "frozenset[Path]" = frozenset()


def run_agent_job(plan: JobPlan, devices: Optional[List[str]], task_error: Optional[str] = None) -> Any:
    """Run the job's elastic agent in this (the job's own) process; rank 0's value, or JobFailedError.

    Called by Hydra's run_job, so the job's dir, env_set and callbacks are in place: what
    this process holds now is what its ranks inherit.
    """
    if task_error is not None:
        raise JobFailedError(task_error)
    conf = plan.settings.conf
    if devices is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(devices)
    if plan.nproc > 1 and "OMP_NUM_THREADS" not in os.environ:
        # as torchrun: ranks sharing a node do not each start a thread per core
        os.environ["OMP_NUM_THREADS"] = "1"
    if conf.training_script is not None:
        # a script runs in its job's dir, whatever hydra.job.chdir says: its outputs belong there
        os.chdir(plan.output_dir)
        if conf.module:
            # `python -m` finds the module where the sweep was launched, as torchrun's would
            path = os.environ.get("PYTHONPATH")
            os.environ["PYTHONPATH"] = plan.launch_dir + (os.pathsep + path if path else "")
    adjust_torch_for_this_job(
        conf.shutdown_timeout,
        single_node=plan.settings.max_nodes == 1,
        close_timeout="shutdown_timeout" not in launch_config_fields(),
    )
    if plan.settings.max_nodes > 1:
        keep_rendezvous_handlers()
    _rank_exits_to_file(plan.output_dir / AGENT_LOG)
    if plan.console_label:
        _label_logged_lines(plan.console_label)
    tempfile.tempdir = None  # the temp dir of the launcher's environment, which this process took
    private_dir = Path(new_private_dir())  # 0700, named after this process (`_shared.private`)
    try:
        if conf.stop_signal is not None:
            os.environ[STOP_FILE_ENV] = str(private_dir / "stop")
        if plan.resumed:
            os.environ[RESUMED_ENV] = "1"
        os.environ[RANKS_STARTED_ENV] = str(plan.output_dir / RANKS_STARTED_FILE)
        os.environ.update(agent_environment(plan.settings))
        stop_forkserver = (
            start_rank_forkserver(str(private_dir), ranks_ignore=stop_signal_of(conf))
            if conf.start_method == "forkserver"
            else (lambda: None)
        )
        # what torch writes through tempfile in this process (a failed rank's error file) goes
        # with the job's private dir, not into TMPDIR to stay there (ranks reset it)
        tempfile.tempdir = str(private_dir)
        try:
            job = build_agent_job(plan, private_dir)
            try:
                return _run_agent(job)
            finally:
                job.console.close()
        finally:
            stop_forkserver()
    finally:
        shutil.rmtree(private_dir, ignore_errors=True)


def job_log_dir(plan: JobPlan) -> str:
    """Where torch keeps the job's rank logs: `log_dir` (from the launch dir), else the job dir;
    in a multi-node job, in a dir of the node's own (`node<k>`), so that nodes sharing a sweep
    dir do not mix their trees."""
    conf = plan.settings.conf
    root = (
        os.path.join(plan.launch_dir, conf.log_dir)
        if conf.log_dir
        else str(plan.output_dir / "torchrun_logs")
    )
    return os.path.join(root, f"node{plan.node_slot}") if plan.settings.max_nodes > 1 else root


def _rank_exits_to_file(path: Path) -> None:
    """torch's own account of each rank's exit goes to the job's files, not to the console.

    On a failure torch logs the failed rank's traceback again ("failed (exitcode: 1)
    local_rank: 1 ...") and a line per rank it closes; the console has already shown the
    rank's own traceback and gets the job's error next, so these would tell it a second
    and third time. This process is the job's alone and ends with it.
    """
    handler = logging.FileHandler(path, delay=True)
    handler.setFormatter(logging.Formatter("[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"))
    logger = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
    logger.addHandler(handler)
    logger.propagate = False


class _JobLabel(logging.Filter):
    """Puts the job's label before each record's message, once, whichever handler sees it first."""

    def __init__(self, label: str) -> None:
        super().__init__()
        self.label = label

    def filter(self, record: logging.LogRecord) -> bool:
        if not getattr(record, "hydra_torchrun_job", False):
            record.msg = f"{self.label}{record.msg}"
            record.hydra_torchrun_job = True
        return True


def _label_logged_lines(label: str) -> None:
    """With jobs at once, what this job's process logs (torch's agent, Hydra's job logging,
    callbacks) says which job it is, as the ranks' prefixed lines do."""
    loggers = [logging.getLogger()] + [
        logger for logger in logging.Logger.manager.loggerDict.values() if isinstance(logger, logging.Logger)
    ]
    job_label = _JobLabel(label)
    for logger in loggers:
        for handler in logger.handlers:
            handler.addFilter(job_label)


def build_agent_job(plan: JobPlan, private_dir: Path) -> AgentJob:
    """The launch config and rank entry point of a job; `private_dir` is the job process's."""
    console = RankConsole()
    try:
        conf = plan.settings.conf
        plan.output_dir.mkdir(parents=True, exist_ok=True)
        launch_config = build_launch_config(
            plan.settings,
            plan.rendezvous,
            nproc_per_node=plan.nproc,
            log_dir=job_log_dir(plan),
            console=console,
            console_label=plan.console_label,
        )
        log_dir = Path(job_log_dir(plan))
        earlier = frozenset(log_dir.glob(f"{plan.rendezvous.run_id}_*")) if log_dir.is_dir() else frozenset()
        if conf.training_script is None and not conf.launch_prefix:
            args = [list(sys.path), cloudpickle.dumps(plan.payload)]
            return AgentJob(plan, launch_config, run_rank, args, private_dir, console, earlier)

        if conf.training_script is None:
            payload_file = private_dir / "payload.pkl"
            _write_private(payload_file, cloudpickle.dumps((list(sys.path), cloudpickle.dumps(plan.payload))))
            command = [sys.executable, "-m", RANK_MAIN, "task", str(payload_file), str(private_dir)]
        else:
            command = script_command(plan)
        spec_file = private_dir / "rank.json"
        stop_signal = stop_signal_of(conf)
        spec = {"command": [*conf.launch_prefix, *command], "ignore_signal": stop_signal and int(stop_signal)}
        _write_private(spec_file, json.dumps(spec).encode())
        entry_args = ["-m", RANK_MAIN, "exec", str(spec_file)]
        return AgentJob(plan, launch_config, sys.executable, entry_args, private_dir, console, earlier)
    except BaseException:
        console.close()
        raise


def script_path(plan: JobPlan) -> str:
    """The training script as a rank runs it: the rank runs in its job dir, so a script path
    is taken relative to the directory the sweep was launched from (a module name is not a
    path; a bare command name of `no_python` is looked up on PATH)."""
    conf = plan.settings.conf
    assert conf.training_script is not None
    script = conf.training_script
    if not conf.module and (not conf.no_python or os.sep in script):
        script = os.path.join(plan.launch_dir, script)
    return script


def script_command(plan: JobPlan) -> List[str]:
    """The command of a rank in script mode, as torchrun builds it from the launch dir."""
    conf = plan.settings.conf
    script = script_path(plan)
    if conf.no_python:
        return [script, *conf.training_script_args]
    if conf.run_path:
        code = "import runpy, sys; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"
        return [sys.executable, "-u", "-c", code, script, *conf.training_script_args]
    module = ["-m"] if conf.module else []
    return [os.environ.get("PYTHON_EXEC", sys.executable), "-u", *module, script, *conf.training_script_args]


def _write_private(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


class JobDeadline(BaseException):
    """The job ran past `job_timeout`.

    BaseException, so no `except Exception` inside torch's agent takes it for a worker
    error; the agent's own shutdown path stops the ranks on the way out.
    """


def _raise_deadline(signum: int, frame: Any) -> None:
    raise JobDeadline()


def _run_agent(job: AgentJob) -> Any:
    """Run the agent in this process's main thread: torch's signal handling is in force.

    A stop signal (Ctrl-C, SIGTERM forwarded by the launcher) makes the agent stop the
    ranks through its own shutdown path; `job_timeout` does the same by a SIGALRM. Before
    the agent has ranks to watch (in the rendezvous), the job process's own handler raises
    the same SignalException; a stop that came earlier stops the job before the agent starts
    (`_job.failures.stops_interrupt`). The stop signal asks the ranks to stop at a step boundary
    instead (`_job.preempt`); the job then ends preempted.
    """
    conf = job.plan.settings.conf
    failure: Optional[Exception] = None
    if conf.job_timeout is not None:
        signal.signal(signal.SIGALRM, _raise_deadline)
        signal.setitimer(signal.ITIMER_REAL, conf.job_timeout)
    try:
        with stops_interrupt():
            preempt.agent_starting(str(job.private_dir / "stop"))
            outputs = elastic_launch(job.launch_config, job.entrypoint)(*job.args)
            preempt.agent_ended()
            returned = _leave_together(job, outputs)
    except ChildFailedError as e:
        # no ordered exit: a node whose ranks failed may be gone, and nobody would count it out
        failure = job_error(e, _stderr_logs(job), job.plan.launch_dir)
    except SignalException as e:
        failure = preempt.outcome(interrupted_by=e.sigval) or JobFailedError(
            f"the job was stopped by signal {signal.Signals(e.sigval).name}"
        )
    except RendezvousError as e:
        # a node that never came (or left): one line, not torch's traceback of its agent
        failure = JobFailedError(_rendezvous_failed(job.plan, e))
    except JobDeadline:
        failure = JobFailedError(
            f"the job ran past hydra.launcher.job_timeout={conf.job_timeout:g}s; its ranks were stopped"
        )
    except preempt.StopTimeout:
        failure = preempt.timed_out()
    finally:
        preempt.agent_ended()
        signal.setitimer(signal.ITIMER_REAL, 0)
    if failure is None:
        preempted = preempt.outcome()
        if preempted is None:
            return returned
        failure = preempted
    # raised here, not in an except clause: the agent's frames stay out of the error's context
    raise failure


def _rendezvous_failed(plan: JobPlan, error: Exception) -> str:
    """Why the job's nodes did not meet, with what it waited for and how to wait longer."""
    settings, rendezvous = plan.settings, plan.rendezvous
    nodes = settings.max_nodes if settings.min_nodes == settings.max_nodes else settings.conf.nnodes
    said = f": {error}" if str(error) else ""
    return (
        f"the job's nodes did not meet ({type(error).__name__}{said}): it waited for {nodes} nodes at "
        f"{rendezvous.endpoint} (id {rendezvous.run_id}); run the same command on every node, or wait "
        "longer: hydra.launcher.rdzv_conf={join_timeout:SECONDS}"
    )


def _leave_together(job: AgentJob, outputs: Dict[int, Any]) -> Any:
    """Global rank 0's return value, on every node of the job: the nodes of a multi-node job
    share it as they let its rendezvous store go, in order (`_job.node_exit`)."""
    plan = job.plan
    settings = plan.settings
    nodes = settings.max_nodes if settings.min_nodes == settings.max_nodes else 0
    has_rank0 = 0 in outputs
    own = _node_return_value(job, outputs)
    shared = leave_together(
        plan.rendezvous.backend,
        plan.rendezvous.endpoint,
        plan.rendezvous.run_id,
        nodes,
        cloudpickle.dumps(own) if has_rank0 else None,
    )
    if shared is None:
        if nodes > 1 and not has_rank0:
            log.warning(
                f"job #{plan.idx}: global rank 0's return value did not reach this node; its own is kept"
            )
        return own
    return own if has_rank0 else cloudpickle.loads(shared)


def _node_return_value(job: AgentJob, outputs: Dict[int, Any]) -> Any:
    """Global rank 0's value; on the other nodes of a multi-node job, their first rank's."""
    if job.plan.settings.conf.training_script is not None:
        return None
    if isinstance(job.entrypoint, str):
        # return_<attempt>_<rank>.pkl: the last attempt's lowest rank (rank 0 on node 0)
        def order(path: Path) -> "tuple[int, int]":
            _, attempt, rank = path.stem.split("_")
            return -int(attempt), int(rank)

        returned = sorted(job.private_dir.glob("return_*_*.pkl"), key=order)
        return cloudpickle.loads(returned[0].read_bytes()) if returned else None
    pickled = outputs[min(outputs)]
    return None if pickled is None else cloudpickle.loads(pickled)


def _stderr_logs(job: AgentJob) -> List[Path]:
    """Each local rank's stderr file of this job's last attempt (where tee/redirects kept one);
    never one of an earlier run's that reused the sweep dir (same rendezvous id)."""
    log_dir = Path(job.launch_config.logs_specs.root_log_dir)  # type: ignore[union-attr]
    earlier = job.earlier_logs
    attempts = sorted(
        (p for p in log_dir.glob(f"{job.launch_config.run_id}_*/attempt_*") if p.parent not in earlier),
        key=lambda p: int(p.name.split("_")[1]),
    )
    if not attempts:
        return []
    return [attempts[-1] / str(local_rank) / "stderr.log" for local_rank in range(job.plan.nproc)]
