"""LSF: one launcher per node started by `jsrun` (IBM's job step launcher, as on Summit).

`jsrun -n <nodes> -r 1 -a 1 -c ALL_CPUS -g ALL_GPUS python app.py -m ...` starts one
launcher per node. jsrun gives each its index and the count (JSM_NAMESPACE_RANK/SIZE, and
JSM_NAMESPACE_LOCAL_SIZE: the launchers on this host); the hosts come from LSF's rank file
(LSB_DJOB_RANKFILE: one line per slot, the first the launch node, where the batch script
runs and no task does). The first compute host is node 0, the rendezvous host; the port is
derived from the job's id (LSB_JOBID, LSB_JOBINDEX for an array element), so every node
computes the same one. Lightning's LSFEnvironment reads the same variables.
"""

from pathlib import Path
from typing import Mapping, Optional, Tuple

from .._shared.config_error import LauncherConfigError
from .cluster_layout import ClusterLayout, Detection, derived_port, int_var

_IGNORE = "set hydra.launcher.cluster=none to ignore LSF"
_JSM_VARS = ("JSM_NAMESPACE_SIZE", "JSM_NAMESPACE_RANK")
_START = "`jsrun -n <nodes> -r 1 -a 1 -c ALL_CPUS -g ALL_GPUS python app.py --multirun ...`"


def present(environ: Mapping[str, str]) -> Optional[str]:
    """A few words naming the LSF job (or jsrun task) this process runs in, or None."""
    if environ.get("LSB_JOBID"):
        return f"LSF job {environ['LSB_JOBID']}"
    jsm = next((name for name in _JSM_VARS if environ.get(name)), None)
    return f"a jsrun task ({jsm}={environ[jsm]})" if jsm else None


def inspect(required: bool, environ: Mapping[str, str]) -> Detection:
    """The layout of the jsrun step this launcher is a task of; `required` (cluster: lsf):
    not being one is an error."""
    job_id = environ.get("LSB_JOBID", "")
    jsm = next((name for name in _JSM_VARS if environ.get(name)), None)
    if jsm and not job_id:
        raise LauncherConfigError(
            f"{jsm} is set (a jsrun task) but LSB_JOBID is not: the LSF job every node derives its "
            f"rendezvous from is unknown; {_IGNORE}"
        )
    if not job_id or not environ.get("JSM_NAMESPACE_SIZE"):
        where = (
            f"LSF job {job_id} but no jsrun task (JSM_NAMESPACE_SIZE is not set)" if job_id else "no LSF job"
        )
        if required:
            raise LauncherConfigError(
                f"hydra.launcher.cluster=lsf needs the launcher to run as a jsrun task, one per node: "
                f"{where}; start it with {_START}"
            )
        if not job_id:
            return Detection(None, None)
        return Detection(None, f"{where}: running single-node; to use the job's nodes: {_START}")
    size = int_var(environ, "JSM_NAMESPACE_SIZE", "LSF")
    rank = int_var(environ, "JSM_NAMESPACE_RANK", "LSF")
    if not 0 <= rank < size:
        raise LauncherConfigError(
            f"JSM_NAMESPACE_RANK={rank} is not a rank of JSM_NAMESPACE_SIZE={size}; {_IGNORE}"
        )
    hosts = compute_hosts(environ)
    index = environ.get("LSB_JOBINDEX", "0")
    run = job_id if index in ("", "0") else f"{job_id}[{index}]"
    where = f"LSF job {run}: {size} jsrun task(s) on {len(hosts)} compute host(s), this is task {rank}"
    if size == 1:
        return Detection(None, f"{where}: a single task, running single-node")
    local_var = "JSM_NAMESPACE_LOCAL_SIZE"
    local = int_var(environ, local_var, "LSF") if environ.get(local_var) else 1
    if local > 1:
        where += f", {local} of them on this host (one per node: jsrun -r 1 -a 1)"
    layout = ClusterLayout(
        source="LSF",
        nnodes=size,
        node_rank=rank,
        master_addr=hosts[0],
        port=derived_port(f"lsf-{run}"),
        rdzv_id=f"lsf-{run}",
        description=where,
        job_id=run,
        nodes=hosts,
    )
    return Detection(layout, where)


def compute_hosts(environ: Mapping[str, str]) -> Tuple[str, ...]:
    """The job's compute hosts, in the rank file's order, each once, the launch node left out
    (the first line of LSB_DJOB_RANKFILE)."""
    path = environ.get("LSB_DJOB_RANKFILE")
    if not path:
        raise LauncherConfigError(f"LSB_DJOB_RANKFILE is not set: the job's hosts are unknown; {_IGNORE}")
    try:
        lines = [line.strip() for line in Path(path).read_text().splitlines() if line.strip()]
    except OSError as e:
        raise LauncherConfigError(
            f"LSB_DJOB_RANKFILE={path!r} cannot be read ({e.strerror}); {_IGNORE}"
        ) from e
    hosts = tuple(dict.fromkeys(lines[1:]))
    if not hosts:
        raise LauncherConfigError(
            f"LSB_DJOB_RANKFILE={path!r} names no compute host (only the launch node, or nothing); {_IGNORE}"
        )
    return hosts
