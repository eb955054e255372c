"""Structured config of `hydra/launcher=torchrun`.

Hydra imports this module on every run of every app (plugin discovery), so it must stay
cheap: a dataclass and the ConfigStore only, never torch. The keys mirror torchrun's flags
(underscore spelling) so that a torchrun command line translates key for key; values are
checked when a sweep is launched, in `_launcher.settings`.
"""

from dataclasses import MISSING, Field, asdict, dataclass, field, fields
from typing import Any, Dict, List, Optional, Tuple

from hydra.core.config_store import ConfigStore


@dataclass
class TorchrunLauncherConf:
    _target_: str = "hydra_plugins.hydra_torchrun_launcher.torchrun_launcher.TorchrunLauncher"

    # --- torchrun's flags ---
    # "N" or "MIN:MAX"
    nnodes: Any = 1
    # int, or gpu / cpu / auto / xpu as torchrun accepts
    nproc_per_node: Any = 1
    rdzv_backend: str = "static"
    rdzv_endpoint: str = ""
    # null: an id of its own for every sweep job (derived from the sweep and the job number)
    rdzv_id: Optional[str] = None
    # "key=value,key=value" as torchrun takes it, or a mapping
    rdzv_conf: Any = ""
    standalone: bool = False
    max_restarts: int = 0
    # seconds between checks of the ranks: a job ends at most this long after its ranks
    monitor_interval: float = 0.1
    # forkserver: ranks fork from a server that has torch imported and never touched CUDA
    start_method: str = "forkserver"
    role: str = "default"
    module: bool = False
    no_python: bool = False
    run_path: bool = False
    # null: <job output dir>/torchrun_logs
    log_dir: Optional[str] = None
    # torchrun's Std spec: 0 none, 1 stdout, 2 stderr, 3 both; or "0:3,1:0" per local rank
    redirects: Any = "0"
    # 3: every rank's stdout and stderr go to files and to the console
    tee: Any = "3"
    # "0,1": local ranks whose output the console shows (files always keep all)
    local_ranks_filter: str = ""
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    # null: every job gets a free port of its own
    master_port: Optional[int] = None
    local_addr: Optional[str] = None
    training_script: Optional[str] = None
    training_script_args: List[str] = field(default_factory=list)
    # name of a `torchrun.logs_specs` entry point
    logs_specs: Optional[str] = None
    numa_binding: Optional[str] = None
    signals_to_handle: str = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"
    # seconds between the graceful signal and SIGKILL when ranks are stopped
    shutdown_timeout: int = 5
    virtual_local_rank: bool = False
    log_line_prefix_template: Optional[str] = None
    # torch's event handler name ("console", ...); null: torch's "null" handler
    event_log_handler: Optional[str] = None
    duplicate_stdout_filters: Optional[List[str]] = None
    duplicate_stderr_filters: Optional[List[str]] = None

    # --- the plugin's own ---
    # how many sweep jobs run at once on this node
    parallel_jobs: int = 1
    # device ids that concurrent jobs share out (null: all visible)
    devices: Optional[List[Any]] = None
    # seconds; a job still running then is stopped and FAILED
    job_timeout: Optional[float] = None
    # command put before every rank's interpreter, e.g. [numactl, --cpunodebind=0]
    launch_prefix: List[str] = field(default_factory=list)
    # auto: take nnodes / node_rank / rendezvous from the cluster environment found first of
    # SLURM (an srun step), torchrun's PET_* variables (Kubernetes), MPI (mpirun), LSF (jsrun);
    # slurm / pet / mpi / lsf: require that one; none: off
    cluster: str = "auto"
    # what the warm server imports once per sweep so ranks start with it: auto = torch plus
    # the installed packages the app had imported when the sweep launched; a list = torch
    # plus those modules; [] = torch only
    preload: Any = "auto"
    # the signal that asks running jobs to stop at their next step boundary (a preemption
    # notice: SLURM's --signal=USR2@120); null: none. Not USR1: NCCL uses it
    stop_signal: Optional[str] = "SIGUSR2"
    # seconds the ranks have, after a stop request, to checkpoint and return; then they
    # are stopped as on a failure
    stop_timeout: float = 300.0
    # auto: after a stop inside a requeue-able SLURM batch job, node 0 requeues it; false: never
    requeue: Any = "auto"
    # auto: a sweep dir that holds this launcher's record of the same sweep resumes it
    # (completed jobs come from the record, the others run); true: as auto, and an error
    # when there is nothing to resume; false: every job runs
    resume: Any = "auto"
    # print every job's plan (overrides, ranks, devices, rendezvous, the equivalent torchrun
    # command) and start nothing
    dry_run: bool = False


# the keys above that are torchrun's own flags (the first section of TorchrunLauncherConf)
TORCHRUN_FLAGS: Tuple[str, ...] = (
    "nnodes",
    "nproc_per_node",
    "rdzv_backend",
    "rdzv_endpoint",
    "rdzv_id",
    "rdzv_conf",
    "standalone",
    "max_restarts",
    "monitor_interval",
    "start_method",
    "role",
    "module",
    "no_python",
    "run_path",
    "log_dir",
    "redirects",
    "tee",
    "local_ranks_filter",
    "node_rank",
    "master_addr",
    "master_port",
    "local_addr",
    "training_script",
    "training_script_args",
    "logs_specs",
    "numa_binding",
    "signals_to_handle",
    "shutdown_timeout",
    "virtual_local_rank",
    "log_line_prefix_template",
    "event_log_handler",
    "duplicate_stdout_filters",
    "duplicate_stderr_filters",
)

# Stored as plain values, not as the dataclass: OmegaConf's conversion of a 45-field
# structured config costs Hydra's start-up about 4 ms on every run of every app. The types
# are checked, with a message naming the key, when a sweep is launched (`_launcher.settings`).
ConfigStore.instance().store(
    group="hydra/launcher",
    name="torchrun",
    node=asdict(TorchrunLauncherConf()),
    provider="hydra_torchrun_launcher",
)


def _as_in_torchrun_launcher(key: str) -> Any:
    """A field with `key`'s default in TorchrunLauncherConf: the SLURM launcher's per-job keys
    mean what they mean there, so their defaults are written once."""
    local: Field = next(f for f in fields(TorchrunLauncherConf) if f.name == key)
    if local.default_factory is not MISSING:
        return field(default_factory=local.default_factory)
    return field(default=local.default)


@dataclass
class TorchrunSlurmLauncherConf:
    """`hydra/launcher=torchrun_slurm`: every sweep job a SLURM job of its own, from a login node.

    The first section is hydra-submitit-launcher's keys under the same names and meanings
    (a config written for `submitit_slurm` keeps working); the second the torchrun
    launcher's keys that make sense per job (`nodes` stands for `nnodes`; the rendezvous is
    on the job's first node, on a port of the job's own).
    """

    _target_: str = "hydra_plugins.hydra_torchrun_launcher.torchrun_launcher.TorchrunSlurmLauncher"

    # --- hydra-submitit-launcher's keys ---
    # the job's time limit (sbatch --time), minutes
    timeout_min: int = 60
    nodes: int = 1
    partition: Optional[str] = None
    qos: Optional[str] = None
    account: Optional[str] = None
    comment: Optional[str] = None
    constraint: Optional[str] = None
    exclude: Optional[str] = None
    gres: Optional[str] = None
    gpus_per_node: Optional[int] = None
    cpus_per_task: Optional[int] = None
    cpus_per_gpu: Optional[int] = None
    gpus_per_task: Optional[int] = None
    mem_gb: Optional[int] = None
    mem_per_gpu: Optional[str] = None
    mem_per_cpu: Optional[str] = None
    # the SLURM job's name
    name: str = "${hydra.job.name}"
    # shell lines the batch script runs before `srun` (module load ..., source venv/bin/activate)
    setup: Optional[List[str]] = None
    # more options of the `srun` that starts one task per node
    srun_args: Optional[List[str]] = None
    # more `#SBATCH --key=value` lines, e.g. {mail-type: END}
    additional_parameters: Dict[str, Any] = field(default_factory=dict)
    # how many jobs of an array SLURM runs at once
    array_parallelism: int = 256
    # seconds before the time limit at which SLURM sends the stop signal (--signal=USR2@...)
    signal_delay_s: int = 120
    # how many times a job that reached its time limit is requeued (preemptions always are)
    max_num_timeout: int = 0

    # --- the torchrun launcher's keys that make sense per job ---
    nproc_per_node: Any = _as_in_torchrun_launcher("nproc_per_node")
    rdzv_conf: Any = _as_in_torchrun_launcher("rdzv_conf")
    max_restarts: int = _as_in_torchrun_launcher("max_restarts")
    monitor_interval: float = _as_in_torchrun_launcher("monitor_interval")
    start_method: str = _as_in_torchrun_launcher("start_method")
    role: str = _as_in_torchrun_launcher("role")
    module: bool = _as_in_torchrun_launcher("module")
    no_python: bool = _as_in_torchrun_launcher("no_python")
    run_path: bool = _as_in_torchrun_launcher("run_path")
    log_dir: Optional[str] = _as_in_torchrun_launcher("log_dir")
    redirects: Any = _as_in_torchrun_launcher("redirects")
    tee: Any = _as_in_torchrun_launcher("tee")
    local_ranks_filter: str = _as_in_torchrun_launcher("local_ranks_filter")
    local_addr: Optional[str] = _as_in_torchrun_launcher("local_addr")
    training_script: Optional[str] = _as_in_torchrun_launcher("training_script")
    training_script_args: List[str] = _as_in_torchrun_launcher("training_script_args")
    logs_specs: Optional[str] = _as_in_torchrun_launcher("logs_specs")
    numa_binding: Optional[str] = _as_in_torchrun_launcher("numa_binding")
    signals_to_handle: str = _as_in_torchrun_launcher("signals_to_handle")
    shutdown_timeout: int = _as_in_torchrun_launcher("shutdown_timeout")
    virtual_local_rank: bool = _as_in_torchrun_launcher("virtual_local_rank")
    log_line_prefix_template: Optional[str] = _as_in_torchrun_launcher("log_line_prefix_template")
    event_log_handler: Optional[str] = _as_in_torchrun_launcher("event_log_handler")
    duplicate_stdout_filters: Optional[List[str]] = _as_in_torchrun_launcher("duplicate_stdout_filters")
    duplicate_stderr_filters: Optional[List[str]] = _as_in_torchrun_launcher("duplicate_stderr_filters")
    job_timeout: Optional[float] = _as_in_torchrun_launcher("job_timeout")
    launch_prefix: List[str] = _as_in_torchrun_launcher("launch_prefix")
    stop_signal: Optional[str] = _as_in_torchrun_launcher("stop_signal")
    stop_timeout: float = _as_in_torchrun_launcher("stop_timeout")
    resume: Any = _as_in_torchrun_launcher("resume")
    # print every job's sbatch script and submit nothing
    dry_run: bool = False


# the keys of TorchrunSlurmLauncherConf that are SLURM's (the first section); the others
# are the torchrun launcher's own, with the same meaning there
SLURM_KEYS: Tuple[str, ...] = (
    "timeout_min",
    "nodes",
    "partition",
    "qos",
    "account",
    "comment",
    "constraint",
    "exclude",
    "gres",
    "gpus_per_node",
    "cpus_per_task",
    "cpus_per_gpu",
    "gpus_per_task",
    "mem_gb",
    "mem_per_gpu",
    "mem_per_cpu",
    "name",
    "setup",
    "srun_args",
    "additional_parameters",
    "array_parallelism",
    "signal_delay_s",
    "max_num_timeout",
)

ConfigStore.instance().store(
    group="hydra/launcher",
    name="torchrun_slurm",
    node=asdict(TorchrunSlurmLauncherConf()),
    provider="hydra_torchrun_launcher",
)
