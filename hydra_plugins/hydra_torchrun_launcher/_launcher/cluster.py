"""`cluster: auto | slurm | none`: nnodes, node_rank and the rendezvous from SLURM's environment.

Only a launcher that runs as a task of an `srun` job step, one task per node, takes the
multi-node settings. Slurm marks such a task by the variables its step launch sets
(src/common/env.c, `env_array_for_step` and slurmstepd's task setup):

- SLURM_STEP_ID: the step's id. A batch script is no step of this kind (its step id is the
  special SLURM_BATCH_SCRIPT, never exported), an salloc shell has no step at all, and the
  special steps (batch, extern, interactive: ids >= SLURM_MAX_NORMAL_STEP_ID) are refused.
- SLURM_STEP_NUM_NODES, SLURM_STEP_NODELIST, SLURM_STEP_NUM_TASKS: the step's own layout
  (SLURM_NNODES is the job's under `srun --preserve-env`, so it is not used).
- SLURM_NODEID: this node's index in the step; SLURM_LOCALID: the task's index on its node.

A batch script and an salloc shell have SLURM_JOB_ID (and, in a batch script,
SLURM_NODEID/SLURM_PROCID=0) but no SLURM_STEP_ID: there the launcher runs single-node
instead of waiting for nodes that never come. A step that runs more than one task per
node is refused: every task would start its own copy of the sweep.

Pure functions over an environ mapping, no torch: unit-testable anywhere.
"""

import dataclasses
import hashlib
from dataclasses import dataclass
from typing import AbstractSet, Any, Dict, Mapping, Optional, Tuple

import hostlist

from .._shared.errors import LauncherConfigError
from .._shared.plan import JobSettings
from ..config import TorchrunLauncherConf
from .settings import CLUSTERS, parse_nnodes

# slurm.h: ids above this are the special steps (pending, extern, batch, interactive)
SLURM_MAX_NORMAL_STEP_ID = 0xFFFFFFF0
# the rendezvous port when none is given: the same on every node of a step, different for
# other steps; 20000-31999 stays below Linux's default ephemeral range (32768-60999)
PORT_BASE = 20000
PORT_SPAN = 12000

_STEP_VARS = ("SLURM_STEP_NUM_NODES", "SLURM_STEP_NODELIST", "SLURM_NODEID")


@dataclass(frozen=True)
class ClusterLayout:
    """What the srun step says about this node's place in it."""

    nnodes: int
    node_rank: int
    # host of node 0 of the step (the rendezvous host)
    master_addr: str
    # the port derived from the job and step ids
    port: int
    # master_addr:port
    rdzv_endpoint: str
    rdzv_id: str
    job_id: str
    step_id: int
    nodes: Tuple[str, ...]
    # what was detected, for the log
    description: str


@dataclass(frozen=True)
class Detection:
    """The layout to use (None: run single-node) and a line saying why, for the log."""

    layout: Optional[ClusterLayout]
    # None when there is nothing to say (no SLURM job around, cluster left at auto/none)
    note: Optional[str]


def detect(cluster: str, environ: Mapping[str, str]) -> Optional[ClusterLayout]:
    """The multi-node layout of the srun step this process runs in, or None (single-node)."""
    return inspect_environment(cluster, environ).layout


def inspect_environment(cluster: str, environ: Mapping[str, str]) -> Detection:
    """Read SLURM's variables; raise LauncherConfigError where they cannot be used safely."""
    if cluster not in CLUSTERS:
        raise LauncherConfigError(
            f"hydra.launcher.cluster={cluster!r} is invalid: use one of {', '.join(CLUSTERS)}"
        )
    job_id = environ.get("SLURM_JOB_ID") or environ.get("SLURM_JOBID")
    if cluster == "none":
        note = f"SLURM job {job_id} ignored (hydra.launcher.cluster=none)" if job_id else None
        return Detection(None, note)

    step_var = "SLURM_STEP_ID" if environ.get("SLURM_STEP_ID") else "SLURM_STEPID"
    if not job_id or not environ.get(step_var):
        where = (
            f"SLURM job {job_id} but no job step (an salloc shell or a batch script)"
            if job_id
            else "no SLURM job"
        )
        if cluster == "slurm":
            raise LauncherConfigError(
                f"hydra.launcher.cluster=slurm needs the launcher to run as an srun task, one per "
                f"node: SLURM_STEP_ID is not set ({where}); start it with "
                f"`srun --ntasks-per-node=1 python app.py ...`"
            )
        if not job_id:
            return Detection(None, None)
        return Detection(
            None,
            f"{where}: running single-node; to use the job's {environ.get('SLURM_NNODES', '?')} "
            f"node(s), start the launcher with `srun --ntasks-per-node=1`",
        )

    step_id = _int_var(environ, step_var)
    if step_id >= SLURM_MAX_NORMAL_STEP_ID:
        # a special step (batch, extern, interactive) is not an srun step of the user's
        return _not_a_step(
            cluster, job_id, f"SLURM_STEP_ID={step_id} is a special step (batch/extern/interactive)"
        )
    missing = [name for name in _STEP_VARS if not environ.get(name)]
    if missing:
        return _not_a_step(cluster, job_id, f"{missing[0]} is not set")

    nnodes = _int_var(environ, "SLURM_STEP_NUM_NODES")
    node_rank = _int_var(environ, "SLURM_NODEID")
    nodes = _expand(environ, "SLURM_STEP_NODELIST")
    if len(nodes) != nnodes:
        raise LauncherConfigError(
            f"SLURM_STEP_NODELIST={environ['SLURM_STEP_NODELIST']!r} names {len(nodes)} node(s) but "
            f"SLURM_STEP_NUM_NODES={nnodes}; set hydra.launcher.cluster=none to ignore SLURM"
        )
    if not 0 <= node_rank < nnodes:
        raise LauncherConfigError(
            f"SLURM_NODEID={node_rank} is not a node of this {nnodes}-node step; "
            f"set hydra.launcher.cluster=none to ignore SLURM"
        )
    # variables inherited from another step (a job submitted from inside a step) name
    # nodes that are not this node, or not in this job: never take those
    here = environ.get("SLURMD_NODENAME")
    if here and nodes[node_rank] != here:
        return _not_a_step(
            cluster,
            job_id,
            f"SLURMD_NODENAME={here} is not node {node_rank} ({nodes[node_rank]}) of "
            f"SLURM_STEP_NODELIST (variables of another step?)",
        )
    job_nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
    if job_nodelist:
        stray = sorted(set(nodes) - set(_expand(environ, "SLURM_JOB_NODELIST", job_nodelist)))
        if stray:
            return _not_a_step(
                cluster,
                job_id,
                f"step node {stray[0]} is not in SLURM_JOB_NODELIST (variables of another job?)",
            )
    _check_one_task_per_node(environ, nnodes)

    where = (
        f"SLURM job {job_id} step {step_id}: {nnodes} node(s) "
        f"{environ['SLURM_STEP_NODELIST']}, this is node {node_rank} ({nodes[node_rank]})"
    )
    if nnodes == 1:
        return Detection(None, f"{where}: a single node, running single-node")
    # a requeued job runs again with its id and step ids: its rendezvous (port and id) is
    # a new one all the same, never one a straggler of the run before could still hold
    restarts = _int_var(environ, "SLURM_RESTART_COUNT") if environ.get("SLURM_RESTART_COUNT") else 0
    run = f"{job_id}.{step_id}" + (f".restart{restarts}" if restarts else "")
    port = derived_port(run)
    layout = ClusterLayout(
        nnodes=nnodes,
        node_rank=node_rank,
        master_addr=nodes[0],
        port=port,
        rdzv_endpoint=f"{nodes[0]}:{port}",
        rdzv_id=f"slurm-{run}",
        job_id=job_id,
        step_id=step_id,
        nodes=tuple(nodes),
        description=where,
    )
    return Detection(layout, where)


def derived_port(run: str) -> int:
    """A port every node of the step computes alike, and other steps (likely) not; `run` is
    "<job id>.<step id>[.restart<n>]"."""
    digest = hashlib.sha1(run.encode()).digest()
    return PORT_BASE + int.from_bytes(digest[:4], "big") % PORT_SPAN


def apply_layout(
    conf: TorchrunLauncherConf, layout: ClusterLayout, user_set: AbstractSet[str] = frozenset()
) -> TorchrunLauncherConf:
    """A copy of `conf` whose keys still at the plugin's default take the detected values.

    nnodes, node_rank and rdzv_id come from the step; rdzv_backend static (the default)
    becomes c10d; an empty rdzv_endpoint of c10d becomes master_addr:master_port, each
    the user's where set, else node 0 of the step and the port derived from the job and
    step ids. `standalone: true` keeps the job single-node (nothing changes). A key in
    `user_set` (the user gave it, e.g. `hydra.launcher.nnodes=1`) is the user's even when
    it equals the default.
    """
    return dataclasses.replace(conf, **_detected_values(conf, layout, user_set))


def resolve_cluster(
    settings: JobSettings, environ: Mapping[str, str], user_set: AbstractSet[str] = frozenset()
) -> Tuple[JobSettings, Optional[str]]:
    """A job's settings with what `cluster` detects applied, and the one line to log (or None)."""
    conf = settings.conf
    detection = inspect_environment(conf.cluster, environ)
    if detection.layout is None:
        return settings, detection.note
    if conf.standalone:
        return settings, f"{detection.note}; hydra.launcher.standalone=true: running single-node"
    taken = _detected_values(conf, detection.layout, user_set)
    new = dataclasses.replace(conf, **taken)
    min_nodes, max_nodes = parse_nnodes(new.nnodes)
    used = ", ".join(
        f"{key}={getattr(new, key)}" + ("" if key in taken else " (yours)")
        for key in ("nnodes", "node_rank", "rdzv_backend", "rdzv_endpoint", "rdzv_id")
    )
    line = f"{detection.note}; using {used}"
    return dataclasses.replace(settings, conf=new, min_nodes=min_nodes, max_nodes=max_nodes), line


def _detected_values(
    conf: TorchrunLauncherConf, layout: ClusterLayout, user_set: AbstractSet[str] = frozenset()
) -> Dict[str, Any]:
    """The keys of `conf` the user left alone, with the values the step gives them."""
    if conf.standalone:
        return {}
    default = TorchrunLauncherConf()

    def left_alone(key: str) -> bool:
        return key not in user_set and str(getattr(conf, key)) == str(getattr(default, key))

    taken: Dict[str, Any] = {}
    if left_alone("nnodes"):
        taken["nnodes"] = layout.nnodes
    if left_alone("node_rank"):
        taken["node_rank"] = layout.node_rank
    if left_alone("rdzv_id"):
        taken["rdzv_id"] = layout.rdzv_id
    backend = conf.rdzv_backend
    if left_alone("rdzv_backend"):
        backend = taken["rdzv_backend"] = "c10d"
    if backend == "c10d" and not conf.rdzv_endpoint:
        host = layout.master_addr if left_alone("master_addr") else conf.master_addr
        port = conf.master_port if conf.master_port is not None else layout.port
        taken["rdzv_endpoint"] = f"{host}:{port}"
    return taken


def _not_a_step(cluster: str, job_id: str, why: str) -> Detection:
    if cluster == "slurm":
        raise LauncherConfigError(
            f"hydra.launcher.cluster=slurm needs the launcher to run as an srun task, one per node: {why}"
        )
    return Detection(None, f"SLURM job {job_id}: {why}; running single-node")


def _check_one_task_per_node(environ: Mapping[str, str], nnodes: int) -> None:
    ntasks = _int_var(environ, "SLURM_STEP_NUM_TASKS") if environ.get("SLURM_STEP_NUM_TASKS") else None
    local_id = _int_var(environ, "SLURM_LOCALID") if environ.get("SLURM_LOCALID") else 0
    if (ntasks is not None and ntasks > nnodes) or local_id > 0:
        per_node = environ.get("SLURM_STEP_TASKS_PER_NODE", "?")
        raise LauncherConfigError(
            f"SLURM_STEP_TASKS_PER_NODE={per_node}: this srun step runs more than one task per node "
            f"(SLURM_STEP_NUM_TASKS={ntasks}, SLURM_STEP_NUM_NODES={nnodes}), and each task would "
            f"run the whole sweep; the launcher starts nproc_per_node ranks itself: start it with "
            f"`srun --ntasks-per-node=1` (or set hydra.launcher.cluster=none)"
        )


def _int_var(environ: Mapping[str, str], name: str) -> int:
    value = environ.get(name, "")
    try:
        number = int(value)
    except ValueError:
        number = -1
    if number < 0:
        raise LauncherConfigError(
            f"{name}={value!r} is not a count or index; set hydra.launcher.cluster=none to ignore SLURM"
        )
    return number


def _expand(environ: Mapping[str, str], name: str, value: Optional[str] = None) -> Tuple[str, ...]:
    text = environ.get(name, "") if value is None else value
    try:
        nodes = tuple(hostlist.expand_hostlist(text))
    except hostlist.BadHostlist as e:
        raise LauncherConfigError(
            f"{name}={text!r} is not a Slurm hostlist ({e}); set hydra.launcher.cluster=none to ignore SLURM"
        ) from e
    if not nodes:
        raise LauncherConfigError(f"{name} is empty; set hydra.launcher.cluster=none to ignore SLURM")
    return nodes
