"""SLURM: nnodes, node_rank and the rendezvous from an `srun` step's variables.

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

Hostlists (`node[01-04]`) are expanded by SLURM's own `scontrol show hostnames`, which is
there wherever a step runs: the hostlist syntax is SLURM's, and the one Python library
that parses it is GPL-licensed, which this MIT package must not require.
"""

import shutil
from typing import Mapping, Optional, Tuple

from .._shared import slurm_commands
from .._shared.config_error import LauncherConfigError
from .cluster_layout import ClusterLayout, Detection, derived_port, int_var

# slurm.h: ids above this are the special steps (pending, extern, batch, interactive)
SLURM_MAX_NORMAL_STEP_ID = 0xFFFFFFF0

_STEP_VARS = ("SLURM_STEP_NUM_NODES", "SLURM_STEP_NODELIST", "SLURM_NODEID")
_IGNORE = "set hydra.launcher.cluster=none to ignore SLURM"


def present(environ: Mapping[str, str]) -> Optional[str]:
    """A few words naming the SLURM job this process runs in, or None."""
    job_id = _job_id(environ)
    return f"SLURM job {job_id}" if job_id else None


def inspect(required: bool, environ: Mapping[str, str]) -> Detection:
    """Read SLURM's variables; raise LauncherConfigError where they cannot be used safely.

    `required` (cluster: slurm): not running as an srun task is an error, not single-node.
    """
    job_id = _job_id(environ)
    step_var = "SLURM_STEP_ID" if environ.get("SLURM_STEP_ID") else "SLURM_STEPID"
    if not job_id or not environ.get(step_var):
        where = (
            f"SLURM job {job_id} but no job step (an salloc shell or a batch script)"
            if job_id
            else "no SLURM job"
        )
        if required:
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

    step_id = int_var(environ, step_var, "SLURM")
    if step_id >= SLURM_MAX_NORMAL_STEP_ID:
        # a special step (batch, extern, interactive) is not an srun step of the user's
        return _not_a_step(
            required, job_id, f"SLURM_STEP_ID={step_id} is a special step (batch/extern/interactive)"
        )
    missing = [name for name in _STEP_VARS if not environ.get(name)]
    if missing:
        return _not_a_step(required, job_id, f"{missing[0]} is not set")

    nnodes = int_var(environ, "SLURM_STEP_NUM_NODES", "SLURM")
    node_rank = int_var(environ, "SLURM_NODEID", "SLURM")
    nodes = expand(environ, "SLURM_STEP_NODELIST")
    if len(nodes) != nnodes:
        raise LauncherConfigError(
            f"SLURM_STEP_NODELIST={environ['SLURM_STEP_NODELIST']!r} names {len(nodes)} node(s) but "
            f"SLURM_STEP_NUM_NODES={nnodes}; {_IGNORE}"
        )
    if not 0 <= node_rank < nnodes:
        raise LauncherConfigError(
            f"SLURM_NODEID={node_rank} is not a node of this {nnodes}-node step; {_IGNORE}"
        )
    # variables inherited from another step (a job submitted from inside a step) name
    # nodes that are not this node, or not in this job: never take those
    here = environ.get("SLURMD_NODENAME")
    if here and nodes[node_rank] != here:
        return _not_a_step(
            required,
            job_id,
            f"SLURMD_NODENAME={here} is not node {node_rank} ({nodes[node_rank]}) of "
            f"SLURM_STEP_NODELIST (variables of another step?)",
        )
    job_nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
    if job_nodelist:
        stray = sorted(set(nodes) - set(expand(environ, "SLURM_JOB_NODELIST", job_nodelist)))
        if stray:
            return _not_a_step(
                required,
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
    restarts = int_var(environ, "SLURM_RESTART_COUNT", "SLURM") if environ.get("SLURM_RESTART_COUNT") else 0
    run = f"{job_id}.{step_id}" + (f".restart{restarts}" if restarts else "")
    layout = ClusterLayout(
        source="SLURM",
        nnodes=nnodes,
        node_rank=node_rank,
        master_addr=nodes[0],
        port=derived_port(run),
        rdzv_id=f"slurm-{run}",
        description=where,
        job_id=job_id,
        step_id=step_id,
        nodes=tuple(nodes),
    )
    return Detection(layout, where)


def expand(environ: Mapping[str, str], name: str, value: Optional[str] = None) -> Tuple[str, ...]:
    """The host names of the SLURM hostlist in variable `name` (or `value`), in order.

    A list without brackets is already expanded ("a1,b2"); one with brackets goes to
    `scontrol show hostnames`, once per sweep for each list.
    """
    text = environ.get(name, "") if value is None else value
    if "[" not in text:
        nodes = tuple(host.strip() for host in text.split(",") if host.strip())
    else:
        if shutil.which("scontrol") is None:
            raise LauncherConfigError(
                f"{name}={text!r} is a SLURM hostlist, and `scontrol` (SLURM's client, which expands "
                f"it) is not on PATH; put SLURM's bin dir on PATH or {_IGNORE}"
            )
        try:
            nodes = slurm_commands.hostnames(text)
        except (OSError, slurm_commands.SlurmCommandError) as e:
            raise LauncherConfigError(
                f"{name}={text!r}: `scontrol show hostnames` could not expand it ({e}); {_IGNORE}"
            ) from e
    if not nodes:
        raise LauncherConfigError(f"{name} is empty; {_IGNORE}")
    return nodes


def _job_id(environ: Mapping[str, str]) -> Optional[str]:
    return environ.get("SLURM_JOB_ID") or environ.get("SLURM_JOBID")


def _not_a_step(required: bool, job_id: str, why: str) -> Detection:
    if required:
        raise LauncherConfigError(
            f"hydra.launcher.cluster=slurm needs the launcher to run as an srun task, one per node: {why}"
        )
    return Detection(None, f"SLURM job {job_id}: {why}; running single-node")


def _check_one_task_per_node(environ: Mapping[str, str], nnodes: int) -> None:
    ntasks = (
        int_var(environ, "SLURM_STEP_NUM_TASKS", "SLURM") if environ.get("SLURM_STEP_NUM_TASKS") else None
    )
    local_id = int_var(environ, "SLURM_LOCALID", "SLURM") if environ.get("SLURM_LOCALID") else 0
    if (ntasks is not None and ntasks > nnodes) or local_id > 0:
        per_node = environ.get("SLURM_STEP_TASKS_PER_NODE", "?")
        raise LauncherConfigError(
            f"SLURM_STEP_TASKS_PER_NODE={per_node}: this srun step runs more than one task per node "
            f"(SLURM_STEP_NUM_TASKS={ntasks}, SLURM_STEP_NUM_NODES={nnodes}), and each task would "
            f"run the whole sweep; the launcher starts nproc_per_node ranks itself: start it with "
            f"`srun --ntasks-per-node=1` (or set hydra.launcher.cluster=none)"
        )
