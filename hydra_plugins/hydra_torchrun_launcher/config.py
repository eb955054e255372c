"""Structured config of `hydra/launcher=torchrun`, `hydra/launcher=torchrun_slurm` and
`hydra/launcher=torchrun_ssh`.

Hydra imports this module on every run of every app (plugin discovery), so it must stay
cheap: dataclasses and the ConfigStore only, never torch. The keys mirror torchrun's flags
(underscore spelling) so that a torchrun command line translates key for key; values are
checked when a sweep is launched, in `_launcher.settings`.

Each key is described once, by its field: its default, and (`_key`) what the rest of the
package needs to know of it, read back with `described`: the torchrun flag it is, the
LaunchConfig field that carries it, whether it changes what a job computes, whether a job
has it on its own (and so `hydra/launcher=torchrun_slurm` too).
"""

import copy
from dataclasses import MISSING, asdict, dataclass, field, fields, make_dataclass
from functools import partial
from typing import Any, Callable, Dict, List, Optional, Tuple

from hydra.core.config_store import ConfigNode, ConfigStore
from omegaconf import DictConfig, OmegaConf


def _key(
    default: Any = MISSING,
    *,
    factory: Any = MISSING,
    fingerprinted: bool,
    per_job: bool = False,
    torchrun: Optional[str] = None,
    pet: bool = True,
    launch_config: Optional[str] = None,
    hosts: bool = False,
) -> Any:
    """A launcher key: its default (`factory` for a list), and its description.

    fingerprinted: it changes what a job computes (the record's fingerprint holds it: a
        changed value makes another sweep); not: it says how or where jobs run, or what they show.
    per_job: a job has it on its own, wherever it runs: `hydra/launcher=torchrun_slurm` has
        it too. Not: it places the sweep's jobs on this launcher's nodes (rendezvous, devices).
    torchrun: torchrun's own option for it (`--nnodes`), or its positional argument's name.
    pet: some torchrun reads that option from `PET_<KEY>` too (torch's `env` actions).
    launch_config: the LaunchConfig field that carries it, where an older torch lacks that
        field (the key is refused by name when set on such a torch).
    hosts: not per job, but each host's agent of `hydra/launcher=torchrun_ssh` has it too, for
        the whole sweep (what the host's warm server does): that launcher has it after the
        per-job keys.
    """
    metadata: Dict[str, Any] = {"fingerprinted": fingerprinted, "per_job": per_job}
    if hosts:
        metadata["hosts"] = True
    if torchrun is not None:
        metadata.update(torchrun=torchrun, pet=pet)
    if launch_config is not None:
        metadata["launch_config"] = launch_config
    if factory is not MISSING:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass
class TorchrunLauncherConf:
    _target_: str = "hydra_plugins.hydra_torchrun_launcher.torchrun_launcher.TorchrunLauncher"

    # --- torchrun's flags ---
    # "N" or "MIN:MAX"
    nnodes: Any = _key(1, torchrun="--nnodes", fingerprinted=True)
    # int, or gpu / cpu / auto / xpu as torchrun accepts
    nproc_per_node: Any = _key(1, torchrun="--nproc-per-node", fingerprinted=True, per_job=True)
    rdzv_backend: str = _key("static", torchrun="--rdzv-backend", fingerprinted=True)
    rdzv_endpoint: str = _key("", torchrun="--rdzv-endpoint", fingerprinted=False)
    # null: an id of its own for every sweep job (derived from the sweep and the job number)
    rdzv_id: Optional[str] = _key(None, torchrun="--rdzv-id", fingerprinted=False)
    # "key=value,key=value" as torchrun takes it, or a mapping
    rdzv_conf: Any = _key("", torchrun="--rdzv-conf", fingerprinted=True, per_job=True)
    standalone: bool = _key(False, torchrun="--standalone", fingerprinted=True)
    max_restarts: int = _key(0, torchrun="--max-restarts", fingerprinted=True, per_job=True)
    # seconds between checks of the ranks: a job ends at most this long after its ranks
    monitor_interval: float = _key(0.1, torchrun="--monitor-interval", fingerprinted=False, per_job=True)
    # forkserver: ranks fork from a server that has torch imported and never touched CUDA
    start_method: str = _key("forkserver", torchrun="--start-method", fingerprinted=False, per_job=True)
    role: str = _key("default", torchrun="--role", fingerprinted=True, per_job=True)
    module: bool = _key(False, torchrun="--module", fingerprinted=True, per_job=True)
    no_python: bool = _key(False, torchrun="--no-python", fingerprinted=True, per_job=True)
    run_path: bool = _key(False, torchrun="--run-path", fingerprinted=True, per_job=True)
    # null: <job output dir>/torchrun_logs
    log_dir: Optional[str] = _key(None, torchrun="--log-dir", fingerprinted=False, per_job=True)
    # torchrun's Std spec: 0 none, 1 stdout, 2 stderr, 3 both; or "0:3,1:0" per local rank
    redirects: Any = _key("0", torchrun="--redirects", fingerprinted=False, per_job=True)
    # 3: every rank's stdout and stderr go to files and to the console
    tee: Any = _key("3", torchrun="--tee", fingerprinted=False, per_job=True)
    # "0,1": local ranks whose output the console shows (files always keep all)
    local_ranks_filter: str = _key(
        "", torchrun="--local-ranks-filter", launch_config="logs_specs", fingerprinted=False, per_job=True
    )
    node_rank: int = _key(0, torchrun="--node-rank", fingerprinted=False)
    master_addr: str = _key("127.0.0.1", torchrun="--master-addr", fingerprinted=False)
    # null: every job gets a free port of its own
    master_port: Optional[int] = _key(None, torchrun="--master-port", fingerprinted=False)
    local_addr: Optional[str] = _key(
        None, torchrun="--local-addr", launch_config="local_addr", fingerprinted=False, per_job=True
    )
    training_script: Optional[str] = _key(
        None, torchrun="training_script", pet=False, fingerprinted=True, per_job=True
    )
    training_script_args: List[str] = _key(
        factory=list, torchrun="training_script_args", pet=False, fingerprinted=True, per_job=True
    )
    # name of a `torchrun.logs_specs` entry point
    logs_specs: Optional[str] = _key(
        None,
        torchrun="--logs-specs",
        pet=False,
        launch_config="logs_specs",
        fingerprinted=False,
        per_job=True,
    )
    numa_binding: Optional[str] = _key(
        None,
        torchrun="--numa-binding",
        pet=False,
        launch_config="numa_options",
        fingerprinted=True,
        per_job=True,
    )
    signals_to_handle: str = _key(
        "SIGTERM,SIGINT,SIGHUP,SIGQUIT",
        torchrun="--signals-to-handle",
        launch_config="signals_to_handle",
        fingerprinted=False,
        per_job=True,
    )
    # seconds between the graceful signal and SIGKILL when ranks are stopped
    shutdown_timeout: int = _key(
        5, torchrun="--shutdown-timeout", launch_config="shutdown_timeout", fingerprinted=False, per_job=True
    )
    virtual_local_rank: bool = _key(
        False,
        torchrun="--virtual-local-rank",
        launch_config="virtual_local_rank",
        fingerprinted=True,
        per_job=True,
    )
    log_line_prefix_template: Optional[str] = _key(
        None,
        torchrun="--log-line-prefix-template",
        launch_config="log_line_prefix_template",
        fingerprinted=False,
        per_job=True,
    )
    # torch's event handler name ("console", ...); null: torch's "null" handler
    event_log_handler: Optional[str] = _key(
        None,
        torchrun="--event-log-handler",
        launch_config="event_log_handler",
        fingerprinted=False,
        per_job=True,
    )
    duplicate_stdout_filters: Optional[List[str]] = _key(
        None,
        torchrun="--duplicate-stdout-filters",
        launch_config="duplicate_stdout_filters",
        fingerprinted=False,
        per_job=True,
    )
    duplicate_stderr_filters: Optional[List[str]] = _key(
        None,
        torchrun="--duplicate-stderr-filters",
        launch_config="duplicate_stderr_filters",
        fingerprinted=False,
        per_job=True,
    )

    # --- the plugin's own ---
    # how many sweep jobs run at once on this node
    parallel_jobs: int = _key(1, fingerprinted=False)
    # device ids that concurrent jobs share out (null: all visible)
    devices: Optional[List[Any]] = _key(None, fingerprinted=False)
    # seconds; a job still running then is stopped and FAILED
    job_timeout: Optional[float] = _key(None, fingerprinted=False, per_job=True)
    # command put before every rank's interpreter, e.g. [numactl, --cpunodebind=0]
    launch_prefix: List[str] = _key(factory=list, fingerprinted=False, per_job=True)
    # auto: take nnodes / node_rank / rendezvous from the cluster environment found first of
    # SLURM (an srun step), torchrun's PET_* variables (Kubernetes), MPI (mpirun), LSF (jsrun);
    # slurm / pet / mpi / lsf: require that one; none: off
    cluster: str = _key("auto", fingerprinted=False)
    # what the warm server imports once per sweep so ranks start with it: auto = torch plus
    # the installed packages the app had imported when the sweep launched; a list = torch
    # plus those modules; [] = torch only
    preload: Any = _key("auto", fingerprinted=False, hosts=True)
    # the signal that asks running jobs to stop at their next step boundary (a preemption
    # notice: SLURM's --signal=USR2@120); null: none. Not USR1: NCCL uses it
    stop_signal: Optional[str] = _key("SIGUSR2", fingerprinted=False, per_job=True)
    # seconds the ranks have, after a stop request, to checkpoint and return; then they
    # are stopped as on a failure
    stop_timeout: float = _key(300.0, fingerprinted=False, per_job=True)
    # auto: after a stop inside a requeue-able SLURM batch job, node 0 requeues it; false: never
    requeue: Any = _key("auto", fingerprinted=False)
    # auto: a sweep dir that holds this launcher's record of the same sweep resumes it
    # (completed jobs come from the record, the others run); true: as auto, and an error
    # when there is nothing to resume; false: every job runs
    resume: Any = _key("auto", fingerprinted=False, per_job=True)
    # print every job's plan and start nothing: here its ranks, devices, rendezvous and the
    # equivalent torchrun command; under SLURM its sbatch script
    dry_run: bool = _key(False, fingerprinted=False, per_job=True)


def described(what: str) -> Dict[str, Any]:
    """The keys of TorchrunLauncherConf whose description (`_key`) has `what`, each with its
    value there, in the keys' order: `described("torchrun")` is torchrun's keys and their flags."""
    return {f.name: f.metadata[what] for f in fields(TorchrunLauncherConf) if what in f.metadata}


# torchrun's own keys (the first section of TorchrunLauncherConf), each with its flag
TORCHRUN_FLAGS: Dict[str, str] = described("torchrun")


class _BuiltWhenLoaded(ConfigNode):
    """A ConfigStore entry whose DictConfig is made the first time Hydra loads it, once.

    OmegaConf makes a DictConfig of 45 keys in about 3 ms; storing each launcher's config
    that way would cost every run of every app (plugin discovery) that much per launcher,
    though only a run that picks the launcher ever reads it. Hydra's ConfigStore hands out
    `copy(entry)` with `node` deep-copied, so a property in place of the field is all it sees.

    Hydra deep-copies the whole ConfigStore each time it composes a config (its caching
    repository copies its sources), and composes every job of a sweep again: a deep copy of
    the entry shares what it built (a list the copies hold), so the DictConfig is made once
    a process, not once a job. Nothing mutates it: Hydra's `load` hands out a deep copy.
    """

    def __init__(self, name: str, build: Callable[[], Dict[str, Any]], group: str, provider: str) -> None:
        self._build = build
        self._built: List[DictConfig] = []  # what this entry and its copies built
        self._node: Optional[DictConfig] = None  # a node set on a copy (Hydra's `load`)
        super().__init__(name=name, node=None, group=group, package=None, provider=provider)  # type: ignore[arg-type]

    @property  # type: ignore[override]
    def node(self) -> DictConfig:
        if self._node is not None:
            return self._node
        if not self._built:
            self._built.append(OmegaConf.create(self._build()))
        return self._built[0]

    @node.setter
    def node(self, value: Optional[DictConfig]) -> None:
        self._node = value

    def __deepcopy__(self, memo: Dict[int, Any]) -> "_BuiltWhenLoaded":
        copied = copy.copy(self)
        copied._node = copy.deepcopy(self._node, memo)
        return copied


def _defaults(conf: type) -> Dict[str, Any]:
    """A launcher config's keys and defaults as plain values: its types are checked, with a
    message naming the key, when a sweep is launched (`_launcher.settings`)."""
    return asdict(conf())


def _store(name: str, conf: type) -> None:
    """`hydra/launcher=<name>`: `conf`'s defaults, made into a DictConfig when Hydra loads them.

    Where this Hydra's ConfigStore is not the one `_BuiltWhenLoaded` knows (a `repo` of
    nested dicts of ConfigNode), it is stored as Hydra documents, at once."""
    store = ConfigStore.instance()
    group = "hydra/launcher"
    known = ["name", "node", "group", "package", "provider"]
    if not isinstance(getattr(store, "repo", None), dict) or [f.name for f in fields(ConfigNode)] != known:
        store.store(group=group, name=name, node=_defaults(conf), provider="hydra_torchrun_launcher")
        return
    entries = store.repo
    for part in group.split("/"):
        entries = entries.setdefault(part, {})
    entries[f"{name}.yaml"] = _BuiltWhenLoaded(
        f"{name}.yaml", partial(_defaults, conf), group, "hydra_torchrun_launcher"
    )


_store("torchrun", TorchrunLauncherConf)


@dataclass(init=False, repr=False, eq=False)
class _SlurmQueueConf:
    """hydra-submitit-launcher's keys (its `SlurmQueueConf`) under the same names and meanings:
    a config written for `submitit_slurm` keeps working."""

    _target_: str = "hydra_plugins.hydra_torchrun_launcher.torchrun_launcher.TorchrunSlurmLauncher"
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


# the keys of TorchrunSlurmLauncherConf that are SLURM's; the others are the torchrun
# launcher's own, with the same meaning there
SLURM_KEYS: Tuple[str, ...] = tuple(f.name for f in fields(_SlurmQueueConf) if f.name != "_target_")


# The per-job keys as a base of TorchrunSlurmLauncherConf, made of TorchrunLauncherConf's own
# fields: TorchrunLauncherConf cannot inherit it, as its order (what `--cfg hydra` prints)
# interleaves per-job keys with the others. Each base has a docstring: without one,
# dataclass writes one from inspect.signature, which costs 2 ms at import here.
def _keys_of_launcher(name: str, marked: str, doc: str) -> type:
    """A base made of TorchrunLauncherConf's fields whose metadata says `marked`, in its order,
    with their defaults and descriptions: the keys another launcher shares with it."""
    return make_dataclass(
        name,
        [
            (f.name, f.type, field(default=f.default, default_factory=f.default_factory, metadata=f.metadata))
            for f in fields(TorchrunLauncherConf)
            if f.metadata.get(marked)
        ],
        namespace={"__doc__": doc},
        init=False,
        repr=False,
        eq=False,
    )


PerJobConf = _keys_of_launcher(
    "PerJobConf",
    "per_job",
    "The torchrun launcher's keys that a job has on its own (`per_job`), in its "
    "order, with its defaults and descriptions: what every way of running jobs shares.",
)


# no __repr__ or __eq__ of its 53 fields: their code costs discovery about 1 ms
@dataclass(repr=False, eq=False)
class TorchrunSlurmLauncherConf(PerJobConf, _SlurmQueueConf):
    """`hydra/launcher=torchrun_slurm`: every sweep job a SLURM job of its own, from a login node.

    hydra-submitit-launcher's keys (`_SlurmQueueConf`), then the torchrun launcher's keys
    that a job has on its own (`PerJobConf`): `nodes` stands for `nnodes`; the rendezvous is
    on the job's first node, on a port of the job's own.
    """

    # submit every job, record it and end: the jobs run on without this command (the same
    # command without detach comes back for their results; `torchrun-sweep status <sweep dir>`)
    detach: bool = False


_store("torchrun_slurm", TorchrunSlurmLauncherConf)


@dataclass(init=False, repr=False, eq=False)
class _SshHostsConf:
    """The hosts of `hydra/launcher=torchrun_ssh` and how ssh reaches them."""

    _target_: str = "hydra_plugins.hydra_torchrun_launcher.torchrun_launcher.TorchrunSshLauncher"
    # host names as ssh knows them (its config's Host aliases too)
    hosts: List[str] = field(default_factory=list)
    # or a file of hosts, one a line; DeepSpeed's `host slots=N` (N devices the jobs there
    # share out; a host without slots runs one job at a time); `#` starts a comment
    hostfile: Optional[str] = None
    # hosts per job; its nodes meet in a c10d rendezvous on its first host
    nodes: int = 1
    # how many jobs run at once; null: as many as the hosts hold
    parallel_jobs: Optional[int] = None
    # more ssh arguments, after the launcher's own (-T -o BatchMode=yes): [-F, ssh_config]
    ssh_options: List[str] = field(default_factory=list)
    # the interpreter on the hosts; null: this one's path
    python: Optional[str] = None
    # the head's variables the ranks get (names, PREFIX* patterns), besides every env_set key
    env_forward: List[str] = field(
        default_factory=lambda: [
            *("NCCL_*", "CUDA_*", "PYTHON*", "OMP_*", "HF_*", "WANDB_*", "TORCH_*", "UCX_*", "FI_*")
        ]
    )


# the keys of TorchrunSshLauncherConf that are the hosts'; the others are the torchrun
# launcher's own, with the same meaning there
SSH_KEYS: Tuple[str, ...] = tuple(f.name for f in fields(_SshHostsConf) if f.name != "_target_")


# The keys each host's agent has too (`hosts`), as a base of TorchrunSshLauncherConf made of
# TorchrunLauncherConf's own fields, as PerJobConf is.
HostAgentConf = _keys_of_launcher(
    "HostAgentConf",
    "hosts",
    "The torchrun launcher's keys that each host's agent of torchrun_ssh has too "
    "(`hosts`), in its order, with its defaults and descriptions.",
)


# no __repr__ or __eq__ of its fields, as the SLURM conf: their code costs discovery
@dataclass(repr=False, eq=False)
class TorchrunSshLauncherConf(HostAgentConf, PerJobConf, _SshHostsConf):
    """`hydra/launcher=torchrun_ssh`: the sweep's jobs on a few hosts over ssh, no scheduler.

    The hosts' keys (`_SshHostsConf`), then the torchrun launcher's keys that a job has on
    its own (`PerJobConf`): `nodes` stands for `nnodes`; then those each host's agent has
    too (`HostAgentConf`: `preload`).
    """


_store("torchrun_ssh", TorchrunSshLauncherConf)
