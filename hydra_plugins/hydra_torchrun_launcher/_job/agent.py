"""One sweep job's torch elastic agent, run in the job's own process (`_job.process`).

A job's ranks run one of three things:
- the task function, in-process (`_rank.worker.run_rank` through the forkserver): the default;
- the task function under a `launch_prefix` (`numactl ...`, `nsys profile ...`): each rank
  is a real process, prefix + python + `_rank.main task`;
- a training script (`training_script`): each rank runs it as torchrun would.
Real-process ranks get their settings through files in a private directory (0700, files
0600), removed when the job ends; nothing is ever put into a shell string.

Past `job_timeout` (torch's agent is interrupted by the SIGALRM of `_on_deadline`, before its
own shutdown path stops the ranks), the job's process first names the ranks still running
and asks each one that can where it is (`DUMP_SIGNAL`: faulthandler writes its stack to its
stderr), so the job's error shows it (`_job.failure_report.deadline_report`). A node of a
multi-node job whose ranks had all returned (it waited at torch's exit barrier for the other
nodes) says so; the job's nodes then leave its rendezvous store in order, its host last
(`_job.node_exit.leave_after_deadline`).
"""

import json
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Union

import cloudpickle
from torch.distributed.elastic.multiprocessing import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous import RendezvousError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from .._rank.forkserver import start_rank_forkserver
from .._rank.forkserver import supported as forkserver_supported
from .._rank.worker import payload_for_ranks, run_rank
from .._shared.config_error import LauncherConfigError
from .._shared.plan import JobPlan, stop_signal_of
from .._shared.private import private_dir as new_private_dir
from .._shared.private import socket_address
from .._shared.stop_files import (
    DUMP_SIGNAL,
    RANK_PROCESSES_ENV,
    RANKS_STARTED_ENV,
    RANKS_STARTED_FILE,
    RESUMED_ENV,
    RETURNED_SOCKET_ENV,
    STOP_FILE_ENV,
    LiveRank,
    ranks_of,
)
from . import preempt
from .console import RankConsole
from .failure_report import LiveRankReport, deadline_report, failed_before_stop, job_error, job_failed
from .launch_config import (
    agent_environment,
    build_launch_config,
    check_numa_binding,
    launch_config_fields,
    local_world_size,
)
from .node_exit import keep_rendezvous_handlers, leave_after_deadline, leave_together
from .torch_adjustments import adjust_torch_for_this_job, agent_wakes_on

log = logging.getLogger(__name__)

RANK_MAIN = "hydra_plugins.hydra_torchrun_launcher._rank.main"
# torch's account of its ranks' exits, in the job's dir (made when there is one)
AGENT_LOG = "torchrun_agent.log"
# the ranks' process files, in the job process's private dir (`_shared.stop_files`)
RANK_PROCESSES_DIR = "ranks"
# past job_timeout: how long the ranks asked for their stacks get to write them
_DUMP_WAIT_S = 2.0
# past job_timeout, the node hosting a multi-node job's store waits for the other nodes to
# leave it for as long as their ranks' shutdown may take, and this much more (the nodes'
# clocks, the reports they write)
_LEAVE_MARGIN_S = 5.0


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
    # the ranks still running when the job ran past its job_timeout
    live_at_deadline: List[LiveRankReport] = field(default_factory=list)
    # and those of the same attempt that had returned by then
    returned_at_deadline: List[LiveRank] = field(default_factory=list)


def run_agent_job(plan: JobPlan, devices: Optional[List[str]], task_error: Optional[str] = None) -> Any:
    """Run the job's elastic agent in this (the job's own) process; rank 0's value, or JobFailedError.

    Called by Hydra's run_job, so the job's dir, env_set and callbacks are in place: what
    this process holds now is what its ranks inherit.
    """
    if task_error is not None:
        raise job_failed(task_error)
    conf = plan.settings.conf
    if devices is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(devices)
    if plan.settings.on_hosts:
        _decide_on_this_host(plan)
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
        os.environ[RANK_PROCESSES_ENV] = str(private_dir / RANK_PROCESSES_DIR)
        if plan.resumed:
            os.environ[RESUMED_ENV] = "1"
        os.environ[RANKS_STARTED_ENV] = str(plan.output_dir / RANKS_STARTED_FILE)
        returned, returned_dir = _returned_socket(private_dir)
        agent_wakes_on(returned)
        os.environ.update(agent_environment(plan.settings))
        # before the forkserver forks: it holds the payload for the ranks it forks
        rank_payload = payload_for_ranks(plan.payload, forked=_ranks_fork_from_here(conf))
        stop_forkserver = (
            start_rank_forkserver(str(private_dir), ranks_ignore=stop_signal_of(conf))
            if conf.start_method == "forkserver"
            else (lambda: None)
        )
        # what torch writes through tempfile in this process (a failed rank's error file) goes
        # with the job's private dir, not into TMPDIR to stay there (ranks reset it)
        tempfile.tempdir = str(private_dir)
        try:
            job = build_agent_job(plan, private_dir, rank_payload)
            try:
                return _run_agent(job)
            finally:
                job.console.close()
        finally:
            stop_forkserver()
            returned.close()
            if returned_dir is not None:
                shutil.rmtree(returned_dir, ignore_errors=True)
    finally:
        shutil.rmtree(private_dir, ignore_errors=True)


def _returned_socket(private_dir: Path) -> "tuple[socket.socket, Optional[str]]":
    """The socket on which the job's ranks say their task returned (`_shared.stop_files`),
    named to them by RETURNED_SOCKET_ENV, and the short dir of its own it may be in."""
    address, own_dir = socket_address(str(private_dir), "returned")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(address)
    sock.setblocking(False)
    os.environ[RETURNED_SOCKET_ENV] = address
    return sock, own_dir


def _decide_on_this_host(plan: JobPlan) -> None:
    """What only this host can tell (`JobSettings.on_hosts`), decided here as torchrun decides
    it on each node: launch_prefix's program on this host's PATH, nproc_per_node's word
    counted by this host's torch (its devices as this job sees them), numa_binding's GPUs and
    numactl. Refused in one line naming the key and the host."""
    conf = plan.settings.conf
    where = f"on host {plan.host}" if plan.host else "on this host"
    try:
        check_numa_binding(plan.settings)
    except LauncherConfigError as e:
        raise job_failed(str(e).replace(" is invalid here: ", f" is invalid {where}: ", 1)) from None
    if conf.launch_prefix and shutil.which(str(conf.launch_prefix[0])) is None:
        raise job_failed(
            f"hydra.launcher.launch_prefix={conf.launch_prefix!r} is invalid {where}: "
            f"{conf.launch_prefix[0]} is not a program found on its PATH"
        )
    if plan.nproc == 0:
        try:
            plan.nproc = local_world_size(plan.settings)
        except LauncherConfigError as e:
            raise job_failed(str(e).replace(" is invalid here: ", f" is invalid {where}: ", 1)) from None


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


def _ranks_fork_from_here(conf: Any) -> bool:
    """Whether the job's ranks run `run_rank` in a process forked from this one's memory."""
    if conf.training_script is not None or conf.launch_prefix:
        return False
    return conf.start_method == "fork" or (conf.start_method == "forkserver" and forkserver_supported())


def build_agent_job(plan: JobPlan, private_dir: Path, rank_payload: Optional[bytes]) -> AgentJob:
    """The launch config and rank entry point of a job; `private_dir` is the job process's;
    `rank_payload`: what `payload_for_ranks` gave for the job's payload."""
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
            args = [list(sys.path), rank_payload]
            return AgentJob(plan, launch_config, run_rank, args, private_dir, console, earlier)

        if conf.training_script is None:
            payload_file = private_dir / "payload.pkl"
            _create_private(payload_file, cloudpickle.dumps((list(sys.path), rank_payload)))
            command = [sys.executable, "-m", RANK_MAIN, "task", str(payload_file), str(private_dir)]
        else:
            command = script_command(plan)
        spec_file = private_dir / "rank.json"
        stop_signal = stop_signal_of(conf)
        spec = {
            "command": [*conf.launch_prefix, *command],
            "ignore_signal": stop_signal and int(stop_signal),
            # a training script that python runs can be asked for its stack (`_rank.main`)
            "stack_hook": conf.training_script is not None and not conf.no_python,
        }
        _create_private(spec_file, json.dumps(spec).encode())
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


def _create_private(path: Path, data: bytes) -> None:
    """Owner-only (0600), and a new file: never one someone put there first (O_EXCL)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


class JobDeadline(BaseException):
    """The job ran past `job_timeout`.

    BaseException, so no `except Exception` inside torch's agent takes it for a worker
    error; the agent's own shutdown path stops the ranks on the way out.
    """


def _on_deadline(job: AgentJob) -> Callable[[int, Any], None]:
    """The SIGALRM handler of `job_timeout`: unless a failure or a stop came first (the agent
    is already stopping the ranks for it), the ranks still running are named and asked where
    they are, then the agent is interrupted."""

    def handler(signum: int, frame: Any) -> None:
        if not preempt.deadline_first():
            return
        job.live_at_deadline = _ask_where(job)
        job.returned_at_deadline = _returned(job, job.live_at_deadline)
        raise JobDeadline()

    return handler


def _until_deadline(plan: JobPlan, timeout: float) -> float:
    """Seconds until the job's deadline: the one its nodes share where it has one (never
    more than job_timeout, whatever this host's clock says), else job_timeout from now. A
    deadline already past fires at once (a timer of 0 would be none)."""
    if plan.deadline is None:
        return timeout
    return min(timeout, max(plan.deadline - time.time(), 0.001))


def _caught_signals(pid: int) -> Optional[int]:
    """The mask of the signals `pid` catches (/proc/<pid>/status SigCgt); None if unknown."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("SigCgt:"):
                    return int(line.split()[1], 16)
    except (OSError, ValueError, IndexError):
        pass
    return None


def _ask_where(job: AgentJob) -> List[LiveRankReport]:
    """The ranks still running, each that registered faulthandler asked for its stack (written
    to its stderr, which is read back once it has stopped growing, within `_DUMP_WAIT_S`)."""
    directory = job.private_dir / RANK_PROCESSES_DIR
    attempts = _attempt_dirs(job)
    attempt = int(attempts[-1].name.split("_")[1]) if attempts else 0
    logs = _rank_logs(job)
    reports = []
    for rank in ranks_of(str(directory), attempt, running=True):
        stdout, stderr = logs.get(rank.local_rank, (None, None))
        size = _size(stderr)
        caught = _caught_signals(rank.pid)
        dumps = rank.dumps and (caught is None or bool(caught & (1 << (DUMP_SIGNAL - 1))))
        if dumps:
            try:
                os.kill(rank.pid, DUMP_SIGNAL)
            except OSError:
                dumps = False
        reports.append(LiveRankReport(rank, stdout, stderr, size, dumps))
    asked = [r for r in reports if r.dumped and r.stderr is not None]
    deadline = time.monotonic() + _DUMP_WAIT_S
    sizes = {id(r): r.stderr_size for r in asked}
    while asked and time.monotonic() < deadline:
        time.sleep(0.1)
        now = {id(r): _size(r.stderr) for r in asked}
        if all(now[id(r)] > r.stderr_size for r in asked) and now == sizes:
            break  # every stack written, and nothing more coming
        sizes = now
    for report in asked:
        report.dump_end = _size(report.stderr)
    return reports


def _returned(job: AgentJob, live: List[LiveRankReport]) -> List[LiveRank]:
    """The ranks of the last attempt that are not among `live`: they had returned."""
    attempts = _attempt_dirs(job)
    attempt = int(attempts[-1].name.split("_")[1]) if attempts else 0
    running = {report.rank.rank for report in live}
    directory = str(job.private_dir / RANK_PROCESSES_DIR)
    return [rank for rank in ranks_of(directory, attempt) if rank.rank not in running]


def _size(path: Optional[Path]) -> int:
    try:
        return path.stat().st_size if path is not None else 0
    except OSError:
        return 0


def _run_agent(job: AgentJob) -> Any:
    """Run the agent in this process's main thread: torch's signal handling is in force.

    A stop signal (Ctrl-C, SIGTERM forwarded by the launcher) makes the agent stop the
    ranks through its own shutdown path; `job_timeout` does the same by a SIGALRM. Before
    the agent has ranks to watch (in the rendezvous), the job process's own handler raises
    the same SignalException; a stop that came earlier stops the job before the agent starts
    (`_job.preempt.stops_interrupt`). The stop signal asks the ranks to stop at one step
    boundary instead (`_job.preempt`); the job then ends preempted. Whatever came first (a
    rank's failure, the deadline, a stop) is the job's outcome; what came after is said after it.
    """
    conf = job.plan.settings.conf
    failure: Optional[BaseException] = None
    if conf.job_timeout is not None:
        signal.signal(signal.SIGALRM, _on_deadline(job))
        signal.setitimer(signal.ITIMER_REAL, _until_deadline(job.plan, conf.job_timeout))
    try:
        with preempt.stops_interrupt():
            preempt.agent_starting(str(job.private_dir / "stop"))
            outputs = elastic_launch(job.launch_config, job.entrypoint)(*job.args)
            # every rank of every node has ended (the agent is through its exit barrier):
            # the job's deadline is behind it, whatever leaving takes
            signal.setitimer(signal.ITIMER_REAL, 0)
            preempt.agent_ended()
            returned = _leave_together(job, outputs)
    except ChildFailedError as e:
        # no ordered exit: a node whose ranks failed may be gone, and nobody would count it out
        failure = job_error(e, _stderr_logs(job), job.plan.launch_dir, job.plan.nproc)
    except SignalException as e:
        failure = preempt.outcome(interrupted_by=e.sigval) or _stopped(job, signal.Signals(e.sigval))
    except RendezvousError as e:
        # a node that never came (or left): one line, not torch's traceback of its agent
        failure = job_failed(_rendezvous_failed(job.plan, e))
    except JobDeadline:
        failure = deadline_report(
            conf.job_timeout,
            job.live_at_deadline,
            job.plan.launch_dir,
            job.plan.host,
            job.returned_at_deadline,
        )
        _leave_after_deadline(job)
    except preempt.StopTimeout:
        failure = preempt.timed_out()
    finally:
        preempt.agent_ended()
        signal.setitimer(signal.ITIMER_REAL, 0)
        preempt.forget_ranks()
    if failure is None:
        preempted = preempt.outcome()
        if preempted is None:
            return returned
        failure = preempted
    # raised here, not in an except clause: the agent's frames stay out of the error's context
    raise failure


def _stopped(job: AgentJob, sig: signal.Signals) -> BaseException:
    """The job's error after a stop ended its agent: the stop's, unless a rank had failed on its
    own before the stop came (the agent had not seen it yet): then that failure, as the agent
    would have told it, and the stop after it."""
    failed = _failed_before(job)
    if failed is not None:
        return job_error(failed, _stderr_logs(job), job.plan.launch_dir, job.plan.nproc)
    return job_failed(f"the job was stopped by signal {sig.name}", stopped=True)


def _failed_before(job: AgentJob) -> Optional[ChildFailedError]:
    """The ranks that raised before the stop came, as torch's agent reports failed ranks."""
    attempts = _attempt_dirs(job)
    if not attempts:
        return None
    attempt = int(attempts[-1].name.split("_")[1])
    ranks = {rank.local_rank: rank for rank in ranks_of(str(job.private_dir / RANK_PROCESSES_DIR), attempt)}
    error_dirs = {local_rank: attempts[-1] / str(local_rank) for local_rank in range(job.plan.nproc)}
    return failed_before_stop(error_dirs, ranks, str(job.entrypoint))


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
    never_ran = own is _TASK_NEVER_RAN
    shared = leave_together(
        plan.rendezvous.backend,
        plan.rendezvous.endpoint,
        plan.rendezvous.run_id,
        nodes,
        cloudpickle.dumps(None if never_ran else own) if has_rank0 else None,
    )
    if never_ran:
        prefix = settings.conf.launch_prefix
        raise job_failed(
            f"the job's ranks ended with code 0 but never ran the task: "
            f"hydra.launcher.launch_prefix={list(prefix)!r} must run the command that follows it "
            "(as numactl and nsys profile do)"
        )
    if shared is None:
        if nodes > 1 and not has_rank0:
            log.warning(
                f"job #{plan.idx}: global rank 0's return value did not reach this node; its own is kept"
            )
        return own
    return own if has_rank0 else cloudpickle.loads(shared)


def _leave_after_deadline(job: AgentJob) -> None:
    """Past the deadline the job's nodes share, each stops its own ranks; they then leave the
    job's rendezvous store in order, its host last, as on their way out of a job that ended
    (`_job.node_exit`). Only where this node's ranks ran: the nodes had met, and every one
    comes to the same deadline."""
    plan = job.plan
    settings = plan.settings
    if settings.min_nodes != settings.max_nodes or not (job.live_at_deadline or job.returned_at_deadline):
        return
    leave_after_deadline(
        plan.rendezvous.backend,
        plan.rendezvous.endpoint,
        plan.rendezvous.run_id,
        settings.max_nodes,
        _DUMP_WAIT_S + 2 * settings.conf.shutdown_timeout + _LEAVE_MARGIN_S,
    )


# what a node's ranks under a launch_prefix returned when none of them ran the task (the
# prefix's program ended without running the command it was given: `/bin/true`, a wrapper
# that forgot `exec "$@"`)
_TASK_NEVER_RAN = object()


def _node_return_value(job: AgentJob, outputs: Dict[int, Any]) -> Any:
    """Global rank 0's value; on the other nodes of a multi-node job, their first rank's."""
    if job.plan.settings.conf.training_script is not None:
        return None
    if isinstance(job.entrypoint, str):
        # return_<attempt>_<rank>.pkl: the last attempt's lowest rank (rank 0 on node 0);
        # every local rank 0 that ran its task wrote one, whatever the task returned
        def order(path: Path) -> "tuple[int, int]":
            _, attempt, rank = path.stem.split("_")
            return -int(attempt), int(rank)

        returned = sorted(job.private_dir.glob("return_*_*.pkl"), key=order)
        return cloudpickle.loads(returned[0].read_bytes()) if returned else _TASK_NEVER_RAN
    pickled = outputs[min(outputs)]
    return None if pickled is None else cloudpickle.loads(pickled)


def _attempt_dirs(job: AgentJob) -> List[Path]:
    """The attempt dirs of torch's rank logs in this job's run, in order (never those of an
    earlier run that reused the sweep dir, same rendezvous id)."""
    log_dir = Path(job.launch_config.logs_specs.root_log_dir)  # type: ignore[union-attr]
    earlier = job.earlier_logs
    return sorted(
        (p for p in log_dir.glob(f"{job.launch_config.run_id}_*/attempt_*") if p.parent not in earlier),
        key=lambda p: int(p.name.split("_")[1]),
    )


def _stderr_logs(job: AgentJob) -> List[Path]:
    """Each local rank's stderr file of this job's last attempt (where tee/redirects kept one)."""
    attempts = _attempt_dirs(job)
    if not attempts:
        return []
    return [attempts[-1] / str(local_rank) / "stderr.log" for local_rank in range(job.plan.nproc)]


def _rank_logs(job: AgentJob) -> Dict[int, "tuple[Optional[Path], Optional[Path]]"]:
    """Each local rank's (stdout, stderr) files of the last attempt, those that exist."""
    attempts = _attempt_dirs(job)
    if not attempts:
        return {}

    def existing(path: Path) -> Optional[Path]:
        return path if path.is_file() else None

    return {
        local_rank: (
            existing(attempts[-1] / str(local_rank) / "stdout.log"),
            existing(attempts[-1] / str(local_rank) / "stderr.log"),
        )
        for local_rank in range(job.plan.nproc)
    }
