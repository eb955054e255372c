"""A sweep job's plan: what the launcher composes and checks, and every later process reads.

The launcher builds one `JobPlan` per job before any rank of the sweep starts; it travels,
pickled, to the job's own process (inside its `JobRequest`), and its `RankPayload` on to
every rank. Types used by more than one process of the sweep live here, below them all.
"""

import signal
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Set

from omegaconf import DictConfig

from ..config import TorchrunLauncherConf
from .signals import signals_named


@dataclass(frozen=True)
class JobSettings:
    """The launcher config of one sweep job, plus the values derived from it."""

    conf: TorchrunLauncherConf
    min_nodes: int
    max_nodes: int
    rdzv_conf: Dict[str, Any]
    local_ranks_filter: Optional[Set[int]]
    # the job's nodes are hosts of their own (`torchrun_ssh`'s hosts, SLURM's nodes): what only
    # a node can tell (launch_prefix's program on its PATH, nproc_per_node's gpu / cpu / auto /
    # xpu counted by its torch, numa_binding's GPUs) is decided by each node's job process
    # there, as torchrun does on each node
    on_hosts: bool = False

    def changed_from_default(self) -> Dict[str, Any]:
        """Keys whose value differs from the plugin's default (to refuse unsupported ones)."""
        default = asdict(TorchrunLauncherConf())
        return {k: v for k, v in asdict(self.conf).items() if v != default[k]}


def stop_signal_of(conf: TorchrunLauncherConf) -> Optional[signal.Signals]:
    """The `stop_signal` as a signal (checked by `_check_stop_keys`); None when off."""
    return None if conf.stop_signal is None else signals_named(conf.stop_signal)[0]


@dataclass(frozen=True)
class Rendezvous:
    """Where and under which id the job's nodes meet (torch's rendezvous), one per job."""

    backend: str
    endpoint: str
    run_id: str
    configs: Dict[str, Any]


@dataclass(frozen=True)
class AppScript:
    """The app's script as every rank runs it, the way torchrun's ranks run it.

    Exactly one of `path` (`python app.py`, absolute) and `module` (`python -m pkg.app`) is
    set. `task_name` is the task function's qualified name in the script, when the body
    defines it there (found by name in the rank); None: the task travels by value.
    """

    path: Optional[str]
    module: Optional[str]
    argv0: str  # sys.argv[0] as the launcher has it (as typed, or the module's file)
    task_name: Optional[str]
    # how many `__wrapped__` levels inside what `task_name` leads to the task is
    task_unwraps: int = 0


@dataclass
class RankPayload:
    """What every rank of a job needs to run the task as the job's Hydra world sees it."""

    pickled_task: bytes  # cloudpickled once per sweep
    # Hydra's Singleton state, cloudpickled: the launch's, shared by its jobs (with
    # `pickled_hydra_config`), or, where that is empty, this job's whole
    pickled_state: bytes
    # the task's config, as run_job gives it the task: set by the job's process (`_job.process`)
    task_cfg: Optional[DictConfig]
    job_logging: Optional[Dict[str, Any]]  # hydra.job_logging, resolved
    job_num: int
    overrides: List[str]
    # this job's HydraConfig (its config), cloudpickled: HydraConfig's place in
    # `pickled_state`; set by the job's process, as run_job sets it
    pickled_hydra_config: bytes = b""
    failure_grace_s: float = 0.0  # see `_rank.worker._linger_before_failing`
    # the launcher's stop signal: the job's process acts on it, the rank ignores it
    stop_signal: Optional[int] = None
    # Hydra 1.4's trusted instantiate() targets (`@hydra.main(execution_whitelist=...)`)
    execution_whitelist: Any = None
    # the script every rank runs as `__mp_main__` first; None where there is none (python -c)
    script: Optional[AppScript] = None


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
    # the directory the sweep was launched from: relative script paths and log_dir start there
    launch_dir: str
    # what the console puts before each rank's lines ("" or the job's number when jobs overlap)
    console_label: str = ""
    # hydra.job.env_set, resolved (Hydra's run_job applies it; kept to show and rerun the job)
    env_set: Dict[str, str] = field(default_factory=dict)
    # the job was preempted in an earlier run of the sweep and continues in its job dir
    resumed: bool = False
    # what the job computes (the task's source, its config): a record of the same job has it
    fingerprint: str = ""
    # the host this node runs on, as ssh knows it (`torchrun_ssh`), or SLURM's name of the
    # node: named where a setting of the node's own is refused there
    host: Optional[str] = None
    # when the job's job_timeout ends, as this node's clock reads it (time.time()), where its
    # nodes start at different moments (`torchrun_ssh`): they all stop their ranks then, so
    # every node's ranks are still running to be named; None: job_timeout from this node's start
    deadline: Optional[float] = None
    # this launcher's node among the sweep's nodes that share its sweep dir (`_launcher.lock`);
    # node 0 keeps the sweep's record and the jobs' bookkeeping files
    node_slot: int = 0
