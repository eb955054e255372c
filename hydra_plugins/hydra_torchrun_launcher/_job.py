"""One sweep job's torch elastic agent: what it starts in each rank, running it, its outcome.

A job's ranks run one of three things:
- the task function, in-process (`_worker.run_rank` through the forkserver): the default;
- the task function under a `launch_prefix` (`numactl ...`, `nsys profile ...`): each rank
  is a real process, prefix + python + `_rank_main task`;
- a training script (`training_script`): each rank runs it as torchrun would.
Real-process ranks get their settings through files in a private directory (0700, files
0600), removed when the job ends; nothing is ever put into a shell string.
"""

import dataclasses
import json
import logging
import os
import shutil
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Union

import cloudpickle
from torch.distributed.elastic.multiprocessing import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from . import _signals
from ._console import RankConsole
from ._failures import JobFailedError, describe
from ._interrupt import JobDeadline, JobInterrupted, deadline
from ._launch_config import Rendezvous, build_launch_config
from ._settings import JobSettings
from ._worker import RankPayload, run_rank

log = logging.getLogger(__name__)

RANK_MAIN = "hydra_plugins.hydra_torchrun_launcher._rank_main"


@dataclass
class JobPlan:
    """A sweep job, composed and checked, with what its ranks need; built before any rank starts."""

    idx: int
    overrides: List[str]
    settings: JobSettings
    rendezvous: Rendezvous
    nproc: int
    output_dir: Path
    payload: RankPayload


@dataclass
class AgentJob:
    plan: JobPlan
    launch_config: LaunchConfig
    entrypoint: Union[Callable[..., Any], str]
    args: List[Any]
    private_dir: Optional[Path]
    console: RankConsole


def build_agent_job(plan: JobPlan, devices: Optional[List[str]]) -> AgentJob:
    """The launch config and rank entry point of a job; `devices` become its CUDA_VISIBLE_DEVICES."""
    console = RankConsole()
    private_dir: Optional[Path] = None
    try:
        conf = plan.settings.conf
        env = dict(plan.payload.env)
        if devices is not None:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(devices)
        plan.output_dir.mkdir(parents=True, exist_ok=True)
        launch_config = build_launch_config(
            plan.settings,
            plan.rendezvous,
            nproc_per_node=plan.nproc,
            log_dir=conf.log_dir or str(plan.output_dir / "torchrun_logs"),
            console=console,
        )
        payload = dataclasses.replace(plan.payload, env=env)
        if conf.training_script is None and not conf.launch_prefix:
            args = [list(sys.path), cloudpickle.dumps(payload)]
            return AgentJob(plan, launch_config, run_rank, args, None, console)

        private_dir = Path(tempfile.mkdtemp(prefix="hydra_torchrun_"))  # 0700
        cwd = plan.payload.working_dir
        if conf.training_script is None:
            payload_file = private_dir / "payload.pkl"
            _write_private(payload_file, cloudpickle.dumps((list(sys.path), cloudpickle.dumps(payload))))
            command = [sys.executable, "-m", RANK_MAIN, "task", str(payload_file), str(private_dir)]
        else:
            # a script runs in its job's dir, whatever hydra.job.chdir says: its outputs belong there
            command = _script_command(plan.settings)
            cwd = str(plan.output_dir)
        spec = {"cwd": cwd, "env": env, "command": [*conf.launch_prefix, *command]}
        spec_file = private_dir / "rank.json"
        _write_private(spec_file, json.dumps(spec).encode())
        entry_args = ["-m", RANK_MAIN, "exec", str(spec_file)]
        return AgentJob(plan, launch_config, sys.executable, entry_args, private_dir, console)
    except BaseException:
        console.close()
        if private_dir is not None:
            shutil.rmtree(private_dir, ignore_errors=True)
        raise


def _script_command(settings: JobSettings) -> List[str]:
    """The command of a rank in script mode, as torchrun builds it."""
    conf = settings.conf
    assert conf.training_script is not None
    if conf.no_python:
        return [conf.training_script, *conf.training_script_args]
    if conf.run_path:
        code = "import runpy, sys; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"
        return [sys.executable, "-u", "-c", code, conf.training_script, *conf.training_script_args]
    module = ["-m"] if conf.module else []
    return [
        os.environ.get("PYTHON_EXEC", sys.executable),
        "-u",
        *module,
        conf.training_script,
        *conf.training_script_args,
    ]


def _write_private(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def run_agent_job(job: AgentJob) -> Any:
    """Run the job's agent to the end; its node's return value, or JobFailedError.

    In the main thread the agent's own signal handlers are in force while it runs (it
    forwards SIGINT/SIGTERM to the ranks and stops them); the launcher's handlers are put
    back afterwards and the signal handed to them.
    """
    conf = job.plan.settings.conf
    caught: Optional[int] = None
    # Built in the except clauses, raised after them: raised inside one it would keep the
    # caught error as __context__, and through its traceback the agent (store sockets,
    # threads) for as long as Hydra keeps the JobReturn, i.e. the whole sweep.
    failure: Optional[JobFailedError] = None
    try:
        with _signals.preserved_handlers(conf.signals_to_handle):
            try:
                with deadline(conf.job_timeout):
                    outputs = elastic_launch(job.launch_config, job.entrypoint)(*job.args)
            except SignalException as e:
                caught = e.sigval
        if caught is None:
            return _node_return_value(job, outputs)
    except ChildFailedError as e:
        failure = describe(e, _stderr_logs(job))
    except JobDeadline:
        failure = JobFailedError(
            f"the job ran past hydra.launcher.job_timeout={conf.job_timeout:g}s; its ranks were stopped"
        )
    except JobInterrupted:
        failure = JobFailedError("the launcher was interrupted; the job's ranks were stopped")
    finally:
        job.console.close()
        if job.private_dir is not None:
            shutil.rmtree(job.private_dir, ignore_errors=True)
    if failure is not None:
        raise failure
    # the agent has stopped the ranks; now the launcher reacts to the signal as it would alone
    if threading.current_thread() is threading.main_thread():
        _signals.redeliver(caught)
    raise JobFailedError(f"the job was stopped by signal {caught}")


def _node_return_value(job: AgentJob, outputs: Dict[int, Any]) -> Any:
    """Global rank 0's value; on the other nodes of a multi-node job, their first rank's."""
    if job.plan.settings.conf.training_script is not None:
        return None
    if job.private_dir is not None:
        returned = sorted(job.private_dir.glob("return_*.pkl"), key=lambda p: int(p.stem.split("_")[1]))
        return cloudpickle.loads(returned[0].read_bytes()) if returned else None
    pickled = outputs[min(outputs)]
    return None if pickled is None else cloudpickle.loads(pickled)


def _stderr_logs(job: AgentJob) -> List[Path]:
    """Each local rank's stderr file of the job's last attempt (where tee/redirects kept one)."""
    log_dir = Path(job.launch_config.logs_specs.root_log_dir)  # type: ignore[union-attr]
    attempts = sorted(
        log_dir.glob(f"{job.launch_config.run_id}_*/attempt_*"), key=lambda p: int(p.name.split("_")[1])
    )
    if not attempts:
        return []
    return [attempts[-1] / str(local_rank) / "stderr.log" for local_rank in range(job.plan.nproc)]
